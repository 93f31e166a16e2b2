"""How a model's pass costs are measured: the passes timed through the backend seam, and the record they make.

Contract: `measure_costs(model)` times every stage now and returns the record saved on disk (`costs_record`): the
curve `t(k+1) / t(1)` for k = 0..MAX_K, where t(n) is the time of one forward pass over n new tokens after a short
context (`backends.measure.step_times`), measured on the model as it runs, after its transforms; t(n) / t(1) at a
few wider row counts (`WIDE_ROWS`, for batched steps over many sequences); and what a further sequence and a further
draft row cost in a pass over `BATCH` sequences. `measurement_stages(model)` is the same measurement as stages, each
a generator that yields after each timed pass (for a caller that measures between other work: the cost book's
`Calibration`). Offloaded (`capabilities.offloaded`), every pass reads the weights from their file, so fewer row
counts are timed (`SPARSE_ROWS`) and the curve is linear between them. `quick_costs(model)` is a provisional,
conservative `PassCosts` from a few row counts. Everything goes through the seam (new cache, feed, crop, fork, clock),
so any backend can be priced. This module measures when asked and keeps nothing: when to measure, and where the
result is kept, is the cost book's (`policy.costs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

import numpy as np
import torch

from assistgen.backends.measure import (
    fed_in_pieces,
    finish,
    random_context,
    rounds,
    step_time_pieces,
    step_times,
    watched,
)
from assistgen.policy.gain import MAX_K
from assistgen.spec.costs import PassCosts

WIDE_ROWS = (24, 32, 64, 128)  # row counts past MAX_K + 1 measured for batched steps (`PassCosts.rows`)
BATCH = 8  # sequences in the batched passes measured for `PassCosts.batch`
# else measured again (a record made before measurements were watched for other processes' load, too)
REQUIRED = ("verification_costs", "wide_costs", "batch_row_cost", "sequence_cost", "others_share")
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
    """Time the model's passes, every stage now, watched for other processes' load (`backends.measure.watched`)."""
    return watched(lambda: costs_record(model, *(finish(stage()) for stage in measurement_stages(model))))


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
