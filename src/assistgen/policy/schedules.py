"""Lookahead schedules: how many tokens to draft, and how many of them to verify, at each step.

Contract: a schedule is split in two. The `Schedule` the user passes holds settings only: a frozen
dataclass, shared freely between generations and threads, never changed by a generation. Its
    prepare(target, drafters, prompt_length, greedy, budget) -> ScheduleRun
is called once per generation, before the first step (drafters: cheapest first; greedy:
whether the generation is greedy; budget: the most new tokens it may emit, None when unknown), and
returns that generation's `ScheduleRun`, which holds
whatever the generation learns and answers the loop in `engine.py`:
    next_k(drafter) -> int      how many tokens to ask `drafter` for (0: skip it this step);
    rates(draft, drafter_name) -> list | None  the acceptance estimate (`gain.py`'s rates) for that draft,
                                from which the loop's one optimizer (`gain.lookahead`) decides how many of
                                its tokens to verify, for one sequence or a batch alike; None: verify the
                                whole draft (a fixed rule, or a costly drafter already asked for its best k);
    alternative_k(drafter, best, plan, room, chosen) -> int   how many tokens to ask a further drafter for, as an
                                alternative draft verified beside the main one in a fork of the cache (0: none);
    alternative_length(draft, drafter_name, best, shared, plan) -> int   how many of that draft to
                                verify;
    update(outcome)             what the step did (`StepOutcome`; `learn_alternative` for an alternative that lost);
    report() -> dict            figures for the statistics;
and the attributes `min_confidence` (a model drafter stops early when its top probability falls below
it; 0 disables) and `costs` (the `costs.PassCosts` the step is priced with; None for a fixed rule). No
schedule verifies more than `gain.MAX_K` draft tokens in a step.

Alternatives: where a pass costs about the same for 1 and 17 rows because the target's weights stream from their
file (`max_memory`), the drafts of the drafters after the one that drafted (another source's guess at the same
tokens) are verified beside it, each in a fork of the sequence's cache, and the loop keeps the draft accepted
furthest. Only greedy generations do this (the kept draft is then the target's own tokens whichever wins), and
only while the step's pricing (`StepPlan`: the expected tokens against the rows' cost) says the extra rows
bring more tokens per unit of time than the step already does (`gain.alternative_gain`).

`Constant` and `Heuristic` are the fixed rules of the reference design (`Constant` has no state and
is its own run). `Adaptive` is the cost-aware default: it picks the k (0 included) that maximises
expected tokens per unit of time, E(k) / (k*c + v[k]) (`gain.py`), from online acceptance
estimates, drafter costs c and the target's verification costs v (`costs.py`). It reads of a
drafter only what the `Drafter` protocol declares (`name`, `model`, `acceptance_prior`), and of a model
only what the backend seam declares (`weight_bytes`, its measured costs).

Reproducibility: with sampling, the number of random draws depends on k, so k must not depend on
wall-clock time: a sampled generation keeps every drafter's cost at its deterministic prior (the
weight-bytes ratio of `cost_hint`, or `Adaptive.drafter_cost_prior`), and k is a function of the
seed and the machine's cached cost curve. A greedy generation measures drafter costs online (its
output is the same whatever k is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from assistgen.drafters.base import Draft, Drafter
from assistgen.policy.costs import PassCosts, RowFit, at_least, pass_costs, plain_seconds, slower_by
from assistgen.policy.gain import MAX_K, alternative_gain, best_lookahead, lookahead, reach

if TYPE_CHECKING:
    from assistgen.backends.base import LanguageModel


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


@dataclass
class StepPlan:
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


class ScheduleRun(Protocol):
    """One generation's lookahead decisions, and the state behind them."""

    min_confidence: float
    costs: PassCosts | None

    def next_k(self, drafter: Drafter) -> int: ...

    def rates(self, draft: Draft, drafter_name: str = "") -> list[float] | None: ...

    def alternative_k(self, drafter: Drafter, best: list[float], plan: StepPlan, room: int, chosen: int) -> int: ...

    def alternative_length(self, draft: Draft, drafter_name: str, best: list[float], shared: int,
                           plan: StepPlan) -> int: ...

    def reach(self, draft: Draft, drafter_name: str, verified: int) -> list[float]: ...

    def update(self, outcome: StepOutcome) -> None: ...

    def learn_alternative(self, outcome: StepOutcome) -> None: ...

    def report(self) -> dict: ...


