"""How a chat template writes tool calls, and the other forms small models write them in.

Contract: `call_syntax(tokenizer)` is the call syntax a model's chat template renders (`HERMES`, the one of
Qwen2.5/Qwen3 and Hermes templates: `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`; besides its
own form a syntax reads the forms small models write instead: a JSON object whose "name" is a tool's, in a
markdown block, bare, or in the doubled braces of Qwen2.5's template's example), or None when the template renders
no tools; `syntax.for_tools(names)` binds it to a request's tools. A `CallSyntax` is data: the grammar built from
it is `chat.grammar`'s, the parser that reads it back `chat.parser`'s.
"""

from __future__ import annotations

from dataclasses import dataclass


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
