"""Early-exit self-speculation: the target's own first N decoder layers draft for it.

Contract: needs a target that declares the `first_layers` capability (`backends.base`); without it,
`EarlyExitDrafter` raises a ValueError naming the model. `target.truncated(N)` is a model that runs the
target's first N decoder layers, then its final norm and output head, sharing every weight (the backend
builds it). `EarlyExitDrafter` drafts with it through `AssistantDrafter` (its own KV cache, synced to the
sequence at every proposal). `calibrate_exit_layer` picks N when none is given: the backend measures, in
one teacher-forced forward of the full target over a calibration text, how often the exit-N argmax equals
the full model's (alpha_N, `exit_agreement`), and the share of the parameters a draft token touches
(c_N, `layer_costs`); the N with the best expected speed-up (`gain.best_draft_length` with the
target's measured verification costs, from the cost book, measured there if the target was not prepared: this
runs when the drafter is built, before any step) wins. The drafter remembers a calibration per target for the life
of the process, so only the first request pays for it. This module knows nothing
about acceptance or schedules: the generation loop verifies what it drafts.
"""

from __future__ import annotations

import weakref
from importlib.resources import files

from assistgen.drafters.assistant import AssistantDrafter
from assistgen.policy.costs import measured_costs
from assistgen.policy.gain import MAX_K, best_draft_length
from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

CALIBRATION_TOKENS = 256
SCORED_POSITIONS = 128  # positions of the calibration text at which every exit is scored (None: all)


class EarlyExitDrafter(Drafter):
    """Drafts with the target truncated to its first `layers` decoder layers (chosen by calibration if None)."""

    name = "early-exit"

    def __init__(
        self,
        target,
        layers: int | None = None,
        calibration_ids: list[int] | None = None,
        verify_cost: list[float] | None = None,
    ):
        if not target.capabilities.first_layers:
            if target.backend != "torch":
                raise ValueError(f"early exit needs the target's own first layers, which the {target.backend} "
                                 f"backend cannot run as a model of their own: load {target.name} with "
                                 "backend='torch' (--backend torch), or draft with --lookup or an assistant")
            raise ValueError(f"early exit does not support {target.name}: its backend cannot run its first layers "
                             "as a model of their own (no decoder layer list with an output head was found)")
        self.calibration: list[dict] | None = None  # the table of calibrate_exit_layer, when it ran
        self.agreement: float | None = None
        if layers is None:
            ids = calibration_ids if calibration_ids is not None else default_calibration_ids(target)
            layers, self.calibration = remembered_calibration(target, ids, verify_cost)
            self.agreement = next(row["agreement"] for row in self.calibration if row["layers"] == layers)
        self.layers = layers
        self.model = target.truncated(layers)
        self.assistant = AssistantDrafter(self.model, target)
        self.context_length = self.assistant.context_length

    @property
    def acceptance_prior(self) -> float | None:
        """The calibrated agreement: the adaptive policy's acceptance estimate before any draft."""
        return self.agreement

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        draft = self.assistant.propose(ids, k, sampler, min_confidence)
        draft.source = "early-exit"
        return draft

    def report(self) -> dict:
        return {"early_exit_layers": self.layers, "early_exit_agreement": self.agreement}


def default_calibration_ids(target, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The first `n` tokens of the package's sample article, in the target's tokenizer."""
    text = files("assistgen").joinpath("data/article.txt").read_text()
    return list(target.tokenizer(text)["input_ids"])[:n]


def best_speedup(alpha: float, cost: float, verify_cost: list[float]) -> tuple[float, int]:
    """(max over k = 1..MAX_K of the expected gain E(k) / (k * cost + v[k]) at acceptance rate alpha, that k),
    with v = verify_cost (k within it)."""
    k, gain = best_draft_length([alpha], verify_cost, cost, MAX_K)
    return gain, k


def calibrate_exit_layer(
    target,
    ids: list[int] | None = None,
    verify_cost: list[float] | None = None,
    positions: int | None = SCORED_POSITIONS,
) -> tuple[int, list[dict]]:
    """The exit layer N with the best expected speed-up, and the table behind the choice.

    `ids`: the calibration text (default: the first 256 tokens of the package's sample article);
    `verify_cost[k]`: the cost of verifying k draft tokens relative to a plain step (default: the target's
    measured costs, `costs.measured_costs`).
    Rows: {"layers", "agreement", "cost", "best_speedup", "best_k"} for N = 1..L-1. When no row's
    best_speedup exceeds 1, early exit is not expected to pay on this model (N is still the best one).
    """
    if verify_cost is None:
        verify_cost = list(measured_costs(target).curve)
    if len(verify_cost) < 2:
        raise ValueError("verify_cost needs v[0] and at least v[1] (cost of verifying 1 draft token)")
    ids = default_calibration_ids(target) if ids is None else list(ids)
    agreement, costs = target.exit_agreement(ids, positions), target.layer_costs()
    table = []
    for n, (alpha, cost) in enumerate(zip(agreement, costs, strict=True), start=1):
        speedup, k = best_speedup(alpha, cost, verify_cost)
        table.append({"layers": n, "agreement": alpha, "cost": cost, "best_speedup": speedup, "best_k": k})
    best = max(table, key=lambda row: row["best_speedup"])
    return best["layers"], table


_calibrations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {settings: result}


def remembered_calibration(target, ids: list[int], verify_cost: list[float] | None = None) -> tuple[int, list[dict]]:
    """`calibrate_exit_layer`, run once per target and settings in this process (each request builds a drafter;
    calibrating a large-vocabulary model takes seconds). verify_cost None: the target's measured costs."""
    if verify_cost is None:
        verify_cost = list(measured_costs(target).curve)
    key = (tuple(ids), tuple(verify_cost))
    known = _calibrations.setdefault(target, {})
    if key not in known:
        known[key] = calibrate_exit_layer(target, ids, verify_cost)
    layers, table = known[key]
    return layers, [dict(row) for row in table]
