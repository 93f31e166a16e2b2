"""The cost model: what one forward pass over n rows costs relative to plain decoding, per model and machine.

Contract: `pass_costs(model)` returns the model's `PassCosts` (the value, `spec.costs`), kept in the model's own
`costs` field: measured on first use (`calibrate`), or read back from disk.
The curve `curve[k] = t(k+1) / t(1)` (v[k] in `gain.py`), where
t(n) is the time of one forward pass over n new tokens after a short context (`backends.measure.step_times`): a step
that verifies k draft tokens feeds k+1 tokens, so it costs v[k] plain steps (v[0] = 1). It is measured on the model
as it runs, after its transforms, together with t(n) / t(1) at a few wider row counts (`WIDE_ROWS`, for batched
steps over many sequences: `PassCosts.rows`) and what a further sequence and a further draft row cost in a pass over
`BATCH` sequences (`PassCosts.batch`), and cached as JSON under `$ASSISTGEN_CACHE/costs/`, keyed by the model's
fingerprint (`backends.base`: model, set-up, library versions, CPU, threads), so a change of any of them measures
again; `calibrate(model, refresh=True)` or deleting the file re-measures. `calibrate(model, later=True)` does not
hold up a server's start: with nothing on disk it sets a provisional curve from a few row counts (`quick_costs`,
conservative: each row count priced at a wider one's time) and leaves the full measurement as a `Calibration` in
`pending()`, which the serving engine advances one timed pass at a time while no request runs (how a generation's
passes compare with the measurement as they run is `online.OnlineCosts`'s). Models without a `cache_key` are
measured once per model object. Everything is measured through the backend seam (new cache, feed, crop, fork,
clock), so any backend can be priced. How long a drafter takes per proposed token is measured online by the
adaptive schedule, not here.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Generator
from pathlib import Path

import numpy as np
import torch

from assistgen.backends.measure import fed_in_pieces, finish, random_context, rounds, step_time_pieces, step_times
from assistgen.paths import measurement_file, recalled, remember, remembered
from assistgen.policy.gain import MAX_K
from assistgen.spec.costs import PassCosts

WIDE_ROWS = (24, 32, 64, 128)  # row counts past MAX_K + 1 measured for batched steps (`PassCosts.rows`)
BATCH = 8  # sequences in the batched passes measured for `PassCosts.batch`
REQUIRED = ("verification_costs", "wide_costs", "batch_row_cost", "sequence_cost")  # else measured again


def pass_costs(model) -> PassCosts:
    """The model's `PassCosts`: its `costs` field, measured (or read from disk) on first use."""
    return model.costs if model.costs is not None else calibrate(model)


def calibrate(model, refresh: bool = False, later: bool = False) -> PassCosts:
    """Read the model's costs from disk, or measure them now (and save them); kept in `model.costs`. `later`: when
    nothing is on disk, a provisional curve now (`quick_costs`, a few passes) and the full measurement left to a
    `Calibration` in `pending()`, which a server runs while it is idle (an offloaded model is measured now)."""
    path = costs_path(model)
    if later and not model.capabilities.offloaded:
        record = None if refresh else recalled(path, REQUIRED)
        if record is None:
            model.costs = quick_costs(model)
            _PENDING[model] = Calibration(model, path)
            return model.costs
        model.costs = PassCosts.of(record)
        return model.costs
    record = remembered(path, lambda: measure_costs(model), REQUIRED, refresh)
    model.costs = PassCosts.of(record)
    return model.costs


def costs_path(model) -> Path | None:
    """Where this model's costs on this machine are cached (None without a `cache_key`: kept in memory only)."""
    return measurement_file("costs", model.cache_key, model.fingerprint()) if model.cache_key else None


SPARSE_ROWS = (1, 2, 3, 5, 9, 13, 17)  # the row counts timed under a memory budget (the rest interpolated)
QUICK_ROWS = (1, 2, 3, 5, 9, MAX_K + 1)  # the row counts a provisional curve is timed at


