"""Tool calls read back out of the generated text, whole or while it streams.

Contract: `CallParser(syntax).feed(text)` takes the generated text in pieces of any size (one step may accept 17
tokens) and returns `Content`, `CallStart` and `Arguments` events, holding back only what may still turn out to be
syntax (`chat.syntax`'s forms, their markers as the decoded text shows them, `CallSyntax.as_shown`: a marker the
model writes as one special token is read as the text the stream gives for that token; and whitespace, which may
only separate two calls); `finish()` releases held-back text (whitespace at the end dropped; nothing where the
syntax is `calls_only`: there it is a call's marker cut short); `in_call` says whether the text so far ends inside a
call. The events of any split of a text add up to those of the whole (`parse_calls`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from assistgen.chat.syntax import CallForm, CallSyntax


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
        self.triggers = syntax.as_shown().triggers()  # (the markers as the decoded text shows them)
        self.calls_only = syntax.calls_only
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
        """Whether a call has opened and not closed (a generation that ends here left it unfinished), or, where the
        output is calls only, a marker has begun."""
        return self.state != "text" or (self.calls_only and bool(self.buffer.strip()))

    def finish(self) -> list:
        """What is left when the generation ends: held-back text (whitespace at the end dropped; where the output is
        calls only, nothing: it is a marker cut short); an unfinished call's head or tail is dropped (its arguments
        so far were given as they came)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "arguments" and rest:
            return [Arguments(self.calls - 1, rest)]
        if self.state == "text" and rest.strip() and not self.calls_only:
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
