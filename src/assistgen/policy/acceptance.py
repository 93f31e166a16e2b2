"""Acceptance estimated online: per draft position, how likely the target is to keep the token there.

Contract: `Acceptance(prior, weight, size)` holds one rate per draft position (0..size-1), each starting at its
`start` (default: `prior`) worth `prior_weight` observations, then an exponential moving average at `weight`;
`record(verified, accepted)` learns one step (positions 0..accepted-1 kept, position `accepted` rejected when it
was verified; `pooled`: one rate for all positions, moved once per step); `estimate()` gives the rates with
never-observed positions taken from the one before (at least `unseen_floor`), each less `caution` standard deviations
of its own observations: the rates `gain.py` optimizes over. A position's first observation updates that estimate
(not the prior), so an accepted token never lowers the rate estimated for its position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """Per-position acceptance estimated online with an exponential moving average."""

    prior: float
    weight: float
    size: int
    start: list[float] | None = None  # per-position rates assumed before any observation (default: prior)
    unseen_floor: float = 0.0  # a never-observed position is assumed at least this likely to be accepted
    prior_weight: float = 1.0  # the starting rates count as this many observations
    # Standard deviations of its estimate taken off the first position's rate (a binomial rate's, from its observation
    # count): the first position gates every later one, so a long draft verified on a rate seen once or twice is a
    # bet on little evidence; the margin shrinks as observations come in. 0: the rate as estimated.
    caution: float = 0.0
    # One rate for every position, moved once per verified draft to the share of its judged tokens kept (a model
    # drafter: each of its tokens agrees with the target about as often as its first, so a rejection deep in one
    # draft is not a verdict on that depth alone, which shorter drafts would then never revisit; and a long draft
    # kept whole is one draft's evidence, not ten).
    pooled: bool = False
    rates: list[float] = field(init=False)
    seen: list[int] = field(init=False)

    def __post_init__(self):
        self.rates = list(self.start[: self.size]) if self.start else [self.prior] * self.size
        self.rates += [self.rates[-1] if self.rates else self.prior] * (self.size - len(self.rates))
        self.seen = [0] * self.size

    def observe(self, position: int, accepted: bool) -> None:
        if position >= self.size:
            return
        if self.pooled:
            position = 0
        if self.seen[position] == 0 and position > 0:  # its first observation updates what was estimated for it
            self.rates[position] = self.estimate(cautious=False)[position]  # (the caution prices, it is not a rate)
        # Average the first few observations with the starting rate (worth `prior_weight` observations), then forget
        # old ones at `weight`: one lucky draft does not set a position's rate to 1.
        w = max(self.weight, 1.0 / (self.seen[position] + 1 + self.prior_weight))
        self.rates[position] += w * (float(accepted) - self.rates[position])
        self.seen[position] += 1

    def record(self, verified: int, accepted: int) -> None:
        if self.pooled:  # one draft's tokens are one piece of evidence: the step moves the rate once, to its share kept
            if verified:
                w = max(self.weight, 1.0 / (self.seen[0] + 1 + self.prior_weight))
                self.rates[0] += w * (accepted / (accepted + (accepted < verified)) - self.rates[0])
                self.seen[0] += 1
            return
        for i in range(accepted):
            self.observe(i, True)
        if accepted < verified:
            self.observe(accepted, False)

    def estimate(self, cautious: bool = True) -> list[float]:
        """Rates with never-observed positions taken from the position before them (at least `unseen_floor`), each
        less `caution` standard deviations of a binomial rate with its own position's observation count (`cautious`;
        else as estimated)."""
        out = [self.rates[0]] * self.size if self.pooled else list(self.rates)
        for i in range(1, len(out)):
            if self.seen[i] == 0:
                out[i] = max(out[i - 1], self.unseen_floor)
        if cautious and self.caution:
            seen = [self.seen[0]] * self.size if self.pooled else self.seen
            out = [self.cautious(rate, n) for rate, n in zip(out, seen, strict=True)]
        return out

    def cautious(self, rate: float, seen: int) -> float:
        """`rate` less `caution` standard deviations of a binomial rate observed `seen` times (the count: those
        observations, the start's weight and one more): a rate carried over to a position never observed is a guess,
        priced as one."""
        count = seen + self.prior_weight + 1.0
        return max(0.0, rate - self.caution * math.sqrt(rate * (1.0 - rate) / count))
