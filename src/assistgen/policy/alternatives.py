"""Alternatives: other drafters' drafts verified beside a sequence's own, where the extra rows cost nearly nothing.

Contract: where a pass costs about the same for 1 and 17 rows because the target's weights stream from their file
(offloaded), the drafts of the drafters after the one that drafted (another source's guess at the same tokens)
are verified beside it, each in a fork of the sequence's cache, and the loop keeps the draft accepted furthest.
Only greedy generations do this (the kept draft is then the target's own tokens whichever wins), and only while
the step's pricing (`StepPricing`: the expected tokens against the rows' cost) says the extra rows bring more tokens
per unit of time than the step already does (`gain.alternative_gain`). An `AlternativesRun` is the extension of one
`adaptive.AdaptiveRun` that answers the loop (`ScheduleRun.alternatives`; None where a run never verifies any):
    on() -> bool                whether this step may verify alternatives (a step of max_k tokens priced at most
                                `Adaptive.flat` plain steps);
    reach(draft, drafter_name, verified) -> list   P(at least i of the draft's first `verified` tokens accepted);
    k(drafter, best, plan, room, chosen) -> int     how many tokens to ask a further drafter for (0: none);
    length(draft, drafter_name, best, shared, plan) -> int   how many of that draft to verify;
    learn(outcome)              a draft verified beside the kept one that lost: its acceptance and time are learnt;
    count(outcome), report()    the figures for the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from assistgen.policy.gain import alternative_gain, reach
from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.steps import StepOutcome


@dataclass
class StepPricing:
    """What one step verifies so far, priced with `costs`: for deciding whether a further draft, in a fork of a
    sequence's cache, pays for its rows. Costs in plain steps t(1); tokens: what the step is expected to emit."""

    costs: PassCosts
    sequences: int  # in the pass (prompt chunks counted as one)
    rows: int  # one per sequence, plus the prompt rows
    draft_rows: int  # draft tokens verified
    tokens: float  # expected tokens the step emits

    def cost(self, sequences: int = 0, draft_rows: int = 0) -> float:
        return self.costs.batch(self.sequences + sequences, self.rows + sequences, self.draft_rows + draft_rows)

    def rate_with(self, gain: float, draft_rows: int, extra_cost: float = 0.0) -> float:
        """Expected tokens per plain step once a further sequence verifying `draft_rows` tokens is in the step."""
        return (self.tokens + gain) / (self.cost(1, draft_rows) + extra_cost)

    def rate(self) -> float:
        return self.tokens / self.cost()

    def add(self, gain: float, draft_rows: int) -> None:
        self.sequences, self.rows, self.draft_rows, self.tokens = (
            self.sequences + 1, self.rows + 1, self.draft_rows + draft_rows, self.tokens + gain)


class AlternativesRun:
    """The alternatives of one greedy generation under `Adaptive`, priced with its run's estimates and costs."""

    def __init__(self, run: Any):  # its adaptive.AdaptiveRun
        self.run = run
        self.verified = 0  # alternative drafts verified, and how many of them won their step
        self.won = 0

    def on(self) -> bool:
        run = self.run
        return run.measured is not None and run.curve[-1] <= run.settings.flat

    def reach(self, draft: Draft, drafter_name: str, verified: int) -> list[float]:
        """P(at least i of the draft's first `verified` tokens accepted), i = 1..verified, by the estimates."""
        if not draft.tokens or not verified:
            return []
        return reach(self.run.estimate(draft.source or drafter_name, drafter_name).estimate(cautious=False), verified)

    def k(self, drafter: Drafter, best: list[float], plan: StepPricing, room: int, chosen: int) -> int:
        """How many tokens to ask `drafter` for as an alternative to the sequence's drafts (`chosen` alternatives
        already), whose longest accepted run reaches i tokens with probability best[i-1]: the k that raises the
        step's expected tokens per unit of time most, its drafting (k * c) counted (0: none does)."""
        run = self.run
        if not self.on() or chosen >= run.settings.alternatives:
            return 0
        c = run.cost_now(drafter.name)
        rates = run.estimate(drafter.name).estimate(cautious=False)
        return self.best(rates, best, 0, min(room, run.k_max()), plan, c)

    def length(self, draft: Draft, drafter_name: str, best: list[float], shared: int, plan: StepPricing) -> int:
        """How many of an alternative draft asked for by `k` (its first `shared` tokens those of a draft already
        verified) to verify beside the others, now that it is drafted (0: none pays)."""
        if not self.on() or not draft.tokens:
            return 0
        rates = self.run.estimate(draft.source or drafter_name, drafter_name).estimate(cautious=False)
        return self.best(rates, best, shared, len(draft.tokens), plan, 0.0)

    @staticmethod
    def best(rates: list[float], best: list[float], shared: int, k_max: int, plan: StepPricing, c: float) -> int:
        chosen, best_rate = 0, plan.rate()
        for k in range(shared + 1, k_max + 1):
            rate = plan.rate_with(alternative_gain(best, reach(rates, k), shared), k, k * c)
            if rate > best_rate:
                chosen, best_rate = k, rate
        return chosen

    def learn(self, outcome: StepOutcome) -> None:
        """A draft of the step just `update`d that was verified beside the kept one and lost: its acceptance is
        learnt, and its drafter's time per token, as for a kept draft."""
        run = self.run
        if outcome.drafter and outcome.draft.tokens:
            run.learn(outcome)
            if run.unit_s and outcome.drafter in run.drafted_before:
                run.time_drafter(outcome.drafter, outcome.draft_s, len(outcome.draft.tokens))
            run.drafted_last.add(outcome.drafter)

    def count(self, outcome: StepOutcome) -> None:
        self.verified += outcome.alternatives
        self.won += outcome.from_alternative

    def report(self) -> dict:
        return {"alternatives_verified": self.verified, "alternatives_won": self.won} if self.verified else {}
