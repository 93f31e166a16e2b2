"""Tool calls in the chat template's own syntax: the grammar that makes every call valid by construction, and the
parser that reads calls back out of the generated text, whole or while it streams.

Contract: `call_syntax(tokenizer)` is the call syntax a model's chat template renders (`HERMES`, the one of
Qwen2.5/Qwen3 and Hermes templates: `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`), or None when
the template renders no tools. `Tool.of(spec, where)` checks one OpenAI function tool (ConfigError naming `where`
and the fix). `call_structure(syntax, tools, choice, parallel)` is the `config.Structure` (an xgrammar structural
tag) under which every call the model writes is one of `tools` with arguments valid for that tool's parameter
schema (laid out as templates render arguments), named by the tool's place when it does not compile
(`ToolSchemaError`): with `choice="auto"` text is free until the model writes the opening tag; "required" and a
tool's name make the output calls only; `parallel=False` ends it after the first call. `CallParser.feed(text)` takes the
generated text in pieces of any size (one step may accept 17 tokens) and returns `Content`, `CallStart` and
`Arguments` events, holding back only what may still turn out to be syntax; `finish()` releases the rest. The
events of any split of a text add up to those of the whole (`parse_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from assistgen.config import ConfigError, Structure
from assistgen.core.constraint import xgrammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class CallSyntax:
    """How a template writes one call: `open` + `{"name": "NAME", "arguments": ` + ARGS + `}` + `close`."""

    name: str
    open: str  # the trigger: the model writing it starts a call
    close: str

    def head(self, tool: str) -> str:
        return f'{self.open}{{"name": "{tool}", "arguments": '

    @property
    def tail(self) -> str:
        return "}" + self.close


HERMES = CallSyntax("hermes", "<tool_call>\n", "\n</tool_call>")


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
        if parameters is None:
            parameters = dict(EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ConfigError(f'{where}.function.parameters: give a JSON schema of type "object" (the arguments '
                              f"are a JSON object), got {json.dumps(parameters)[:80]}.")
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
    """The EBNF grammar of the tool's arguments: its parameter schema, laid out with ", " and ": " as chat
    templates render arguments (`tojson`), no other whitespace."""
    xgr = xgrammar()
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(tool.parameters), any_whitespace=False))
    except (RuntimeError, ValueError, TypeError) as e:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ToolSchemaError(index, f"tools[{index}].function.parameters ({tool.name}): the JSON schema does not "
                              f"compile: {detail}") from e


def call_structure(syntax: CallSyntax, tools: list[Tool], choice: str = "auto", parallel: bool = True) -> Structure:
    """The structural tag under which the model's calls are `tools`' with valid arguments. choice: "auto" (text,
    and calls where the model opens one), "required" (calls only, at least one) or a tool's name (calls of that
    tool only); `parallel=False`: one call at most."""
    chosen = [(i, t) for i, t in enumerate(tools) if choice in ("auto", "required") or t.name == choice]
    if not chosen:
        raise ConfigError(f"tool_choice names {choice!r}, which is not among the tools.")
    tags = [{"type": "tag", "begin": syntax.head(t.name), "end": syntax.tail,
             "content": {"type": "grammar", "grammar": arguments_grammar(t, i)}} for i, t in chosen]
    if choice == "auto":
        calls = {"type": "triggered_tags", "triggers": [syntax.open.rstrip("\n")], "tags": tags,
                 "at_least_one": False, "stop_after_first": not parallel}
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not parallel}
    return Structure("structural_tag", json.dumps({"type": "structural_tag", "format": calls}))


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
        self.syntax = syntax
        self.open = syntax.open.rstrip("\n")  # (what follows the tag is read as the call's head, whitespace and all)
        self.buffer = ""
        self.state = "text"  # text | head (a call opened, its name not read yet) | arguments
        self.calls = 0

    def feed(self, text: str) -> list:
        self.buffer += text
        events: list = []
        while True:
            before = (self.state, len(self.buffer))
            events += getattr(self, f"_{self.state}")()
            if (self.state, len(self.buffer)) == before:
                return events

    def finish(self) -> list:
        """What is left when the generation ends: held-back text, or a call's unfinished arguments."""
        rest, self.buffer = self.buffer, ""
        if self.state == "arguments" and rest:
            return [Arguments(self.calls - 1, rest)]
        if self.state == "text" and rest.strip():
            return [Content(rest)]
        return []

    def _text(self) -> list:
        at = self.buffer.find(self.open)
        if at >= 0:
            text, self.buffer, self.state = self.buffer[:at].rstrip(), self.buffer[at + len(self.open):], "head"
            return [Content(text)] if text else []
        keep = held_back(self.buffer, self.open)
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
        at = self.buffer.find(self.syntax.tail)
        if at >= 0:
            text, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(self.syntax.tail):], "text"
            return [Arguments(self.calls - 1, text)] if text else []
        emit = self.buffer[: len(self.buffer) - held_back(self.buffer, self.syntax.tail)]
        self.buffer = self.buffer[len(emit):]
        return [Arguments(self.calls - 1, emit)] if emit else []


@dataclass
class ParsedCalls:
    content: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [name, arguments' JSON text] per call

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
    return parsed.add(parser.finish())
