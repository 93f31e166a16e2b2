"""Sessions and conversations: generations on one model that keep their keys and values between calls.

Contract: a `Session`'s calls start from the longest prefix of their prompt an earlier call computed (its
`PrefixCache`) and give what the same call gives without it; a `Conversation` keeps the chat's messages and renders
each turn through the chat template.
"""

from __future__ import annotations

from collections.abc import Iterator

from assistgen.api.generation import Generation, generate, stream
from assistgen.api.names import as_model
from assistgen.backends.base import LanguageModel
from assistgen.chat.templates import encode_chat
from assistgen.config import ConfigError
from assistgen.core.prefix import PrefixCache, check_capacity, default_capacity
from assistgen.core.state import Chunk


class Session:
    """Generations on one model that keep their keys and values between calls: each call feeds only what follows
    the longest prefix of its prompt an earlier call of the session computed (a `PrefixCache` of at most `capacity`
    bytes; None: `prefix.default_capacity`). `generate` and `stream` take `generate`'s arguments; `defaults` are
    given to every call (a call's own arguments win). The output is what the same call gives without the session
    (on llama.cpp, load the model with `exact_prompts=True` for that to hold bit for bit: prompts then run on the
    row-exact kernels, as decoding does)."""

    def __init__(self, model: LanguageModel | str, capacity: int | None = None, **defaults):
        self.model = as_model(model)
        capacity = default_capacity(self.model) if capacity is None else capacity
        check_capacity(self.model, capacity)
        limit = self.model.max_sequences  # (leave sequences for the generation and its forks)
        self.prefix = PrefixCache(self.model, capacity, None if limit is None else max(1, limit // 2))
        self.defaults = defaults

    def stream(self, prompt: str | list[int], **arguments) -> Iterator[Chunk]:
        return stream(self.model, prompt, prefix=self.prefix, **{**self.defaults, **arguments})

    def generate(self, prompt: str | list[int], **arguments) -> Generation:
        return generate(self.model, prompt, prefix=self.prefix, **{**self.defaults, **arguments})



class Conversation:
    """A chat with a model that remembers its turns and their keys and values: `say(text)` adds a user message,
    generates the assistant's reply through the chat template (feeding only the new turn when the template renders
    the earlier turns as before) and adds it. `system` starts the conversation; `defaults` as for `Session`."""

    def __init__(self, model: LanguageModel | str, system: str | None = None, capacity: int | None = None,
                 **defaults):
        self.session = Session(model, capacity, **defaults)
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]

    def say(self, text: str, **arguments) -> Generation:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("say() needs the user's message as non-empty text.")
        messages = [*self.messages, {"role": "user", "content": text}]
        reply = self.session.generate(encode_chat(self.session.model, messages), **arguments)
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]
        return reply



