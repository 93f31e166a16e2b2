"""What a generation's cost-aware run knows of each drafter, and what a drafter costs before it is measured.

Contract: `DrafterRecord` is one drafter's state in an `adaptive.AdaptiveRun` (its cost per token, prior or timed,
its model's cost curve, its probes, rests and catch-up), one record per drafter instead of one dict per fact;
`prior_cost` is a drafter's cost per token before any measurement, `cost_hint` a model drafter's from the cost book's
plain-step times or its weight bytes. Deterministic; nothing here times anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from assistgen.spec.costs import PassCosts, plain_seconds
from assistgen.spec.drafts import Drafter

if TYPE_CHECKING:
    from assistgen.backends.base import LanguageModel


@dataclass
class DrafterRecord:
    """What one generation's run knows of one drafter (its acceptance estimates are per draft source: `acceptance`)."""

    cost: float  # c per proposed token, in target steps (a prior until `timed`)
    curve: tuple[float, ...] | None = None  # its model's measured cost curve, if known
    timed: bool = False  # its cost follows measured proposals (not a prior any more)
    off_steps: int = 0  # (costly) steps in a row its best k was 0: what the next probe waits for
    seen: int = 0  # the sequence length when it last drafted (it has seen that much)
    unused: int = 0  # (free) its drafts in a row of which nothing was verified
    resting: int = 0  # (free) the steps it is still not asked for (`Adaptive.rest_after`)
    pending: int = 1  # rows its next first pass feeds after drafting last step: the target's token (and its last
    # draft token when the whole draft was kept)
    first_extra: float = 0.0  # that pass's cost beyond one row's, in passes, as last priced


def prior_cost(drafter: Drafter, target: LanguageModel | None, drafter_cost_prior: float | None,
               mine: PassCosts | None = None, theirs: PassCosts | None = None) -> float:
    """A drafter's cost per token before any measurement: 0 without a model (free until measured
    otherwise), else `drafter_cost_prior` when set, else `cost_hint` (`mine`, `theirs`: the drafter's model's and the
    target's costs, as the book holds them). Deterministic."""
    if drafter.model is None:
        return 0.0
    if drafter_cost_prior is not None:
        return drafter_cost_prior
    return cost_hint(drafter, target, mine, theirs)


def cost_hint(drafter: Drafter, target: LanguageModel, mine: PassCosts | None, theirs: PassCosts | None) -> float:
    """A model drafter's cost per token before it is measured: its model's measured plain-step time (`mine`'s) over
    the target's (`theirs`') where both were measured (the machine's cost records: what the passes take, whatever
    dominates them: reading weights, streaming them from their file for an offloaded target, or the per-operation
    time of a small model), else its model's share of the target's weight bytes."""
    mine_s, theirs_s = plain_seconds(mine), plain_seconds(theirs)
    if mine_s and theirs_s:
        return mine_s / theirs_s
    return drafter.model.weight_bytes / max(1, target.weight_bytes)