class NoAlternatives:
    """A fixed rule verifies one draft per sequence: no alternatives."""

    def alternative_k(self, drafter, best, plan, room, chosen) -> int:
        return 0

    def alternative_length(self, draft, drafter_name, best, shared, plan) -> int:
        return 0

    def reach(self, draft, drafter_name, verified) -> list[float]:
        return []

    def learn_alternative(self, outcome: StepOutcome) -> None:
        pass


class Schedule(Protocol):
    """Lookahead settings (immutable); `prepare` begins one generation's run."""

    def prepare(self, target: LanguageModel | None, drafters: list[Drafter], prompt_length: int = 0,
                greedy: bool = True, budget: int | None = None) -> ScheduleRun: ...


def verified_lengths(runs: list[ScheduleRun], drafts: list[Draft], drafter_names: list[str], rooms: list[int],
                     costs: PassCosts | None, prefill_rows: int = 0) -> list[int]:
    """How many of each draft one step verifies: `gain.lookahead`, the one optimizer, for one sequence or a batch,
    priced with `costs` (the step's: `prefill_rows` prompt rows are in the pass too) and the runs' acceptance
    estimates; a run without one (a fixed rule) verifies its whole draft. Never more than a sequence's room."""
    rates = [run.rates(d, name) for run, d, name in zip(runs, drafts, drafter_names, strict=True)]
    drafted = [len(d.tokens) for d in drafts]
    if costs is None or all(r is None for r in rates):
        chosen = drafted
    else:
        sequences, base = len(drafts) + (1 if prefill_rows else 0), len(drafts) + prefill_rows
        chosen = lookahead(rates, drafted, lambda rows: costs.batch(sequences, base, rows - base), base,
                           rooms=rooms, curve=costs.curve)
    return [max(0, min(n, room)) for n, room in zip(chosen, rooms, strict=True)]


