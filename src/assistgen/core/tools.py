"""Tool calls in the chat template's own syntax: the grammar that makes every call valid by construction, and the
parser that reads calls back out of the generated text, whole or while it streams.

Contract: `call_syntax(tokenizer)` is the call syntax a model's chat template renders (`HERMES`, the one of
Qwen2.5/Qwen3 and Hermes templates: `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`; besides its
own form a syntax reads the forms small models write instead: a JSON object whose "name" is a tool's, in a
markdown block, bare, or in the doubled braces of Qwen2.5's template's example), or None when the template renders
no tools; `syntax.for_tools(names)` binds it to a request's tools. `Tool.of(spec, where)` checks one OpenAI function
tool (ConfigError naming `where` and the fix). `call_structure(syntax, tools, choice, parallel)` is the
`config.Structure` (a Lark grammar with lazy triggers) under which every call the model writes is one of `tools`
with arguments valid for that tool's parameter schema (laid out as templates render arguments), named by the tool's
place when it does not compile (`ToolSchemaError`): with `choice="auto"` text is free until the model opens a call
in one of the forms; "required" and a tool's name make the output calls only, in the template's form;
`parallel=False` ends it after the first call. `CallParser.feed(text)` takes the generated text in pieces of any size
(one step may accept 17 tokens) and returns `Content`, `CallStart` and `Arguments` events, holding back only what may
still turn out to be syntax (and whitespace, which may only separate two calls); `finish()` releases held-back text
(whitespace at the end dropped); `in_call` says whether the text so far ends inside a call. The events of any split
of a text add up to those of the whole (`parse_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from assistgen.config import ConfigError, Structure
from assistgen.core.constraint import error_line, json_grammar, llguidance

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class CallForm:
    """One way a call is written: `open` + `lead` + NAME + `middle` + ARGS + `close`. `named`: the trigger that opens
    a call in free text includes the tool's name (for forms the template does not ask for, so that other JSON in a
    reply, a package.json's "name", never turns into a call)."""

    open: str
    lead: str  # from the end of `open` to the name's first character: how the object opens
    middle: str = '", "arguments": '
    close: str = "}"
    named: bool = False

    def begin(self, tool: str) -> str:
        return f"{self.open}{self.lead}{tool}{self.middle}"

    def trigger(self, tool: str) -> str:
        return f'{self.open}{self.lead}{tool}"' if self.named else self.open

    @property
    def tail(self) -> str:
        return self.close


# Small models asked for `<tool_call>` tags often write the call as JSON in a markdown block, or bare, instead; where
# such a JSON object's "name" is one of the tools', the call is read (and constrained) as one, laid out as the model
# began it (on one line, or a key per line indented by 2 or 4).
FENCED = tuple(form for fence in ("```json\n", "```\n") for form in (
    CallForm(fence, '{"name": "', close="}\n```", named=True),
    *(CallForm(fence, f'{{\n{pad}"name": "', f'",\n{pad}"arguments": ', "\n}\n```", named=True)
      for pad in ("  ", "    "))))
BARE = (CallForm("", '{"name": "', named=True),  # (the same object with no block around it, or in the doubled
        CallForm("{", '{"name": "', close="}}", named=True))  # braces of Qwen2.5's template's own example)


@dataclass(frozen=True)
class CallSyntax:
    """How a template writes calls: `forms[0]` is the template's own (what a due call is written in), the others
    are read and constrained where the model opens a call with them. `tools`: the names of the request's tools
    (the named triggers' names; `for_tools`)."""

    name: str
    forms: tuple[CallForm, ...]
    tools: tuple[str, ...] = ()

    def for_tools(self, names: list[str]) -> CallSyntax:
        return CallSyntax(self.name, self.forms, tuple(names))

    def triggers(self) -> list[tuple[str, CallForm]]:
        """(trigger, form) for every way a call may open in free text."""
        out: dict[str, CallForm] = {}
        for form in self.forms:
            for tool in (self.tools if form.named else ("",)):
                out.setdefault(form.trigger(tool), form)
        return list(out.items())


HERMES = CallSyntax("hermes", (CallForm("<tool_call>", '\n{"name": "', close="}\n</tool_call>"), *FENCED, *BARE))