def quick_costs(model) -> PassCosts:
    """A provisional, conservative PassCosts from a few row counts (QUICK_ROWS, best of 2). A pass over more rows
    never takes less time, so each row count is priced at the next timed one up (a chord would not be safe: on
    llama.cpp one row runs a faster kernel than two); every wider pass, and each further sequence or batched draft
    row, at the widest timed pass's cost per row, which t(n) / n only falls from past it. The policy so drafts
    no more than the measured curve would have it."""
    timed = step_times(model, rows=list(QUICK_ROWS), repeats=2)
    times = [timed[int(np.searchsorted(QUICK_ROWS, n))] for n in range(1, QUICK_ROWS[-1] + 1)]
    per_row = timed[-1] / QUICK_ROWS[-1] / timed[0]  # t(1) units
    return PassCosts.of({"model": model.name, "measured": "provisional", "provisional": True,
                         "step_seconds": times, "verification_costs": [t / timed[0] for t in times],
                         "wide_rows": list(WIDE_ROWS), "wide_costs": [n * per_row for n in WIDE_ROWS],
                         "sequence_cost": per_row, "batch_row_cost": per_row})


def measurement_stages(model) -> list[Callable[[], Generator]]:
    """The cost measurement as stages, each a generator of timed passes (`backends.measure`) whose value is its
    times: one sequence's curve, its wider passes, the batched passes. Offloaded (`capabilities.offloaded`),
    every pass reads the weights from their file (seconds each on a large model), so fewer are timed: the row
    counts of `SPARSE_ROWS` once each after a warm-up, the curve linear between them; the policy follows the
    passes' real times online anyway (`online.OnlineCosts`)."""
    if model.capabilities.offloaded:
        return [lambda: step_time_pieces(model, rows=list(SPARSE_ROWS), repeats=1),
                lambda: step_time_pieces(model, repeats=1, rows=list(WIDE_ROWS)),
                lambda: batch_step_pieces(model, repeats=1)]
    return [lambda: step_time_pieces(model, max_k=MAX_K),
            lambda: step_time_pieces(model, repeats=2, rows=list(WIDE_ROWS)),
            lambda: batch_step_pieces(model)]


def costs_record(model, times: list[float], wide: list[float], batch: tuple[float, float, float]) -> dict:
    """The saved record of a measurement's stages' times."""
    if model.capabilities.offloaded:
        times = interpolated(times, SPARSE_ROWS)
    one, apart, two = batch
    return {"model": model.name, "measured": time.strftime("%Y-%m-%d %H:%M"),
            "step_seconds": [round(t, 6) for t in times], "verification_costs": [t / times[0] for t in times],
            "wide_rows": list(WIDE_ROWS), "wide_costs": [t / times[0] for t in wide],
            # a batched pass over BATCH sequences: each further sequence, each further row of one (t(1) units)
            "sequence_cost": max(0.0, (apart - one) / (BATCH - 1) / times[0]),
            "batch_row_cost": max(0.0, (two - apart) / BATCH / times[0])}


def measure_costs(model) -> dict:
    """Time the model's passes, every stage now."""
    return costs_record(model, *(finish(stage()) for stage in measurement_stages(model)))


