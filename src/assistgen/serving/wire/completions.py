"""POST /v1/completions: its body, its prompts and its choices' log-probabilities.

Contract: `CompletionRequest` is the body (a prompt, or several: n choices each, the n best of best_of candidates;
`echo`; `logprobs`: alternatives per token); `completion_prompts` gives its prompts (a string, token ids, or a list of
either); `completion_logprobs` is a choice's `logprobs` as the endpoint answers them ({tokens, token_logprobs,
top_logprobs, text_offset}).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from assistgen.config import MAX_LOGPROBS
from assistgen.core.logprobs import TokenLogprob
from assistgen.serving.wire.common import FAIL_FAST, MAX_CHOICES, MAX_PROMPTS, Sampling, token_text
from assistgen.serving.wire.errors import APIError


class CompletionRequest(Sampling):
    prompt: (str | Annotated[list[str], FAIL_FAST] | Annotated[list[int], FAIL_FAST]
             | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST])
    echo: bool = False
    logprobs: int | None = Field(None, strict=True, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    best_of: int | None = Field(None, strict=True)  # candidates per prompt, of which the n best are answered
    suffix: Any = None

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def asked_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def choices(self) -> tuple[int, int]:
        """(n, best_of): best_of candidates generated per prompt, the n with the highest log-probability per token
        answered (OpenAI's definition); never streamed when best_of > n (the best are known only at the end)."""
        n, _ = super().choices()
        if self.best_of is None:
            return n, n
        if not n <= self.best_of <= MAX_CHOICES:
            raise APIError(400, f"best_of must be from n ({n}) to {MAX_CHOICES}, got {self.best_of}.",
                           param="best_of")
        if self.stream and self.best_of > n:
            raise APIError(400, "best_of: which candidates are best is known only once all have finished, so "
                           "best_of above n cannot be streamed: set stream false, or best_of equal to n.",
                           param="best_of")
        return n, self.best_of


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a list of either (one choice each)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: give a prompt (a string, token ids, or a list of them), not an empty list.",
                       param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}; send them in "
                       "several.", param="prompt")
    return list(prompt)


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], offset: int,
                        echoed: tuple[list[int], list[TokenLogprob] | None] | None = None) -> dict:
    """A completion choice's `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}) for these tokens,
    whose text starts at character `offset`; `echoed`: the prompt's ids and logprobs, listed first (its first
    token has none)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token: int, logprob: float | None, top: dict | None) -> None:
        nonlocal offset
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)

    if echoed is not None:
        ids, prompt = echoed
        add(ids[0], None, None)
        logprobs = (prompt or []) + logprobs
    for lp in logprobs:
        add(lp.token, lp.logprob, {token_text(tokenizer, t): v for t, v in lp.top})
    return out
