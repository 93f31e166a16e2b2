"""The fields every text endpoint takes: `Sampling`, from which the completions, chat and responses bodies derive.

Contract: every field OpenAI's API defines for these endpoints is declared: honoured, or listed in `REFUSED` with the
values that mean "off" (anything else is a 400 naming the field: `refuse_unsupported`), or in `NO_EFFECT` (fields
that change no reply by OpenAI's own definition); unknown extra fields are ignored, as OpenAI's clients send some.
`FINISH_REASONS` maps the engine's finish reasons to OpenAI's; `new_id` makes an id as OpenAI's look; `token_text`
is a token as the answers show it.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from assistgen.serving.wire.errors import APIError

# The most items a request's lists may hold (with the body's size, `gate.Gate`, they bound what a request allocates)
MAX_MESSAGES = 4096  # messages of a chat, items of a response's input
MAX_STOP = 16  # stop strings (OpenAI's own limit is 4)
MAX_PROMPTS = 256  # prompts of one completion request
MAX_TOOLS = 256  # tools a request offers
MAX_CHOICES = 128  # n (and best_of) per prompt: OpenAI's own limit
FAIL_FAST = Field(fail_fast=True)  # a list's validation stops at its first bad item: one error, not one per item
FINISH_REASONS = {"length": "length", "context": "length", "eos": "stop", "stop": "stop", "cancelled": "abort",
                  "timeout": "timeout"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# Fields OpenAI's API defines that this server does not do: each is accepted only at its "off" values and
# refused with a 400 naming it otherwise (a field accepted and ignored would be a silent wrong answer).
# name -> (the values that mean "off", why it is refused). The README's request-field table lists them.
REFUSED: dict[str, tuple[tuple, str]] = {
    "functions": ((None, []), "functions (deprecated by OpenAI) is not supported: give tools instead."),
    "function_call": ((None, "none"), "function_call (deprecated by OpenAI) is not supported: give tool_choice."),
    "suffix": ((None, ""), "suffix (insertion) is not supported."),
    "audio": ((None,), "audio output is not supported."),
    "modalities": ((None, ["text"]), "only the text modality is supported."),
    "reasoning_effort": ((None,), "this model has no reasoning settings."),
    "web_search_options": ((None,), "web search is not supported."),
    "store": ((None, False), "nothing is stored by this server."),
    "service_tier": ((None, "auto", "default"), "this server has one service tier."),
    # other servers' extensions that change the output (vLLM's sampling parameters): refused, not ignored
    "use_beam_search": ((None, False), "beam search is not supported."),
    "length_penalty": ((None, 1, 1.0), "length_penalty (beam search) is not supported."),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported: use completions with echo and logprobs."),
}
# Fields that change nothing in a reply by OpenAI's own definition, accepted as they are.
NO_EFFECT = {"user": "an end-user id for the client's own records", "metadata": "tags for stored replies"}


class Sampling(BaseModel):
    """Fields both endpoints take; unknown fields (clients send some) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, strict=True)  # None: up to the end of the context (the server's limit)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, strict=True)  # an extension of OpenAI's API
    seed: int | None = Field(None, strict=True, ge=-(2**63), lt=2**64)
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    n: int | None = Field(None, strict=True)  # choices per prompt (`choices`)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: Any = None  # text | json_object | json_schema (`structure_of` checks it)
    structured_outputs: Any = None  # vLLM's extension: {"json": schema} | {"regex": ...} | {"grammar": ...}
    guided_json: Any = None  # vLLM's older names for the same: a schema, a regex, a grammar
    guided_regex: Any = None
    guided_grammar: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    guided_choice: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None  # refused unless "off" (REFUSED)
    # the sampling set (`generation.processing_settings`): typed loosely so that a bad value's 400 names the field
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def tokens_field(self) -> str:
        """The name of the field that asked for new tokens (errors name it)."""
        return "max_tokens"

    def asked_logprobs(self) -> int | None:
        """How many alternatives to list per emitted token (None: no logprobs)."""
        return None

    def asked_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions with echo)."""
        return None

    def choices(self) -> tuple[int, int]:
        """(n: the choices answered per prompt, 1 to MAX_CHOICES; how many are generated per prompt: n here,
        completions' best_of there)."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_CHOICES:
            raise APIError(400, f"n must be from 1 to {MAX_CHOICES} (choices per prompt), got {n}.", param="n")
        return n, n


def refuse_unsupported(body: Sampling, refused: dict[str, tuple[tuple, str]] = REFUSED) -> None:
    """A 400 naming the first field of `refused` that is set to anything but its "off" values."""
    def same(value, off) -> bool:
        return value == off and isinstance(value, bool) == isinstance(off, bool)

    for name, (off, reason) in refused.items():
        value = getattr(body, name, None)
        if value is not None and not any(same(value, v) for v in off):
            raise APIError(400, f"{name}: {reason}", param=name)


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: the prefix, "_", 24 hex digits (call_..., resp_..., msg_..., fc_...)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])
