"""Drafts and drafters: what a drafter proposes, the interface it implements, and the one loop that asks several.

Contract: a drafter implements
    propose(ids, k, sampler, min_confidence) -> Draft
        ids: the whole current sequence (prompt + emitted tokens); propose up to k *new* tokens
        that follow it, with the draft distribution q each was drawn from ([n, vocab] in the
        target's vocabulary) or None when there is none;
and has the attributes
    name              what the statistics and the schedule call it (unique among a composite's drafters);
    context_length    the longest sequence it can draft after (None when unbounded);
    model             the backend model it runs (`backends.base.LanguageModel`), or None when it runs none
                      (prompt lookup, the n-gram cache): the adaptive policy sizes its cost per token from it;
    acceptance_prior  the acceptance rate expected before any draft is verified (early exit's
                      calibrated agreement), or None: the policy then starts from its own prior.
Three notifications have do-nothing defaults here (a drafter subclasses `Drafter` to inherit them):
    observe(num_accepted, target_probs)  how many of the last proposal's tokens the target accepted (and,
                      when sampling, the target's distributions p at the verified positions, [k+1, vocab]);
    finish(ids)       the whole sequence when the generation ends (a cache that learns across requests
                      records it);
    report() -> dict  drafter-specific figures for the statistics.
`isinstance(x, Drafter)` holds for an object with every part above (subclass or not).
Drafters never see the target's cache and never decide acceptance; the generation loop does.
`first_draft` is the one loop that asks several drafters in turn (cheapest first) and keeps the first
non-empty draft: the generation loop and `drafters.base.CompositeDrafter` both use it. A model drafter keeps
its tensors on its model's device (its cache makes ids there, and q rows are made from its logits);
`first_draft` times each proposal with the clock given (the generation's: its cache's `clock`, on the
target's device).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from assistgen.spec.sampling import Sampler


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # [n] proposed continuation, n <= k
    probs: torch.Tensor | None = None  # [n, vocab] q for each token, or None
    forward_passes: int = 0  # drafter model forward passes spent on this proposal
    source: str = ""  # what produced it (e.g. "lookup:3", "assistant"): acceptance is tracked per source


@runtime_checkable
class Drafter(Protocol):
    name: str
    context_length: int | None
    model: Any  # a backends.base.LanguageModel, or None
    acceptance_prior: float | None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft: ...

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        return None

    def finish(self, ids: list[int]) -> None:
        return None

    def report(self) -> dict:
        return {}


@dataclass
class Proposal:
    """The draft a step verifies, and what asking for it cost."""

    draft: Draft = field(default_factory=Draft)
    drafter: str = ""  # name of the drafter that made it ("" when none did)
    seconds: float = 0.0  # that drafter's time
    total_seconds: float = 0.0  # the time of every drafter asked
    forward_passes: int = 0  # model forward passes of every drafter asked
    empty: list[str] = field(default_factory=list)  # the drafters asked that proposed nothing


def first_draft(drafters: list, ids: list[int], k_of: Callable[[Drafter], int], sampler: Sampler,
                min_confidence: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> Proposal:
    """Ask each drafter in turn for k_of(drafter) tokens (skipping those given 0), up to the first non-empty
    draft, which is cut to its k and named by its source."""
    proposal = Proposal()
    for drafter in drafters:
        k = k_of(drafter)
        if k <= 0:
            continue
        start = clock()
        draft = drafter.propose(ids, k, sampler, min_confidence)
        elapsed = clock() - start
        proposal.total_seconds += elapsed
        proposal.forward_passes += draft.forward_passes
        if not draft.tokens:
            proposal.empty.append(drafter.name)
        else:
            if len(draft.tokens) > k:
                draft.tokens, draft.probs = draft.tokens[:k], None if draft.probs is None else draft.probs[:k]
            draft.source = draft.source or drafter.name
            proposal.draft, proposal.drafter, proposal.seconds = draft, drafter.name, elapsed
            return proposal
    return proposal
