"""How a chat template writes tool calls, and the other forms small models write them in.

Contract: `call_syntax(tokenizer)` is the call syntax a model's chat template renders (`HERMES`, the one of
Qwen2.5/Qwen3 and Hermes templates: `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`; besides its
own form a syntax reads the forms small models write instead: a JSON object whose "name" is a tool's, in a
markdown block, bare, or in the doubled braces of Qwen2.5's template's example), or None when the template renders
no tools; `syntax.for_tools(names)` binds it to a request's tools. The syntax it returns knows, from that tokenizer
at run time, which of its markers the model writes as one special token (`Special`: Qwen2.5's tokenizer holds
`<tool_call>` as an added token, SmolLM2's spells it in five text tokens) and the text a decoded stream shows for
that token (`shown`, what the parser reads). A `CallSyntax` is data: the grammar built from it is
`chat.grammar`'s, the parser that reads it back `chat.parser`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
class Special:
    """A marker the tokenizer holds as one added token (`token`): the tokenizer matches it whole before splitting the
    rest, so the model writes the marker as that token alone; llguidance reads such tokens as special (Qwen2.5's
    `<tool_call>` among them), which no string literal matches, and a grammar names the token by id, `<[id]>`,
    which matches it special or not. `shown`: what the decoded stream shows for it (`decode(skip_special_tokens=
    True)`: the marker itself, or nothing where the tokenizer drops the token)."""

    text: str
    token: int
    shown: str


@dataclass(frozen=True)
class CallSyntax:
    """How a template writes calls: `forms[0]` is the template's own (what a due call is written in), the others
    are read and constrained where the model opens a call with them. `tools`: the names of the request's tools
    (the named triggers' names; `for_tools`); `calls_only`: the output is calls and nothing else (tool_choice
    "required" or a function: any other text is a call's marker cut short). `markers`: the template's own markers,
    which a tokenizer may hold as special tokens; `specials`: those that the syntax's tokenizer does
    (`for_tokenizer`)."""

    name: str
    forms: tuple[CallForm, ...]
    tools: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    specials: tuple[Special, ...] = ()
    calls_only: bool = False

    def for_tools(self, names: list[str], calls_only: bool = False) -> CallSyntax:
        return replace(self, tools=tuple(names), calls_only=calls_only)

    def for_tokenizer(self, tokenizer) -> CallSyntax:
        """The syntax with its markers looked up in the tokenizer (`special_markers`)."""
        return replace(self, specials=special_markers(tokenizer, self.markers))

    def as_shown(self) -> CallSyntax:
        """The syntax as the decoded text shows it (what the parser reads): each special marker replaced by its
        shown text; a form whose opening marker shows nothing opens at its head instead, named by the tool (an
        empty trigger would open a call anywhere)."""
        hidden = [s for s in self.specials if s.shown != s.text]
        if not hidden:
            return self
        forms = tuple(replace(form, open=showing(form.open, hidden), close=showing(form.close, hidden),
                              named=form.named or not showing(form.open, hidden)) for form in self.forms)
        return replace(self, forms=forms, specials=())

    def triggers(self) -> list[tuple[str, CallForm]]:
        """(trigger, form) for every way a call may open in free text."""
        out: dict[str, CallForm] = {}
        for form in self.forms:
            for tool in (self.tools if form.named else ("",)):
                out.setdefault(form.trigger(tool), form)
        return list(out.items())


def showing(text: str, hidden: list[Special]) -> str:
    for special in hidden:
        text = text.replace(special.text, special.shown)
    return text


HERMES = CallSyntax("hermes", (CallForm("<tool_call>", '\n{"name": "', close="}\n</tool_call>"), *FENCED, *BARE),
                    markers=("<tool_call>", "</tool_call>"))


def special_markers(tokenizer, markers: tuple[str, ...]) -> tuple[Special, ...]:
    """The markers the tokenizer holds as one added token: the marker's text encodes to exactly one id, an added token
    whose text is the marker."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = []
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and getattr(added.get(ids[0]), "content", None) == marker:
            out.append(Special(marker, ids[0], tokenizer.decode(ids, skip_special_tokens=True)))
    return tuple(out)


def call_syntax(tokenizer) -> CallSyntax | None:
    """The syntax the tokenizer's chat template asks tool calls in, its markers looked up in the tokenizer, or None
    (it renders no tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # (several named templates: the tool-use one, else the default)
        template = template.get("tool_use") or template.get("default") or ""
    if "tools" in template and "<tool_call>" in template:
        return HERMES.for_tokenizer(tokenizer)
    return None
