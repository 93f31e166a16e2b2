"""One generation between steps, and what a step gives back.

Contract: `GenerationState` is everything one generation carries from step to step (its ids, cache, drafters,
schedule run, sampler, statistics, grammar), and nothing of one step's (that is the step's plan, `core.plan`);
`Chunk` is what a step emits for it. Made by `engine.begin`; nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from assistgen.backends.base import Cache, LanguageModel
from assistgen.config import GenerationConfig
from assistgen.core.constraint import Constraint
from assistgen.core.logprobs import TokenLogprob
from assistgen.core.text import TextStream
from assistgen.spec.drafts import Drafter
from assistgen.spec.sampling import Sampler
from assistgen.spec.steps import ScheduleRun
from assistgen.stats import Stats


@dataclass
class Chunk:
    tokens: list[int]  # token ids emitted by this step
    text: str  # text that became safe to show with this step
    finish_reason: str | None = None  # set on the last chunk: length | eos | stop | context (| cancelled | error)
    stats: Stats | None = None  # the generation's statistics as the loop keeps them (live: a consumer on another
    # thread gets a `Stats.snapshot`, the serving engine's `Request.deliver`); final on the last chunk
    logprobs: list[TokenLogprob] | None = None  # one per token, when the config asks for them
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (the first has none): first chunk only


@dataclass
class GenerationState:
    """One generation between steps: its ids, cache, drafters, schedule run, sampler and statistics."""

    target: LanguageModel
    ids: list[int]  # prompt + emitted tokens
    drafter: Drafter
    drafters: list  # the drafters to try, cheapest first
    run: ScheduleRun
    config: GenerationConfig
    sampler: Sampler
    text: TextStream
    stats: Stats
    eos: set[int]  # the tokens that end it (none under ignore_eos)
    context: int  # the longest the sequence may grow
    cache: Cache
    started: float
    finish: str | None = None
    constraint: Constraint | None = None  # the grammar the output follows (config.structure), or None
    prompt_logprobs: list[TokenLogprob] | None = None  # filled by the prefill when the config asks for them
    ends: frozenset[int] = frozenset()  # the model's end tokens, which min_tokens forbids early (ignore_eos or not)

    @property
    def prompt(self) -> list[int]:
        return self.ids[: self.stats.prompt_tokens]

    @property
    def output(self) -> list[int]:
        return self.ids[self.stats.prompt_tokens:]

    @property
    def prefilling(self) -> bool:
        """Whether its prompt is still being fed: nothing emitted yet (the pass that ends the prompt emits the first
        token)."""
        return self.stats.new_tokens == 0 and self.finish is None

    @property
    def unfed(self) -> list[int]:
        """The tokens a decoding step feeds before its draft: the last one, and those of an alternative kept last step
        (`keep_furthest`), which the cache has not read."""
        return self.ids[len(self.cache):]

    @property
    def room(self) -> int:
        """Draft tokens that can still be used: the sequence never outgrows the context, and a step emits its
        accepted tokens plus one, so r tokens still wanted need at most r - 1 draft tokens."""
        return min(self.context - len(self.ids), self.config.max_new_tokens - self.stats.new_tokens) - 1
