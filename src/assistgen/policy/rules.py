"""The fixed lookahead rules: a constant k, the original assisted-generation heuristic, a confidence cut-off.

Contract: `Constant(k)` asks for k tokens every step and verifies them all (stateless: its own run);
`Heuristic()` starts at 5 and adds 2 when every draft token was accepted, takes 1 otherwise (`HeuristicRun` holds
one generation's k); `confidence(k, threshold)` is `Constant(k)` whose model drafter stops once its top probability
falls below `threshold`. Each is a `spec.steps.Schedule` and its run a `spec.steps.ScheduleRun` that prices nothing
(`costs` None: the loop verifies the whole draft) and verifies one draft per sequence (`alternatives` None).
`check_k` is the range check every schedule's k passes (0..`MAX_K`).
"""

from __future__ import annotations

from dataclasses import dataclass

from assistgen.policy.gain import MAX_K
from assistgen.spec.drafts import Draft
from assistgen.spec.steps import StepOutcome


def check_k(name: str, k: int, low: int, high: int = MAX_K) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= high:
        bound = "MAX_K, the most draft tokens a step verifies" if high == MAX_K else \
            "LONG_K, the most tokens of a copy a step verifies"
        raise ValueError(f"{name} must be an integer in {low}..{high} ({bound}), got {k!r}")


@dataclass(frozen=True)
class Constant:
    """Always ask for k tokens and verify all of them. Stateless: its own run."""

    k: int = 5
    min_confidence: float = 0.0
    costs = None  # a fixed rule prices nothing
    alternatives = None  # and verifies one draft per sequence

    def __post_init__(self):
        check_k("lookahead k", self.k, 0)

    def prepare(self, target=None, drafters=(), prompt_length: int = 0, greedy: bool = True,
                budget: int | None = None) -> Constant:
        return self

    def next_k(self, drafter=None) -> int:
        return self.k

    def rates(self, draft: Draft, drafter_name: str = "") -> None:
        return None

    def update(self, outcome: StepOutcome) -> None:
        pass

    def report(self) -> dict:
        return {}


@dataclass(frozen=True)
class Heuristic:
    """The original assisted-generation rule: start at 5; +2 when every draft token was accepted, -1 otherwise."""

    start: int = 5
    increase: int = 2
    decrease: int = 1
    min_k: int = 1
    max_k: int = MAX_K
    min_confidence: float = 0.0

    def __post_init__(self):
        check_k("max_k", self.max_k, 1)
        if not 1 <= self.min_k <= self.start <= self.max_k:
            raise ValueError(f"need 1 <= min_k <= start <= max_k, got {self.min_k}, {self.start}, {self.max_k}")

    def prepare(self, target=None, drafters=(), prompt_length: int = 0, greedy: bool = True,
                budget: int | None = None) -> HeuristicRun:
        return HeuristicRun(self)


class HeuristicRun:
    """One generation under `Heuristic`: the current k."""

    costs = None  # a fixed rule prices nothing
    alternatives = None  # and verifies one draft per sequence

    def __init__(self, settings: Heuristic):
        self.settings = settings
        self.min_confidence = settings.min_confidence
        self.k = settings.start

    def next_k(self, drafter=None) -> int:
        return self.k

    def rates(self, draft: Draft, drafter_name: str = "") -> None:
        return None

    def update(self, outcome: StepOutcome) -> None:
        if outcome.verified == 0:
            return  # the drafter had nothing to offer; that says nothing about k
        s = self.settings
        if outcome.accepted == outcome.verified:
            self.k = min(s.max_k, self.k + s.increase)
        else:
            self.k = max(s.min_k, self.k - s.decrease)

    def report(self) -> dict:
        return {}


def confidence(k: int = 10, threshold: float = 0.4) -> Constant:
    """Draft up to k tokens, stopping early once the drafter's top probability is below `threshold`."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"confidence threshold must be in [0, 1), got {threshold}")
    return Constant(k=k, min_confidence=threshold)
