"""A step as data: what one target pass feeds and verifies, built by phases that return plans.

Contract: `Planned` is one decoding generation's part of a step: its proposal (the draft and the drafter that made
it), how many of the draft's tokens the pass verifies (`verified`), the draft token right after them when the
grammar forbids it (`forbidden`) and the other drafts verified beside it in forks of its cache (`alternatives`).
`StepPlan` is the whole step: those plans, the prompt chunks of the generations still prefilling, and the costs the
step is priced with; `feeds()` gives the pass's (cache, ids, rows kept) in order: the decoding generations', the
prefilling ones', then the alternatives'. Plans are frozen: each phase of `engine.plan_step` returns new ones
(`dataclasses.replace`), and a generation's own state changes only after the pass (`engine.accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

from assistgen.backends.base import Cache, Feed
from assistgen.core.state import GenerationState
from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Proposal


@dataclass(frozen=True)
class Alternative:
    """Another drafter's draft, verified whole in a fork of the generation's cache in the same pass."""

    proposal: Proposal
    cache: Cache


@dataclass(frozen=True)
class Planned:
    state: GenerationState
    proposal: Proposal
    verified: int = 0
    forbidden: int | None = None
    alternatives: tuple[Alternative, ...] = ()

    @property
    def ids(self) -> list[int]:
        """What the pass feeds for it: its unfed tokens, then the verified draft."""
        return self.state.unfed + self.proposal.draft.tokens[: self.verified]

    @property
    def rows(self) -> int:
        """Every row it adds to the pass: its own and its alternatives'."""
        unfed = len(self.state.unfed)
        return unfed + self.verified + sum(unfed + len(a.proposal.draft.tokens) for a in self.alternatives)


@dataclass(frozen=True)
class StepPlan:
    decoding: tuple[Planned, ...]
    prefill: tuple[tuple[GenerationState, list[int]], ...]  # (generation, the prompt tokens it feeds)
    costs: PassCosts | None  # the first decoding schedule's (None: only fixed rules)

    def feeds(self) -> list[Feed]:
        # A decoding generation's rows all keep their logits (so that every row is verified alike: a backend may
        # compute rows without logits another way, `LlamaModel.feed_together`); its last verified + 1 are read.
        feeds = [(p.state.cache, p.ids, len(p.ids)) for p in self.decoding]
        feeds += [(s.cache, ids, len(ids) if s.config.prompt_logprobs is not None else 1) for s, ids in self.prefill]
        feeds += [(a.cache, ids, len(ids)) for p in self.decoding for a in p.alternatives
                  for ids in [p.state.unfed + a.proposal.draft.tokens]]
        return feeds