def check_k(name: str, k: int, low: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= MAX_K:
        raise ValueError(f"{name} must be an integer in {low}..{MAX_K} (MAX_K, the most draft tokens a step "
                         f"verifies), got {k!r}")


@dataclass(frozen=True)
class Constant(NoAlternatives):
    """Always ask for k tokens and verify all of them. Stateless: its own run."""

    k: int = 5
    min_confidence: float = 0.0
    costs = None  # a fixed rule prices nothing

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


class HeuristicRun(NoAlternatives):
    """One generation under `Heuristic`: the current k."""

    costs = None  # a fixed rule prices nothing

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


# --- the cost-aware policy -------------------------------------------------------------------------


@dataclass
class Acceptance:
    """Per-position acceptance estimated online with an exponential moving average."""

    prior: float
    weight: float
    size: int
    start: list[float] | None = None  # per-position rates assumed before any observation (default: prior)
    unseen_floor: float = 0.0  # a never-observed position is assumed at least this likely to be accepted
    prior_weight: float = 1.0  # the starting rates count as this many observations
    rates: list[float] = field(init=False)
    seen: list[int] = field(init=False)

    def __post_init__(self):
        self.rates = list(self.start[: self.size]) if self.start else [self.prior] * self.size
        self.rates += [self.rates[-1] if self.rates else self.prior] * (self.size - len(self.rates))
        self.seen = [0] * self.size

    def observe(self, position: int, accepted: bool) -> None:
        if position >= self.size:
            return
        # Average the first few observations with the starting rate (worth `prior_weight` observations), then forget
        # old ones at `weight`: one lucky draft does not set a position's rate to 1.
        w = max(self.weight, 1.0 / (self.seen[position] + 1 + self.prior_weight))
        self.rates[position] += w * (float(accepted) - self.rates[position])
        self.seen[position] += 1

    def record(self, verified: int, accepted: int) -> None:
        for i in range(accepted):
            self.observe(i, True)
        if accepted < verified:
            self.observe(accepted, False)

    def estimate(self) -> list[float]:
        """Rates with never-observed positions taken from the position before them (at least `unseen_floor`)."""
        out = list(self.rates)
        for i in range(1, len(out)):
            if self.seen[i] == 0:
                out[i] = max(out[i - 1], self.unseen_floor)
        return out


@dataclass(frozen=True)
class Adaptive:
    """Choose k (0 included) before every step to maximise expected tokens per unit of time.

    Drafters cheaper than `free_cost` target steps per token (prompt lookup, the n-gram cache) are
    asked for `max_k` tokens and the loop verifies the best length of the draft for its source (`rates`);
    their unverified tokens are still checked against the token the target emits, so their estimate
    keeps learning while speculation is off. Costlier drafters are asked for the best k directly and their
    draft is verified whole; while that k is 0 they are probed with k = 1 now and then, spending at most
    `probe_share` of the time, so drafting comes back when the text becomes predictable. A costly drafter
    must first read the tokens it has not seen (at its first use, the whole prompt): it is switched on only
    when drafting at the expected gain for the rest of the generation saves more than that catch-up costs,
    priced from the measured cost curve (`AdaptiveRun.catch_up_pays`). For an offloaded target where verifying
    max_k tokens costs at most `flat` plain steps, a greedy generation also verifies up to `alternatives` other
    drafts beside its own (`alternative_k`, `alternative_length`). Settings only: each generation's estimates
    live in the `AdaptiveRun` that `prepare` returns.
    """

    max_k: int = MAX_K
    weight: float = 0.2  # EMA weight of a new acceptance observation
    prior: float = 0.5  # acceptance assumed before any observation
    # For free drafters, a draft position never verified yet is assumed at least this likely to be accepted, given
    # the ones before it (a draft that starts right tends to stay right): the policy then tries longer drafts
    # instead of growing them one position per step (docs/benchmarks.md: chosen by replaying recorded outputs with
    # benchmarks/lookup_ceiling.py); model drafters, whose every drafted token costs, keep the plain estimate.
    unseen_floor: float = 0.7
    probe_share: float = 0.01  # at most this share of time probes a drafter that is switched off
    free_cost: float = 0.02  # drafters cheaper than this per token are trimmed after proposing
    cost_weight: float = 0.2  # EMA weight of a new timing (drafter cost, plain-step time; greedy runs only)
    min_confidence: float = 0.0
    curve: list[float] | None = None  # v[k] to price steps with; None: the target's measured verification costs
    costs: list[float] | None = None  # the former name of `curve`, still accepted
    # c assumed for a model drafter before it is measured (and throughout a sampled generation); None: `cost_hint`
    drafter_cost_prior: float | None = None
    # Other drafters' drafts verified beside a sequence's own, each in a fork of its cache (greedy only), at most
    # this many per step (0: never), for a target whose weights are offloaded (`max_memory`), and only where
    # verifying max_k tokens costs at most `flat` plain steps. (Elsewhere a flat curve is no sign of free rows: the
    # torch backend's forks copy the cache, which the step's price leaves out.)
    alternatives: int = 3
    flat: float = 2.0

    def __post_init__(self):
        check_k("max_k", self.max_k, 1)
        if self.alternatives < 0 or self.flat < 0:
            raise ValueError(f"need alternatives >= 0 and flat >= 0, got {self.alternatives}, {self.flat}")
        if not 0.0 < self.weight <= 1.0 or not 0.0 <= self.prior <= 1.0 or not 0.0 <= self.unseen_floor <= 1.0:
            raise ValueError(f"need 0 < weight <= 1 and 0 <= prior, unseen_floor <= 1, got {self.weight}, "
                             f"{self.prior}, {self.unseen_floor}")
        if not 0.0 < self.cost_weight <= 1.0:
            raise ValueError(f"need 0 < cost_weight <= 1, got {self.cost_weight}")
        if self.costs is not None:
            if self.curve is not None:
                raise ValueError("give the verification cost curve once: curve= (costs= is its former name)")
            object.__setattr__(self, "curve", list(self.costs))
            object.__setattr__(self, "costs", None)

    def prepare(self, target: LanguageModel | None, drafters: list[Drafter], prompt_length: int = 0,
                greedy: bool = True, budget: int | None = None) -> AdaptiveRun:
        return AdaptiveRun(self, target, drafters, prompt_length, measure=greedy, budget=budget)


class AdaptiveRun:
    """One generation under `Adaptive` settings: acceptance estimates, drafter costs, probes.

    measure: whether drafter costs follow measured time (greedy) or stay at their priors (sampling,
    so that k, and with it the random draws, depend only on the seed).
    """

    def __init__(self, settings: Adaptive, target: LanguageModel | None, drafters: list[Drafter],
                 prompt_length: int = 0, measure: bool = True, budget: int | None = None):
        self.settings = settings
        self.min_confidence = settings.min_confidence
        self.measure = measure
        self.acceptance: dict[str, Acceptance] = {}
        self.drafter_cost: dict[str, float] = {}  # c per proposed token, in target steps
        self.unit_s: float | None = None  # the time of one plain step, estimated from every step (when measuring)
        self.off_steps: dict[str, int] = {}
        self.seen: dict[str, int] = {}  # sequence length when each drafter last drafted (it has seen that much)
        self.length = prompt_length  # current sequence length
        self.end = None if budget is None else prompt_length + budget  # the length at which the generation stops
        self.probes = 0
        self.drafted_last: set[str] = set()  # the drafters that drafted in the last step (no catch-up since)
        self.drafted_before: set[str] = set()  # and in the step before it
        self.alternatives_verified = 0  # alternative drafts verified, and how many of them won their step
        self.alternatives_won = 0
        self.extra_s = 0.0  # how much longer the target's passes take than when its costs were measured (EMA)
        self.timed: set[str] = set()  # drafters whose cost per token has been measured (not a prior any more)
        self._priced: PassCosts | None = None
        self.row_fit = RowFit()  # the passes' time against their rows, as they run (when measuring)
        self.measured: PassCosts | None = None  # None for plain decoding: nothing to choose
        self.offloaded = bool(getattr(target, "max_memory", None))  # its weights stream from their file
        if not drafters:
            return
        if settings.curve is not None:
            self.measured = PassCosts.from_curve(settings.curve, like=target.costs if target is not None else None)
        else:
            self.measured = pass_costs(target)
        for drafter in drafters:
            self.drafter_cost.setdefault(drafter.name, prior_cost(drafter, target, settings.drafter_cost_prior))
            if drafter.acceptance_prior is not None and drafter.name not in self.acceptance:  # early exit's agreement
                self.acceptance[drafter.name] = Acceptance(float(drafter.acceptance_prior), settings.weight,
                                                           settings.max_k + 1)

    def estimate(self, source: str, drafter_name: str = "") -> Acceptance:
        """The estimate for a draft source (e.g. "lookup:3"); a new source of a drafter that has
        drafted before starts from that drafter's pooled estimate instead of the prior."""
        if source not in self.acceptance:
            s = self.settings
            pooled = self.acceptance.get(drafter_name) if drafter_name and drafter_name != source else None
            start = pooled.estimate() if pooled is not None else None
            free = self.is_free(drafter_name or source)
            self.acceptance[source] = Acceptance(s.prior, s.weight, s.max_k + 1, start,
                                                 s.unseen_floor if free else 0.0)
        return self.acceptance[source]

    @property
    def costs(self) -> PassCosts | None:
        """The costs this run (and the step it is in) prices with: the measured ones, or, where the passes have become
        more than twice as slow as measured (a fixed cost per pass appeared: weights streamed from the file), those
        with that cost added beyond the doubling (`costs.slower_by`), so that drafting, and verifying, long pays when
        1 and 17 rows cost nearly the same; and then never below what the steps' own times show per row
        (`costs.RowFit`), so that a pass that also costs more per row than measured is not priced as free."""
        if self.measured is None:
            return None
        if self._priced is None:
            self._priced = slower_by(self.measured, self.extra_s - (plain_seconds(self.measured) or 0.0))
            fitted = self.row_fit.curve(len(self.measured.curve)) if self._priced is not self.measured else None
            if fitted:  # (a pass may also cost more per row than measured: never priced below what the steps show)
                self._priced = at_least(self._priced, fitted)
        return self._priced

    @property
    def curve(self) -> tuple[float, ...]:
        """v[k] of `costs`."""
        return self.costs.curve

    def slowdown(self) -> float:
        """How many of its measured plain steps a plain step now takes by the curve's account (1 unless the passes
        became more than twice as slow as measured): a model drafter's prior cost, priced in measured steps, is that
        much smaller in today's steps (the cost the passes gained is the target's: an assistant kept resident does
        not pay it)."""
        t1 = plain_seconds(self.measured)
        return 1.0 + max(0.0, self.extra_s - t1) / t1 if t1 else 1.0

    def is_free(self, drafter_name: str) -> bool:
        return self.drafter_cost.get(drafter_name, 0.0) < self.settings.free_cost

    def _k_max(self) -> int:
        return min(self.settings.max_k, len(self.curve) - 1)

    def next_k(self, drafter: Drafter) -> int:
        name = drafter.name
        c = self.drafter_cost.get(name, 0.0)
        if c < self.settings.free_cost:
            return self._k_max()
        if name not in self.timed:  # a prior, in plain steps as measured: the passes' extra time is not the drafter's
            c /= self.slowdown()
        k, gain = best_lookahead(self.estimate(name).estimate(), self.curve, c, self._k_max())
        if k > 0 and self.catch_up_pays(name, c, gain):
            self.off_steps[name] = 0
            return k
        self.off_steps[name] = self.off_steps.get(name, 0) + 1
        if self.off_steps[name] * self.settings.probe_share >= self.probe_cost(name, c):
            self.off_steps[name] = 0
            self.probes += 1
            return 1
        return 0

    def probe_cost(self, name: str, c: float) -> float:
        """A one-token probe, in plain steps: the draft, the extra verified row, and catching up on unseen tokens."""
        return c + self.curve[1] - 1.0 + self.catch_up_cost(name, c)

    def catch_up_cost(self, name: str, c: float) -> float:
        """What feeding a drafter the tokens it has not seen costs, in plain steps: none for one that drafted last
        step (its measured cost per token includes that); else c per token at the per-token cost of the longest
        step on the cost curve, v[-1] / len(v) (t(MAX_K+1) / (MAX_K+1) for a measured curve: a model catches up
        in one batched forward pass)."""
        if name in self.drafted_last:
            return 0.0
        unseen = self.length - self.seen.get(name, 0)
        return c * unseen * self.curve[-1] / len(self.curve)

    def catch_up_pays(self, name: str, c: float, gain: float) -> bool:
        """Whether switching a drafter on is worth its catch-up: drafting at the expected `gain` for the rest of the
        generation must save more plain steps than the catch-up costs. The prompt is the catch-up of a drafter's
        first use, so a long prompt with few tokens to generate keeps a costly assistant off from the start."""
        cost = self.catch_up_cost(name, c)
        if cost == 0.0 or self.end is None:
            return True
        return (self.end - self.length) * (1.0 - 1.0 / gain) > cost

    def rates(self, draft: Draft, drafter_name: str = "") -> list[float] | None:
        """A free drafter's draft is verified as far as its source's estimate says pays; a costly drafter's draft,
        asked for at its best k (or as a probe), is verified whole (None)."""
        if not draft.tokens or not self.is_free(drafter_name):
            return None
        return self.estimate(draft.source or drafter_name, drafter_name).estimate()

    def update(self, outcome: StepOutcome) -> None:
        if self.measured is None:
            return
        self.length += outcome.accepted + 1
        self.alternatives_verified += outcome.alternatives
        self.alternatives_won += outcome.from_alternative
        if outcome.drafter and outcome.draft.tokens:
            self.learn(outcome)
        if self.measure:
            self.measure_step(outcome)
        self.drafted_before = self.drafted_last
        self.drafted_last = {outcome.drafter} if outcome.drafter and outcome.draft.tokens else set()

    def learn_alternative(self, outcome: StepOutcome) -> None:
        """A draft of the step just `update`d that was verified beside the kept one and lost: its acceptance is
        learnt, and its drafter's time per token, as for a kept draft."""
        if outcome.drafter and outcome.draft.tokens:
            self.learn(outcome)
            if self.measure and self.unit_s and outcome.drafter in self.drafted_before:
                self.time_drafter(outcome.drafter, outcome.draft_s, len(outcome.draft.tokens))
            self.drafted_last.add(outcome.drafter)

    # --- alternatives: other drafts verified beside a sequence's own ---------------------------------------

    def reach(self, draft: Draft, drafter_name: str, verified: int) -> list[float]:
        """P(at least i of the draft's first `verified` tokens accepted), i = 1..verified, by the estimates."""
        if not draft.tokens or not verified:
            return []
        return reach(self.estimate(draft.source or drafter_name, drafter_name).estimate(), verified)

    def alternatives_on(self) -> bool:
        """Greedy, a target whose weights are offloaded (`max_memory`: where they were measured to pay), and a step of
        max_k tokens priced at most `flat` plain steps."""
        s = self.settings
        return (self.measure and self.offloaded and s.alternatives > 0 and self.measured is not None
                and self.curve[-1] <= s.flat)

    def alternative_k(self, drafter: Drafter, best: list[float], plan: StepPlan, room: int, chosen: int) -> int:
        """How many tokens to ask `drafter` for as an alternative to the sequence's drafts (`chosen` alternatives
        already), whose longest accepted run reaches i tokens with probability best[i-1]: the k that raises the
        step's expected tokens per unit of time most, its drafting (k * c) counted (0: none does)."""
        if not self.alternatives_on() or chosen >= self.settings.alternatives:
            return 0
        c = self.drafter_cost.get(drafter.name, 0.0)
        if drafter.name not in self.timed:
            c /= self.slowdown()
        rates = self.estimate(drafter.name).estimate()
        return self._best_alternative(rates, best, 0, min(room, self._k_max()), plan, c)

    def alternative_length(self, draft: Draft, drafter_name: str, best: list[float], shared: int,
                           plan: StepPlan) -> int:
        """How many of an alternative draft asked for by `alternative_k` (its first `shared` tokens those of a draft
        already verified) to verify beside the others, now that it is drafted (0: none pays)."""
        if not self.alternatives_on() or not draft.tokens:
            return 0
        rates = self.estimate(draft.source or drafter_name, drafter_name).estimate()
        return self._best_alternative(rates, best, shared, len(draft.tokens), plan, 0.0)

    def _best_alternative(self, rates: list[float], best: list[float], shared: int, k_max: int, plan: StepPlan,
                          c: float) -> int:
        chosen, best_rate = 0, plan.rate()
        for k in range(shared + 1, k_max + 1):
            rate = plan.rate_with(alternative_gain(best, reach(rates, k), shared), k, k * c)
            if rate > best_rate:
                chosen, best_rate = k, rate
        return chosen

    def learn(self, outcome: StepOutcome) -> None:
        """Record which of the step's draft tokens were accepted (and, for free, whether the next would have been)."""
        self.seen[outcome.drafter] = self.length
        source = outcome.draft.source or outcome.drafter
        estimates = [self.estimate(source, outcome.drafter)]
        if source != outcome.drafter:
            estimates.append(self.estimate(outcome.drafter))
        unverified = outcome.draft.tokens[outcome.verified :]
        for acceptance in estimates:  # the source's own, and its drafter's pooled one
            acceptance.record(outcome.verified, outcome.accepted)
            if outcome.accepted == outcome.verified and unverified and outcome.draft.probs is None:
                # The target's own next token tells, for free, whether the next draft token would have been accepted
                # (greedy: exactly; sampling: with probability p(token), the one-hot acceptance probability).
                acceptance.observe(outcome.verified, outcome.token == unverified[0])

    def measure_step(self, outcome: StepOutcome) -> None:
        """Follow the plain-step time and the drafter's cost per token from this step's timings (greedy only)."""
        w = self.settings.cost_weight
        if outcome.verify_s > 0:
            shape = (1 + outcome.alternatives, 1 + outcome.alternatives, outcome.verified + outcome.alternative_rows)
            priced = self.measured.batch(*shape)
            unit = outcome.verify_s / self.costs.batch(*shape)
            self.unit_s = unit if self.unit_s is None else self.unit_s + w * (unit - self.unit_s)
            t1 = plain_seconds(self.measured)
            if t1:  # (measured costs: follow how much longer a pass takes now than then)
                extra = outcome.verify_s - t1 * priced
                self.extra_s += w * (extra - self.extra_s)
                rows = outcome.verified + 1 + outcome.alternatives + outcome.alternative_rows
                self.row_fit.observe(rows, outcome.verify_s)
                self._priced = None
        # A drafter that drafted last step too has no catch-up cost in its time.
        if outcome.drafter and outcome.draft.tokens and outcome.drafter in self.drafted_last and self.unit_s:
            self.time_drafter(outcome.drafter, outcome.draft_s, len(outcome.draft.tokens))

    def time_drafter(self, name: str, seconds: float, tokens: int) -> None:
        """Follow a drafter's cost per token, in plain steps, from one proposal's time."""
        w = self.settings.cost_weight
        c = seconds / tokens / self.unit_s
        old = self.drafter_cost.get(name, c)
        self.drafter_cost[name] = old + w * (c - old)
        self.timed.add(name)

    def report(self) -> dict:
        out = {"schedule": "adaptive", "adaptive_probes": self.probes}
        if self.alternatives_verified:
            out["alternatives_verified"] = self.alternatives_verified
            out["alternatives_won"] = self.alternatives_won
        out["drafter_cost_per_token"] = {k: round(v, 3) for k, v in self.drafter_cost.items()}
        out["acceptance_estimate"] = {
            src: [round(r, 2) for r in a.estimate()[:4]] for src, a in sorted(self.acceptance.items())
        }
        return out


def prior_cost(drafter: Drafter, target: LanguageModel | None, drafter_cost_prior: float | None) -> float:
    """A drafter's cost per token before any measurement: 0 without a model (free until measured
    otherwise), else `drafter_cost_prior` when set, else `cost_hint`. Deterministic."""
    if drafter.model is None:
        return 0.0
    if drafter_cost_prior is not None:
        return drafter_cost_prior
    return cost_hint(drafter, target)


def cost_hint(drafter: Drafter, target: LanguageModel) -> float:
    """A model drafter's cost per token before it is measured: its model's share of the target's weight bytes, or,
    for a target whose weights are offloaded (`max_memory`: its passes take the time of reading them from their file,
    which a resident drafter does not pay), its measured plain-step time over the target's where both were measured."""
    if getattr(target, "max_memory", None):
        mine, theirs = plain_seconds(drafter.model.costs), plain_seconds(target.costs)
        if mine and theirs:
            return mine / theirs
    return drafter.model.weight_bytes / max(1, target.weight_bytes)


def parse_schedule(text: str) -> Schedule:
    """'adaptive', 'adaptive:MAX_K', 'adaptive:MAX_K:ALTERNATIVES', 'constant:K', 'heuristic', 'confidence:K:T'
    (CLI form)."""
    name, *args = text.split(":")
    try:
        if name == "adaptive":
            settings = {"max_k": int(args[0])} if args and args[0] else {}
            if len(args) > 1:
                settings["alternatives"] = int(args[1])
            return Adaptive(**settings)
        if name == "constant":
            return Constant(k=int(args[0]) if args else 5)
        if name == "heuristic":
            return Heuristic()
        if name == "confidence":
            return confidence(int(args[0]) if args else 10, float(args[1]) if len(args) > 1 else 0.4)
    except (ValueError, IndexError) as e:
        raise ValueError(f"bad schedule {text!r}: {e}") from e
    raise ValueError(f"unknown schedule {text!r}; use adaptive[:MAX_K[:ALTERNATIVES]], constant:K, heuristic or "
                     "confidence:K:T")
