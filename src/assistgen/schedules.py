"""Lookahead schedules: how many tokens to ask the drafter for before each verification.

Contract: a schedule has `next_k() -> int` (asked before each step), `update(drafted, accepted)`
(told the outcome after it) and `min_confidence` (a model drafter stops early when its top
probability falls below it; 0 disables). Schedules are per generation: `fresh()` returns a new
one with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Constant:
    """Always ask for k tokens."""

    k: int = 5
    min_confidence: float = 0.0

    def __post_init__(self):
        if self.k < 0:
            raise ValueError(f"lookahead k must be >= 0, got {self.k}")

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass

    def fresh(self):
        return replace(self)


@dataclass
class Heuristic:
    """The original assisted-generation rule: start at 5; +2 when every draft token was accepted, -1 otherwise."""

    start: int = 5
    increase: int = 2
    decrease: int = 1
    min_k: int = 1
    max_k: int = 32
    min_confidence: float = 0.0

    def __post_init__(self):
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return  # the drafter had nothing to offer; that says nothing about k
        if accepted == drafted:
            self.k = min(self.max_k, self.k + self.increase)
        else:
            self.k = max(self.min_k, self.k - self.decrease)

    def fresh(self):
        return replace(self)


def confidence(k: int = 10, threshold: float = 0.4) -> Constant:
    """Draft up to k tokens, stopping early once the drafter's top probability is below `threshold`."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"confidence threshold must be in [0, 1), got {threshold}")
    return Constant(k=k, min_confidence=threshold)


def parse_schedule(text: str):
    """'constant:K', 'heuristic', 'confidence:K:T' (CLI form)."""
    name, *args = text.split(":")
    try:
        if name == "constant":
            return Constant(k=int(args[0]) if args else 5)
        if name == "heuristic":
            return Heuristic()
        if name == "confidence":
            return confidence(int(args[0]) if args else 10, float(args[1]) if len(args) > 1 else 0.4)
    except (ValueError, IndexError) as e:
        raise ValueError(f"bad schedule {text!r}: {e}") from e
    raise ValueError(f"unknown schedule {text!r}; use constant:K, heuristic or confidence:K:T")
