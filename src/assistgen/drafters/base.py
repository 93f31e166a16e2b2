"""Plain decoding and several drafters as one: the drafters the generation loop is given.

Contract: `NoDrafter` proposes nothing (plain decoding: the loop with a drafter that proposes nothing);
`CompositeDrafter` tries several drafters in order, cheapest first (`spec.drafts.first_draft`); `drafters_of`
is the list the loop asks in turn. The interface every drafter implements is `spec.drafts.Drafter`.
"""

from __future__ import annotations

import torch

from assistgen.spec.drafts import Draft, Drafter, first_draft
from assistgen.spec.sampling import Sampler


class NoDrafter(Drafter):
    """Proposes nothing: the loop then decodes one target token per step (plain decoding)."""

    name = "none"
    context_length = None
    model = None
    acceptance_prior = None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        return Draft()


class CompositeDrafter(Drafter):
    """Several drafters tried in order, cheapest first (e.g. prompt lookup, the n-gram cache, a model).

    The generation loop asks each of `drafters` in turn (with the lookahead the schedule picks for each)
    and verifies the first non-empty draft, so a model drafter runs only when the cheap sources have
    nothing; `propose` here does the same with one k for callers outside the loop. Its own `model` and
    `acceptance_prior` are None: the policy reads those of each drafter.
    """

    model = None
    acceptance_prior = None

    def __init__(self, drafters: list):
        if not drafters:
            raise ValueError("CompositeDrafter needs at least one drafter")
        self.drafters = list(drafters)
        self.name = "+".join(d.name for d in self.drafters)
        limits = [d.context_length for d in self.drafters if d.context_length]
        self.context_length = min(limits) if limits else None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        return first_draft(self.drafters, ids, lambda _: k, sampler, min_confidence).draft

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        for drafter in self.drafters:
            drafter.observe(num_accepted, target_probs)

    def finish(self, ids: list[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(ids)

    def report(self) -> dict:
        out: dict = {}
        for drafter in self.drafters:
            out.update(drafter.report())
        return out


def drafters_of(drafter: Drafter) -> list:
    """The drafters to try in order, cheapest first (a `CompositeDrafter` has several; plain decoding none)."""
    if isinstance(drafter, NoDrafter):
        return []
    if isinstance(drafter, CompositeDrafter):
        return list(drafter.drafters)
    return [drafter]
