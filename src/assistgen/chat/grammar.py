"""The grammar that makes every tool call valid by construction.

Contract: `call_structure(syntax, tools, choice, parallel)` is the `config.Structure` (a Lark grammar with lazy
triggers) under which every call the model writes is one of `tools` (`chat.tools.Tool`) with arguments valid for
that tool's parameter schema (laid out as templates render arguments), named by the tool's place when its schema is no
object (`ToolSchemaError`): with `choice="auto"` text is free until the model opens a call in one of the syntax's
forms (`chat.syntax`); "required" and a tool's name make the output calls only, in the template's form;
`parallel=False` ends it after the first call. A marker the syntax's tokenizer writes as one special token
(`syntax.specials`) is that token in the grammar (`<[id]>`), not its text: a call opens, in "auto" too, where the
model writes the token (in "auto" the marker's text spelled in other tokens opens one as well: the parser reads the
two alike). The whole grammar is compiled once, by the request's admission (`core.constraint`), as any structure is;
where it does not compile, `faulty_tool` says which tool's schema made it fail.
"""

from __future__ import annotations

import json

from assistgen.chat.syntax import CallSyntax, Special
from assistgen.chat.tools import Tool
from assistgen.config import ConfigError, Structure
from assistgen.core.constraint import error_line, json_grammar, llguidance


class ToolChoiceError(ConfigError):
    """A tool_choice that names no tool among the tools."""


class ToolSchemaError(ConfigError):
    """A tool whose parameter schema does not compile; `index`: its place among the tools."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def arguments_grammar(tool: Tool, index: int) -> str:
    """The grammar of the tool's arguments (a Lark `%json` reference): its parameter schema, laid out with ", " and
    ": " as chat templates render arguments (`tojson`), no other whitespace (not compiled here: `faulty_tool`)."""
    try:
        return json_grammar(tool.parameters)
    except (ValueError, TypeError) as e:
        raise schema_error(tool, index, str(e)) from e


def schema_error(tool: Tool, index: int, error: str) -> ToolSchemaError:
    return ToolSchemaError(index, f"tools[{index}].function.parameters ({tool.name}): the JSON schema does not "
                           f"compile: {error_line(error)}")


def faulty_tool(tools: list[Tool]) -> ToolSchemaError | None:
    """The first tool whose parameter schema does not compile alone, as the error naming it (None: each compiles):
    asked only once the whole grammar has failed to compile, to say which tool made it fail."""
    llg = llguidance()
    for index, tool in enumerate(tools):
        try:
            grammar = arguments_grammar(tool, index)
            error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: {grammar}"))
        except ToolSchemaError as e:
            return e
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            return schema_error(tool, index, error)
    return None


def literal(text: str) -> str:
    """A Lark string literal (nothing when the text is empty)."""
    return json.dumps(text) if text else ""


def sequence(text: str, specials: tuple[Special, ...] = ()) -> str:
    """The Lark items that match `text` as the model writes it: string literals, and each special marker in it as
    its token (`<[id]>`)."""
    for special in specials:
        if special.text in text:
            head, tail = text.split(special.text, 1)
            return " ".join(p for p in (sequence(head, specials), f"<[{special.token}]>", sequence(tail, specials))
                            if p)
    return literal(text)


def trigger_rules(name: str, trigger: str, specials: tuple[Special, ...]) -> list[str]:
    """The rules of free text up to a trigger: a lazy lexeme (the text ends where the trigger's first appears); where
    the trigger holds a special token (which free text cannot: no lexeme holds one), also the text and then the
    token, the way the model writes it (the parser reads both alike, so both open a constrained call)."""
    if not any(s.text in trigger for s in specials):
        return [f"{name}[lazy]: TEXT {literal(trigger)}"]
    return [f"{name}: TEXT {sequence(trigger, specials)} | {name}_text",
            f"{name}_text[lazy]: TEXT {literal(trigger)}"]


def call_structure(syntax: CallSyntax, tools: list[Tool], choice: str = "auto", parallel: bool = True) -> Structure:
    """The Lark grammar under which the model's calls are `tools`' with valid arguments. choice: "auto" (text, and
    calls where the model opens one in any of the syntax's forms: a lazy lexeme, free text up to the first trigger),
    "required" (calls only, at least one, in the template's own form, a newline between two and at most one after
    the last, where templates end a call's line before the turn's end) or a tool's name (calls of that tool only);
    `parallel=False`: one call at most, and nothing after it but a newline."""
    chosen = [(i, t) for i, t in enumerate(tools) if choice in ("auto", "required") or t.name == choice]
    if not chosen:
        raise ToolChoiceError(f"tool_choice names {choice!r}, which is not among the tools "
                              f"({', '.join(t.name for t in tools)}).")
    grammars = {t.name: arguments_grammar(t, i) for i, t in chosen}
    rules = ["%llguidance {}"]
    tags = []
    specials = syntax.specials
    if choice == "auto":
        named = syntax.for_tools([t.name for _, t in chosen])
        triggers = {trigger: f"trigger_{j}" for j, (trigger, _) in enumerate(named.triggers())}
        rules += [line for trigger, rule in triggers.items() for line in trigger_rules(rule, trigger, specials)]
        for form in syntax.forms:
            for _, tool in chosen:
                begin = form.begin(tool.name)
                trigger = form.trigger(tool.name)  # (a prefix of `begin`)
                tags.append(f"{triggers[trigger]} {sequence(begin[len(trigger):], specials)} {grammars[tool.name]} "
                            f"{sequence(form.tail, specials)}")
        top = 'TEXT | call "\\n"?' if not parallel else "call* TEXT"
        rules.append("TEXT: /(.|\\n)*/")
    else:
        form = syntax.forms[0]
        tags = [f"{sequence(form.begin(t.name), specials)} {grammars[t.name]} {sequence(form.tail, specials)}"
                for _, t in chosen]
        top = 'call "\\n"?' if not parallel else 'call ("\\n" call)* "\\n"?'
    rules += [f"start: {top}", "call: " + " | ".join(f"call_{i}" for i in range(len(tags)))]
    rules += [f"call_{i}: {tag}" for i, tag in enumerate(tags)]
    return Structure("grammar", "\n".join(rules) + "\n")
