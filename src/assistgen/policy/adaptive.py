"""The cost-aware policy: the k (0 included) that maximises expected tokens per unit of time, for every drafter.

Contract: `Adaptive` holds settings only (frozen; shared between generations and threads); `prepare` returns one
generation's `AdaptiveRun`, a `spec.steps.ScheduleRun`. The run picks, before every step, the k that maximises
E(k) / (k*c + v[k]) (`gain.py`) from online acceptance estimates (`acceptance.Acceptance`, per draft source),
drafter costs c per token and the target's verification costs v (`spec.costs.PassCosts`, followed online by
`online.OnlineCosts`). It reads of a drafter only what the `Drafter` protocol declares (`name`, `model`,
`acceptance_prior`), of a model only what the backend seam declares (`weight_bytes`, `capabilities`,
`startup_s`), and the models' measured costs from the cost book (`costs`), once, in `prepare`: the target's
(measured there when the book has none: a model that was not prepared) and its model drafters' (as the book holds
them; none: their weight bytes price them). For a greedy generation on an offloaded target it carries the
alternatives extension (`alternatives.AlternativesRun`); otherwise `alternatives` is None.

Each drafter's state is one `records.DrafterRecord`. Reproducibility: a sampled generation keeps every drafter's
cost at its deterministic prior (`records.prior_cost`) and follows no pass time, so that k depends only on the seed
and the machine's cached cost curve (drafts with probabilities draw more or fewer numbers with k; copied ones are
judged by keyed draws, which do not). A greedy generation measures costs online (its output is the same whatever k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from assistgen.policy.acceptance import Acceptance
from assistgen.policy.alternatives import AlternativesRun
from assistgen.policy.costs import known_costs, measured_costs
from assistgen.policy.gain import LONG_K, MAX_K, best_lookahead
from assistgen.policy.online import OnlineCosts
from assistgen.policy.records import DrafterRecord, prior_cost
from assistgen.policy.rules import check_k
from assistgen.spec.costs import PassCosts, plain_seconds
from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.steps import StepOutcome

if TYPE_CHECKING:
    from assistgen.backends.base import LanguageModel


@dataclass(frozen=True)
class Adaptive:
    """Choose k (0 included) before every step to maximise expected tokens per unit of time.

    Drafters cheaper than `free_cost` target steps per token (prompt lookup, the n-gram cache: copies) are
    asked for `long_k` tokens and the loop verifies the best length of the draft for its source (`rates`), priced
    past the cost curve's end by the wide passes' measured costs;
    their unverified tokens are still checked against the tokens the target emits next, in this step and the
    following ones (`AdaptiveRun.check_unverified`), so their estimate keeps learning, at every position, while
    speculation is off; one whose drafts keep being priced out is asked only every few steps (`rest_after`,
    `rest_steps`), so text with nothing worth copying pays for its search on a few steps, not on all. Costlier
    drafters are asked for the best k directly and their draft is verified whole
    (their acceptance one rate for every draft position: `Acceptance.pooled`; their first pass priced by the rows
    it feeds: `first_pass_extra`); while that k is 0 they are probed with k = 1 now and then, spending at most
    `probe_share` of the time, so drafting comes back when the text becomes predictable. A costly drafter
    must first read the tokens it has not seen (at its first use, the whole prompt): it is switched on only
    when drafting at the expected gain for the rest of the generation saves more than that catch-up costs,
    priced from the measured cost curve (`AdaptiveRun.catch_up_pays`). For an offloaded target where verifying
    max_k tokens costs at most `flat` plain steps, a greedy generation also verifies up to `alternatives` other
    drafts beside its own (`alternatives.AlternativesRun`). Settings only: each generation's estimates
    live in the `AdaptiveRun` that `prepare` returns.
    """

    max_k: int = MAX_K
    # The most tokens a free drafter (a copy) is asked for; the step verifies as many as its estimate and the wide
    # passes' measured costs say pay (`lengths.verified_lengths`). None: LONG_K with the default max_k, else max_k.
    long_k: int | None = None
    weight: float = 0.2  # EMA weight of a new acceptance observation
    prior: float = 0.5  # acceptance assumed before any observation
    # For free drafters, a draft position never verified yet is assumed at least this likely to be accepted, given
    # the ones before it (a draft that starts right tends to stay right): the policy then tries longer drafts
    # instead of growing them one position per step (docs/benchmarks.md: chosen by replaying recorded outputs with
    # benchmarks/lookup_ceiling.py); model drafters, whose every drafted token costs, keep the plain estimate.
    unseen_floor: float = 0.7
    # For free drafters, the first position's rate less this many standard deviations of its estimate (few
    # observations: a small margin against verifying a long draft on one lucky token; their later positions are
    # learned for free from the tokens the target emits, so the margin shrinks quickly where drafts are right).
    caution: float = 1.0
    probe_share: float = 0.01  # at most this share of time probes a drafter that is switched off
    free_cost: float = 0.02  # drafters cheaper than this per token are trimmed after proposing
    cost_weight: float = 0.2  # EMA weight of a new timing (drafter cost, plain-step time; greedy runs only)
    min_confidence: float = 0.0
    curve: list[float] | None = None  # v[k] to price steps with; None: the target's measured verification costs
    costs: list[float] | None = None  # the former name of `curve`, still accepted
    # c assumed for a model drafter before it is measured (and throughout a sampled generation); None: `cost_hint`
    drafter_cost_prior: float | None = None
    # Other drafters' drafts verified beside a sequence's own, each in a fork of its cache (greedy only), at most
    # this many per step (0: never), for a target whose weights are offloaded (`capabilities`), and only where
    # verifying max_k tokens costs at most `flat` plain steps. (Elsewhere a flat curve is no sign of free rows: the
    # torch backend's forks copy the cache, which the step's price leaves out.)
    alternatives: int = 3
    flat: float = 2.0
    # A free drafter whose last `rest_after` drafts were all priced out (none of their tokens verified) is asked
    # only every `rest_steps + 1`-th step until one is verified again: its search and the policy's bookkeeping cost a
    # step's Python even when nothing is verified, and its estimates learn from the drafts it still makes.
    rest_after: int = 8
    rest_steps: int = 3

    def __post_init__(self):
        check_k("max_k", self.max_k, 1)
        if self.long_k is None:
            object.__setattr__(self, "long_k", LONG_K if self.max_k == MAX_K else self.max_k)
        check_k("long_k", self.long_k, self.max_k, LONG_K)
        if self.rest_after < 1 or self.rest_steps < 0:
            raise ValueError(f"need rest_after >= 1 and rest_steps >= 0, got {self.rest_after}, {self.rest_steps}")
        if self.alternatives < 0 or self.flat < 0:
            raise ValueError(f"need alternatives >= 0 and flat >= 0, got {self.alternatives}, {self.flat}")
        if not 0.0 < self.weight <= 1.0 or not 0.0 <= self.prior <= 1.0 or not 0.0 <= self.unseen_floor <= 1.0:
            raise ValueError(f"need 0 < weight <= 1 and 0 <= prior, unseen_floor <= 1, got {self.weight}, "
                             f"{self.prior}, {self.unseen_floor}")
        if self.caution < 0:
            raise ValueError(f"need caution >= 0 (standard deviations; 0: none), got {self.caution}")
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
    """One generation under `Adaptive` settings: acceptance estimates, one record per drafter, probes.

    measure: whether drafter costs follow measured time (greedy) or stay at their priors (sampling,
    so that k, and with it the random draws, depend only on the seed).
    """

    def __init__(self, settings: Adaptive, target: LanguageModel | None, drafters: list[Drafter],
                 prompt_length: int = 0, measure: bool = True, budget: int | None = None):
        self.settings = settings
        self.min_confidence = settings.min_confidence
        self.measure = measure
        self.acceptance: dict[str, Acceptance] = {}  # {draft source (a drafter's name, or "lookup:3"): estimate}
        self.drafters: dict[str, DrafterRecord] = {}  # {drafter name: what the run knows of it}
        self.length = prompt_length  # current sequence length
        self.end = None if budget is None else prompt_length + budget  # the length at which the generation stops
        self.probes, self.rested = 0, 0  # probes of drafters switched off; steps a free drafter rested
        # Each draft source's unverified draft tokens still being checked against what the target emits next:
        # {source: (drafter name, the tokens, the draft position of the first)} (`check_unverified`)
        self.unverified: dict[str, tuple[str, list[int], int]] = {}
        self.drafted_last: set[str] = set()  # the drafters that drafted in the last step (no catch-up since)
        self.drafted_before: set[str] = set()  # and in the step before it
        self.measured: PassCosts | None = None  # None for plain decoding: nothing to choose
        self.online: OnlineCosts | None = None  # the passes' time as they run (when measuring)
        self.alternatives: AlternativesRun | None = None  # other drafts verified beside the sequence's own
        # the most draft tokens a step verifies: the settings', within the rows the target's kernels keep exact
        rows = target.capabilities.verify_rows if target is not None else 1 + settings.long_k
        self.max_k, self.long_k = min(settings.max_k, rows - 1), min(settings.long_k, rows - 1)
        if not drafters:
            return
        if settings.curve is not None:
            theirs = known_costs(target) if target is not None else None
            self.measured = PassCosts.from_curve(settings.curve, like=theirs)
        else:
            theirs = self.measured = measured_costs(target)
        if measure:
            self.online = OnlineCosts(self.measured, decay=1.0 - settings.cost_weight)
        if measure and settings.alternatives > 0 and target is not None and target.capabilities.offloaded:
            self.alternatives = AlternativesRun(self)
        for drafter in drafters:
            mine = known_costs(drafter.model) if drafter.model is not None else None
            if drafter.name not in self.drafters:
                self.drafters[drafter.name] = DrafterRecord(
                    prior_cost(drafter, target, settings.drafter_cost_prior, mine, theirs),
                    mine.curve if mine is not None else None)
            if drafter.acceptance_prior is not None and drafter.name not in self.acceptance:  # a measured agreement
                # (early exit's, the self-draft's) counts as a full window of the moving average's observations: one
                # rejection then moves it as much as any later one does, not halfway to 0
                self.acceptance[drafter.name] = Acceptance(float(drafter.acceptance_prior), settings.weight,
                                                           self.positions(drafter.name),
                                                           prior_weight=1.0 / settings.weight,
                                                           pooled=not self.is_free(drafter.name))

    def estimate(self, source: str, drafter_name: str = "") -> Acceptance:
        """The estimate for a draft source (e.g. "lookup:3"); a new source of a drafter that has
        drafted before starts from that drafter's pooled estimate instead of the prior."""
        if source not in self.acceptance:
            s = self.settings
            pooled = self.acceptance.get(drafter_name) if drafter_name and drafter_name != source else None
            start = pooled.estimate(cautious=False) if pooled is not None else None
            free = self.is_free(drafter_name or source)
            self.acceptance[source] = Acceptance(s.prior, s.weight, self.positions(drafter_name or source), start,
                                                 s.unseen_floor if free else 0.0, caution=s.caution if free else 0.0,
                                                 pooled=not free)
        return self.acceptance[source]

    @property
    def costs(self) -> PassCosts | None:
        """The costs this run (and the step it is in) prices with: the measured ones, or, where the passes now also
        take a fixed time beyond one plain step's (weights streamed from their file), those with that time in every
        pass (`online.OnlineCosts`), so that drafting, and verifying, long pays when 1 and 17 rows cost nearly the
        same, and a pass that also costs more per row than measured is not priced as free."""
        if self.measured is None:
            return None
        return self.measured if self.online is None else self.online.costs()

    @property
    def unit_s(self) -> float | None:
        """The time of one plain step now (None before the first timed step, and when not measuring)."""
        return None if self.online is None else self.online.unit_s()

    @property
    def curve(self) -> tuple[float, ...]:
        """v[k] of `costs`."""
        return self.costs.curve

    def slowdown(self) -> float:
        """How many plain steps of the target's own speed a plain step now takes (1 unless its passes gained a fixed
        time beyond one plain step's): a model drafter's prior cost, priced in the target's steps, is that much
        smaller in today's steps (the time the passes gained is the target's: an assistant kept resident does not
        pay it)."""
        return 1.0 + (self.online.fixed() if self.online is not None else 0.0)

    def record(self, name: str) -> DrafterRecord:
        """The drafter's record (one it was not prepared with: a free drafter's, priced 0 until timed)."""
        return self.drafters.setdefault(name, DrafterRecord(0.0))

    def is_free(self, drafter_name: str) -> bool:
        record = self.drafters.get(drafter_name)
        return record is None or record.cost < self.settings.free_cost

    def cost_now(self, name: str) -> float:
        """A drafter's cost per token in today's plain steps: a prior is in plain steps as measured, and the time the
        passes gained since is the target's, not the drafter's (`slowdown`)."""
        record = self.drafters.get(name)
        if record is None:
            return 0.0
        return record.cost if record.timed else record.cost / self.slowdown()

    def positions(self, drafter_name: str) -> int:
        """The draft positions a drafter's estimates follow: a copy's up to `long_k`, a model drafter's `max_k`."""
        return (self.long_k if self.is_free(drafter_name) else self.max_k) + 1

    def k_max(self) -> int:
        return min(self.max_k, len(self.curve) - 1)

    def next_k(self, drafter: Drafter) -> int:
        name = drafter.name
        record = self.record(name)
        if self.is_free(name):  # a copy: as long as it goes, then verified as far as it pays
            if record.resting > 0:  # (priced out for a while: asked again in a few steps)
                record.resting -= 1
                self.rested += 1
                return 0
            return self.long_k
        c = self.cost_now(name)
        extra = record.first_extra = self.first_pass_extra(drafter)
        k, gain = best_lookahead(self.estimate(name).estimate(), self.curve, c, self.k_max(), first=c * extra)
        startup = self.startup_cost(drafter)
        if k > 0 and self.catch_up_pays(name, c, gain, startup):
            record.off_steps = 0
            return k
        record.off_steps += 1
        if record.off_steps * self.settings.probe_share >= self.probe_cost(name, c) + startup:
            record.off_steps = 0
            self.probes += 1
            return 1
        return 0

    def first_pass_extra(self, drafter: Drafter) -> float:
        """What a model drafter's next first pass costs beyond a one-row pass, in its passes: from its model's
        measured cost curve (d[n-1] = its n-row pass over its one-row pass, as the book held it at `prepare`) for the
        rows it must feed (`pending`); 0 for a drafter that did not draft last step (`catch_up_cost` prices its
        unseen tokens), or without a curve."""
        record = self.record(drafter.name)
        if not record.curve or drafter.name not in self.drafted_last:
            return 0.0
        return max(0.0, record.curve[min(record.pending, len(record.curve)) - 1] - 1.0)

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
        record = self.drafters.get(name)
        unseen = self.length - (record.seen if record is not None else 0)
        return c * unseen * self.curve[-1] / len(self.curve)

    def startup_cost(self, drafter: Drafter) -> float:
        """The one-off work its model does before its first pass (`startup_s`: an input it encodes when first
        needed), in plain steps of the target (0 when none, or when no plain step has been timed)."""
        seconds = drafter.model.startup_s if drafter.model is not None else 0.0
        unit = self.unit_s or plain_seconds(self.measured)
        return seconds / unit if seconds and unit else 0.0

    def catch_up_pays(self, name: str, c: float, gain: float, startup: float = 0.0) -> bool:
        """Whether switching a drafter on is worth its catch-up and its model's `startup` (plain steps): drafting at
        the expected `gain` for the rest of the generation (the budget `prepare` was given) must save more plain
        steps than they cost. The prompt is the catch-up of a drafter's first use, so a long prompt with few tokens
        to generate keeps a costly assistant off from the start."""
        cost = self.catch_up_cost(name, c) + startup
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
        if self.alternatives is not None:
            self.alternatives.count(outcome)
        self.check_unverified([*outcome.draft.tokens[: outcome.accepted], outcome.token])
        if outcome.drafter and outcome.draft.tokens:
            self.learn(outcome)
            self.rest(outcome)
        if self.measure:
            self.measure_step(outcome)
        self.drafted_before = self.drafted_last
        self.drafted_last = {outcome.drafter} if outcome.drafter and outcome.draft.tokens else set()
        if outcome.drafter and outcome.draft.tokens:
            self.record(outcome.drafter).pending = 2 if outcome.accepted == len(outcome.draft.tokens) else 1

    def rest(self, outcome: StepOutcome) -> None:
        """Count a free drafter's drafts priced out in a row; past `rest_after`, it rests `rest_steps` steps."""
        if not self.is_free(outcome.drafter):
            return
        record = self.record(outcome.drafter)
        record.unused = record.unused + 1 if outcome.verified == 0 else 0
        if record.unused >= self.settings.rest_after:
            record.resting = self.settings.rest_steps

    def learn(self, outcome: StepOutcome) -> None:
        """Record which of the step's draft tokens were accepted (and, for free, whether the next would have been)."""
        self.record(outcome.drafter).seen = self.length
        source = outcome.draft.source or outcome.drafter
        estimates = [self.estimate(source, outcome.drafter)]
        if source != outcome.drafter:
            estimates.append(self.estimate(outcome.drafter))
        unverified = outcome.draft.tokens[outcome.verified :]
        for acceptance in estimates:  # the source's own, and its drafter's pooled one
            acceptance.record(outcome.verified, outcome.accepted)
        if outcome.accepted == outcome.verified and unverified and outcome.draft.probs is None:
            # The target's own next token tells, for free, whether the next draft token would have been accepted
            # (greedy: exactly; sampling: with probability p(token), the one-hot acceptance probability); the tokens
            # it emits in the next steps tell the same of the draft tokens after it.
            self.unverified[source] = (outcome.drafter, list(unverified), outcome.verified)
            self.check_unverified([outcome.token], source)

    def check_unverified(self, emitted: list[int], only: str | None = None) -> None:
        """Compare the draft tokens left unverified (each source's last ones, or `only`'s) with the tokens the target
        emitted, in order: each one observed at its draft position as if it had been verified (kept while they
        agree: a position's rate is conditional on the ones before it), until one differs or they run out."""
        for source in [only] if only is not None else list(self.unverified):
            drafter, tokens, position = self.unverified.pop(source)
            estimates = [self.estimate(source, drafter)] + ([self.estimate(drafter)] if source != drafter else [])
            agreed = 0
            while agreed < min(len(tokens), len(emitted)):
                same = tokens[agreed] == emitted[agreed]
                for acceptance in estimates:
                    acceptance.observe(position + agreed, same)
                if not same:
                    break
                agreed += 1
            else:
                if agreed < len(tokens):  # all agreed so far: the rest is checked against the next steps' tokens
                    self.unverified[source] = (drafter, tokens[agreed:], position + agreed)

    def measure_step(self, outcome: StepOutcome) -> None:
        """Follow the passes' time and the drafter's cost per token from this step's timings (greedy only)."""
        if outcome.verify_s > 0:
            shape = (1 + outcome.alternatives, 1 + outcome.alternatives, outcome.verified + outcome.alternative_rows)
            self.online.observe(shape, outcome.verify_s)
        # A drafter that drafted last step too has no catch-up cost in its time.
        if outcome.drafter and outcome.draft.tokens and outcome.drafter in self.drafted_last and self.unit_s:
            self.time_drafter(outcome.drafter, outcome.draft_s, len(outcome.draft.tokens))

    def time_drafter(self, name: str, seconds: float, tokens: int) -> None:
        """Follow a drafter's cost per token, in plain steps, from one proposal's time (its first pass's cost beyond
        one row's, in passes, as priced, `first_extra`: not a token's)."""
        record = self.record(name)
        c = seconds / (tokens + record.first_extra) / self.unit_s
        record.cost += self.settings.cost_weight * (c - record.cost)
        record.timed = True

    def report(self) -> dict:
        out = {"schedule": "adaptive", "adaptive_probes": self.probes, "adaptive_rested_steps": self.rested}
        if self.alternatives is not None:
            out.update(self.alternatives.report())
        out["drafter_cost_per_token"] = {name: round(r.cost, 3) for name, r in self.drafters.items()}
        out["acceptance_estimate"] = {
            src: [round(r, 2) for r in a.estimate()[:4]] for src, a in sorted(self.acceptance.items())
        }
        return out