class Calibration:
    """A model's full cost measurement, run in pieces between other work (one thread, the model's own).
    `advance()` times one pass and says whether more remain; after the last the record is saved and becomes
    `model.costs`, and the calibration leaves `pending()`. `interrupt()` drops the stage half done (closing its
    generator frees its caches, so the model's sequences can serve), to be timed again from that stage's start.
    `abandon()` gives up: the provisional costs stay. One thread advances it at a time (a call while another
    thread times a pass returns at once), and no pass is timed while an engine other than the caller serves
    requests on the model (`hold`/`release`: engines of two servers may share a model)."""

    def __init__(self, model, path: Path | None):
        self.model, self.path = model, path
        self.stages = measurement_stages(model)
        self.results: list = []
        self.current: Generator | None = None
        self.lock = threading.Lock()  # one thread times a pass at a time (engines of several servers may share a model)
        self.holders: set[int] = set()  # ids of the engines now serving requests on the model
        self.holding = threading.Lock()  # guards `holders` (never held while a pass is timed)

    def hold(self, who: object) -> None:
        """`who` (an engine) serves requests on the model: no pass is timed until it lets go (`release`), and a stage
        half done is dropped (its caches freed for the requests; a pass being timed ends first)."""
        with self.holding:
            self.holders.add(id(who))
        with self.lock:
            self._interrupt()

    def release(self, who: object) -> None:
        with self.holding:
            self.holders.discard(id(who))

    def free_for(self, who: object) -> bool:
        """Whether `who` may time a pass now: no other engine serves requests on the model."""
        with self.holding:
            return not (self.holders - {id(who)})

    def advance(self, who: object = None) -> bool:
        if not self.lock.acquire(blocking=False):
            return True  # another thread is timing a pass of it
        try:
            return True if not self.free_for(who) else self._advance()  # (requests on the model come first)
        finally:
            self.lock.release()

    def _advance(self) -> bool:
        if self.current is None:
            self.current = self.stages[len(self.results)]()
        try:
            next(self.current)
            return True
        except StopIteration as done:
            self.results.append(done.value)
            self.current = None
        if len(self.results) < len(self.stages):
            return True
        record = costs_record(self.model, *self.results)
        remember(self.path, record)
        self.model.costs = PassCosts.of(record)
        _PENDING.pop(self.model, None)
        return False

    def interrupt(self) -> None:
        with self.lock:
            self._interrupt()

    def _interrupt(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def abandon(self) -> None:
        with self.lock:
            self._interrupt()
        _PENDING.pop(self.model, None)


_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Calibration, until measured


def pending(models: list | None = None) -> list[Calibration]:
    """The cost measurements left for later (`calibrate(later=True)`), oldest first; those of `models` only when
    given (an engine measures the models it serves, never another engine's)."""
    calibrations = list(_PENDING.values())
    return calibrations if models is None else [c for c in calibrations if any(c.model is m for m in models)]


def costs_state(model) -> str:
    """What the policy prices `model`'s passes on: "measured", "measuring" (provisional costs, the measurement
    pending), "provisional" (the measurement given up) or "unmeasured" (nothing yet)."""
    if model.costs is None:
        return "unmeasured"
    if not model.costs.record.get("provisional"):
        return "measured"
    return "measuring" if model in _PENDING else "provisional"


def interpolated(times: list[float], rows: tuple[int, ...]) -> list[float]:
    """t(n) for n = 1..rows[-1] from the times at `rows` (ascending, from 1), linear between them."""
    return np.interp(np.arange(1, rows[-1] + 1), rows, times).tolist()


def batch_step_times(model, context: int = 128, repeats: int = 3) -> tuple[float, float, float]:
    """Seconds of one pass over BATCH new rows of one sequence, over one new row of each of BATCH sequences, and
    over two rows of each (best of `repeats`, round-robin), after `context` tokens each."""
    return finish(batch_step_pieces(model, context, repeats))


@torch.inference_mode()
def batch_step_pieces(model, context: int = 128, repeats: int = 3) -> Generator[None, None, tuple]:
    """`batch_step_times`, yielding after each timed pass."""
    ids, context = random_context(model, context, BATCH, seed=1)
    first = model.new_cache()
    yield from fed_in_pieces(first, ids[:context])
    caches = [first] + [first.fork() for _ in range(BATCH - 1)]
    shapes = ([(first, ids[context:], BATCH)], [(c, ids[context:context + 1], 1) for c in caches],
              [(c, ids[context:context + 2], 2) for c in caches])

    def run(feeds) -> float:
        start = model.clock()
        model.feed_together(feeds)
        elapsed = model.clock() - start
        for cache, _, _ in feeds:
            cache.crop(context)
        return elapsed

    one, apart, two = yield from rounds([lambda f=f: run(f) for f in shapes], repeats)
    return one, apart, two
