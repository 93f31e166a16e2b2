"""A step's outcome, and the schedule that decides each step's lookahead.

Contract: the `Schedule` the user passes holds settings only (a frozen dataclass, shared freely between
generations and threads, never changed by a generation). Its
    prepare(target, drafters, prompt_length, greedy, budget) -> ScheduleRun
is called once per generation, before the first step (drafters: cheapest first; greedy: whether the
generation is greedy; budget: the new tokens it is expected to emit, at most the most it may emit
(`GenerationConfig.budget`), None when unknown), and returns that
generation's `ScheduleRun`, which holds whatever the generation learns and answers the loop:
    next_k(drafter) -> int      how many tokens to ask `drafter` for (0: skip it this step);
    rates(draft, drafter_name) -> list | None  the acceptance estimate (`policy.gain`'s rates) for that draft,
                                from which the loop's one optimizer (`gain.lookahead`) decides how many of its
                                tokens to verify, for one sequence or a batch alike; None: verify the whole
                                draft (a fixed rule, or a costly drafter already asked for its best k);
    update(outcome)             what the step did (`StepOutcome`);
    report() -> dict            figures for the statistics;
and the attributes `min_confidence` (a model drafter stops early when its top probability falls below it;
0 disables), `costs` (the `spec.costs.PassCosts` the step is priced with; None for a fixed rule) and
`alternatives` (the run's `policy.alternatives.AlternativesRun`, when other drafters' drafts are to be
verified beside a sequence's own; None for every run that never does). No schedule verifies more than
`backends.base.MAX_K` draft tokens in a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Draft, Drafter


@dataclass
class StepOutcome:
    """What happened in one verification step."""

    draft: Draft  # everything the drafter proposed (may be longer than what was verified)
    drafter: str  # name of the drafter that proposed it ("" when none did)
    verified: int  # draft tokens sent to the target
    accepted: int  # of those, accepted
    token: int  # the target's own token after the accepted ones
    draft_s: float = 0.0  # time the proposing drafter took
    verify_s: float = 0.0  # time of the target's forward pass
    alternatives: int = 0  # other drafts verified beside it (each a sequence of its own in the pass)
    alternative_rows: int = 0  # their draft tokens
    from_alternative: bool = False  # this draft was an alternative, kept over the sequence's own


class ScheduleRun(Protocol):
    """One generation's lookahead decisions, and the state behind them."""

    min_confidence: float
    costs: PassCosts | None  # None: a fixed rule prices nothing
    alternatives: Any  # a policy.alternatives.AlternativesRun, or None (one draft per sequence)

    def next_k(self, drafter: Drafter) -> int: ...

    def rates(self, draft: Draft, drafter_name: str = "") -> list[float] | None: ...

    def update(self, outcome: StepOutcome) -> None: ...

    def report(self) -> dict: ...


@runtime_checkable
class Schedule(Protocol):
    """Lookahead settings (immutable); `prepare` begins one generation's run."""

    def prepare(self, target: Any, drafters: list[Drafter], prompt_length: int = 0,
                greedy: bool = True, budget: int | None = None) -> ScheduleRun: ...