def call_syntax(tokenizer) -> CallSyntax | None:
    """The syntax the tokenizer's chat template asks tool calls in, or None (it renders no tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # (several named templates: the tool-use one, else the default)
        template = template.get("tool_use") or template.get("default") or ""
    if "tools" in template and "<tool_call>" in template:
        return HERMES
    return None


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str = ""

    @classmethod
    def of(cls, spec, where: str) -> Tool:
        """An OpenAI function tool {"type": "function", "function": {"name", "description", "parameters"}}."""
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(spec.get("function"), dict):
            raise ConfigError(f'{where}: give a function tool, {{"type": "function", "function": {{"name": ..., '
                              f'"parameters": {{...}}}}}}.')
        function = spec["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(f"{where}.function.name: a function name is 1-64 letters, digits, _ or -, got "
                              f"{name!r}.")
        parameters = function.get("parameters")
        if not parameters:  # (None or {}: no arguments)
            parameters = dict(EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ConfigError(f'{where}.function.parameters: give a JSON schema of type "object" (the arguments '
                              f"are a JSON object), got {json.dumps(parameters)[:80]}.")
        parameters = {**parameters, "type": "object"}  # (the arguments are an object, whatever else it allows)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ConfigError(f"{where}.function.description: give a string.")
        return cls(name, parameters, description)


class ToolSchemaError(ConfigError):
    """A tool whose parameter schema does not compile; `index`: its place among the tools."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def arguments_grammar(tool: Tool, index: int) -> str:
    """The grammar of the tool's arguments (a Lark `%json` reference): its parameter schema, laid out with ", " and
    ": " as chat templates render arguments (`tojson`), no other whitespace."""
    llg = llguidance()
    try:
        grammar = json_grammar(tool.parameters)
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: {grammar}"))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise ToolSchemaError(index, f"tools[{index}].function.parameters ({tool.name}): the JSON schema does not "
                              f"compile: {error_line(error)}")
    return grammar


def literal(text: str) -> str:
    """A Lark string literal (nothing when the text is empty)."""
    return json.dumps(text) if text else ""


def call_structure(syntax: CallSyntax, tools: list[Tool], choice: str = "auto", parallel: bool = True) -> Structure:
    """The Lark grammar under which the model's calls are `tools`' with valid arguments. choice: "auto" (text, and
    calls where the model opens one in any of the syntax's forms: a lazy lexeme, free text up to the first trigger),
    "required" (calls only, at least one, in the template's own form, a newline between two) or a tool's name
    (calls of that tool only); `parallel=False`: one call at most, and nothing after it."""
    chosen = [(i, t) for i, t in enumerate(tools) if choice in ("auto", "required") or t.name == choice]
    if not chosen:
        raise ConfigError(f"tool_choice names {choice!r}, which is not among the tools.")
    grammars = {t.name: arguments_grammar(t, i) for i, t in chosen}
    rules = ["%llguidance {}"]
    tags = []
    if choice == "auto":
        named = syntax.for_tools([t.name for _, t in chosen])
        triggers = {trigger: f"trigger_{j}" for j, (trigger, _) in enumerate(named.triggers())}
        rules += [f"{rule}[lazy]: TEXT {literal(trigger)}" for trigger, rule in triggers.items()]
        for form in syntax.forms:
            for _, tool in chosen:
                begin = form.begin(tool.name)
                trigger = form.trigger(tool.name)  # (a prefix of `begin`)
                tags.append(f"{triggers[trigger]} {literal(begin[len(trigger):])} {grammars[tool.name]} "
                            f"{literal(form.tail)}")
        top = "TEXT | call" if not parallel else "call* TEXT"
        rules.append("TEXT: /(.|\\n)*/")
    else:
        form = syntax.forms[0]
        tags = [f"{literal(form.begin(t.name))} {grammars[t.name]} {literal(form.tail)}" for _, t in chosen]
        top = "call" if not parallel else 'call ("\\n" call)*'
    rules += [f"start: {top}", "call: " + " | ".join(f"call_{i}" for i in range(len(tags)))]
    rules += [f"call_{i}: {tag}" for i, tag in enumerate(tags)]
    return Structure("grammar", "\n".join(rules) + "\n")


# --- reading calls back -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str  # a fragment of the call's arguments' JSON


HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')  # (once the arguments begin)


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `marker` (they may yet become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallParser:
    """Generated text -> events, as it comes (see the module's contract)."""

    def __init__(self, syntax: CallSyntax):
        self.triggers = syntax.triggers()
        self.form: CallForm | None = None  # the form of the call being read
        self.buffer = ""
        self.state = "text"  # text | head (a call opened, its name not read yet) | arguments | tail (the form's end)
        self.calls = 0
        self.scan = ObjectScan()  # where the arguments of the call being read end
        self.ended_in_call = False

    def feed(self, text: str) -> list:
        self.buffer += text
        events: list = []
        while True:
            before = (self.state, len(self.buffer))
            events += getattr(self, f"_{self.state}")()
            if (self.state, len(self.buffer)) == before:
                return events

    def read(self, text: str, last: bool = False) -> list:
        """`feed(text)`, and `finish()` after the generation's last piece (`ended_in_call` then says whether the text
        ended inside a call: a stop string or the token limit cut it)."""
        events = self.feed(text)
        if last:
            self.ended_in_call = self.in_call
            events += self.finish()
        return events

    @property
    def in_call(self) -> bool:
        """Whether a call has opened and not closed (a generation that ends here left it unfinished)."""
        return self.state != "text"

    def finish(self) -> list:
        """What is left when the generation ends: held-back text (whitespace at the end dropped); an unfinished
        call's head or tail is dropped (its arguments so far were given as they came)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "arguments" and rest:
            return [Arguments(self.calls - 1, rest)]
        if self.state == "text" and rest.strip():
            return [Content(rest)]
        return []

    def _text(self) -> list:
        found = [(self.buffer.find(t), form) for t, form in self.triggers if t in self.buffer]
        if found:
            at, self.form = min(found, key=lambda f: f[0])
            # (what follows the form's opening is read as the call's head, whitespace and all)
            text, self.buffer = self.buffer[:at].rstrip(), self.buffer[at + len(self.form.open):]
            self.state = "head"
            return [Content(text)] if text else []
        keep = max((held_back(self.buffer, t) for t, _ in self.triggers), default=0)
        stripped = self.buffer[: len(self.buffer) - keep]
        keep += len(stripped) - len(stripped.rstrip())  # (whitespace waits: it may only separate two calls)
        emit = self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(emit):]
        return [Content(emit)] if emit else []

    def _head(self) -> list:
        match = HEAD.match(self.buffer)
        if match is None:
            return []
        self.buffer, self.state = self.buffer[match.end():], "arguments"
        self.calls += 1
        return [CallStart(self.calls - 1, match.group(1))]

    def _arguments(self) -> list:
        text, self.buffer = self.buffer, ""
        end = self.scan.feed(text)
        if end is not None:  # (the arguments' object closed `end` characters into this text)
            text, self.buffer = text[:end], text[end:]
            self.scan, self.state = ObjectScan(), "tail"
        return [Arguments(self.calls - 1, text)] if text else []

    def _tail(self) -> list:
        tail = self.form.tail
        if self.buffer.startswith(tail):
            self.buffer, self.state = self.buffer[len(tail):], "text"
        elif not tail.startswith(self.buffer):  # (not the form's end after all: text again)
            self.state = "text"
        return []


class ObjectScan:
    """Where a JSON object fed in pieces ends: the state of one scan over its text, kept between pieces."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """How far into `text` the object ends (just past its closing brace), or None: it goes on."""
        for i, c in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class ParsedCalls:
    content: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [name, arguments' JSON text] per call
    unfinished: bool = False  # the text ended inside a call (a stop string or the token limit cut it)

    def add(self, events: list) -> ParsedCalls:
        for e in events:
            if isinstance(e, Content):
                self.content += e.text
            elif isinstance(e, CallStart):
                self.calls.append([e.name, ""])
            else:
                self.calls[e.index][1] += e.text
        return self


def parse_calls(syntax: CallSyntax, pieces: list[str] | str) -> ParsedCalls:
    """The content and calls of a generated text (given whole or in pieces)."""
    parser = CallParser(syntax)
    parsed = ParsedCalls()
    for piece in [pieces] if isinstance(pieces, str) else pieces:
        parsed.add(parser.feed(piece))
    parsed.add(parser.read("", last=True))
    parsed.unfinished = parser.ended_in_call
    return parsed
