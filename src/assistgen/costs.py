"""The cost model: what one verification step costs relative to plain decoding, per model and machine.

Contract: `verification_costs(model)` returns v with v[k] = t(k+1) / t(1), where t(n) is the time of one
target forward pass over n new tokens after a short context (`timing.step_times`). A step that
verifies k draft tokens feeds k+1 tokens, so it costs v[k] plain steps (v[0] = 1). It is measured on
the model as it runs, after its transforms (`transforms.optimize` tunes the linear routes first), once
per model, machine and software stack (a few seconds), together with t(n) / t(1) at a few wider row counts
(`WIDE_ROWS`, for batched steps over many sequences: `PassCosts.rows`) and what a further sequence and a further
draft row cost in a pass over `BATCH` sequences (`PassCosts.batch`), and cached as JSON under
`$ASSISTGEN_CACHE/costs/`, keyed by a fingerprint (model, quantization, library versions, CPU,
threads, the applied routes and attention, the KV layout), so a change of any of them measures again;
`refresh=True` or deleting the file re-measures. Models built in memory (no `cache_key`) are measured
once per process. How long a drafter takes per proposed token is measured online by the adaptive
schedule, not here. The policy reads this module; loading and transforms do not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from assistgen.gain import MAX_K
from assistgen.timing import best_of_rounds, clock, measurement_key, measurement_path, random_context, step_times

if TYPE_CHECKING:
    from assistgen.models import Model

WIDE_ROWS = (24, 32, 64, 128)  # row counts past MAX_K + 1 measured for batched steps (`PassCosts.rows`)
BATCH = 8  # sequences in the batched passes measured for `PassCosts.batch`


def _set_up(model: Model) -> tuple[str, ...]:
    """What the curve depends on beyond the model and machine: quantization, linear routes, attention."""
    from assistgen.transforms import applied_routes, grouped_attention_applied

    route = getattr(model.hf, "_assistgen_routes", None)
    return (f"quantization={getattr(model, 'quantization', None)}",
            f"routes={applied_routes(model.hf)}|{route.get('padded') if route else None}",
            f"attention={grouped_attention_applied(model.hf)}", "kv=ragged")


def fingerprint(model: Model) -> str:
    return measurement_key(model, *_set_up(model))


def costs_path(model: Model):
    return measurement_path("costs", model, *_set_up(model))


def verification_costs(model: Model, refresh: bool = False) -> list[float]:
    """The model's v[0..MAX_K] (`gain.MAX_K`), from memory, from disk, or measured now (and saved)."""
    return calibration(model, refresh)["verification_costs"]


def calibration(model: Model, refresh: bool = False) -> dict:
    """{"verification_costs": v, "step_seconds": t, "measured": when}: memo, disk, or measured now."""
    key = fingerprint(model)
    memo = getattr(model.hf, "_assistgen_costs", {})
    if key in memo and not refresh:
        return memo[key]
    path = costs_path(model) if model.cache_key else None
    record = None
    if path is not None and path.exists() and not refresh:
        try:
            record = json.loads(path.read_text())
            record["verification_costs"], record["wide_costs"], record["batch_row_cost"]  # noqa: B018 - else measured
        except (OSError, ValueError, KeyError):
            record = None
    if record is None:
        record = measure_costs(model)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
    model.hf._assistgen_costs = {**memo, key: record}
    return record


@torch.inference_mode()
def measure_costs(model: Model) -> dict:
    times = step_times(model, max_k=MAX_K)
    wide = step_times(model, repeats=2, rows=list(WIDE_ROWS))
    one, apart, two = batch_step_times(model)
    return {"model": model.name, "measured": time.strftime("%Y-%m-%d %H:%M"),
            "step_seconds": [round(t, 6) for t in times], "verification_costs": [t / times[0] for t in times],
            "wide_rows": list(WIDE_ROWS), "wide_costs": [t / times[0] for t in wide],
            # a batched pass over BATCH sequences: each further sequence, each further row of one (t(1) units)
            "sequence_cost": max(0.0, (apart - one) / (BATCH - 1) / times[0]),
            "batch_row_cost": max(0.0, (two - apart) / BATCH / times[0])}


def batch_step_times(model: Model, context: int = 128, repeats: int = 3) -> tuple[float, float, float]:
    """Seconds of one pass over BATCH new rows of one sequence, over one new row of each of BATCH sequences, and
    over two rows of each (best of `repeats`, round-robin), after `context` tokens each."""
    from assistgen.cache import KVCache, feed_together

    ids, context = random_context(model, context, BATCH, seed=1)
    first = KVCache(model.hf)
    first.feed(ids[:context])
    caches = [first] + [first.fork() for _ in range(BATCH - 1)]
    shapes = ([(first, ids[context:], BATCH)], [(c, ids[context:context + 1], 1) for c in caches],
              [(c, ids[context:context + 2], 2) for c in caches])

    def run(feeds) -> float:
        start = clock(first.device)
        feed_together(feeds)
        elapsed = clock(first.device) - start
        for cache, _, _ in feeds:
            cache.crop(context)
        return elapsed

    one, apart, two = best_of_rounds([lambda f=f: run(f) for f in shapes], repeats)
    return one, apart, two


@dataclass(frozen=True)
class PassCosts:
    """A model's measured cost of one forward pass, in plain steps t(1), read once from its calibration record."""

    points: tuple[tuple[int, float], ...]  # (rows, t(rows) / t(1)) of one sequence, rows ascending
    sequence: float  # each further sequence in a batched pass (its own attention)
    batch_row: float  # each further draft row in a batched pass

    @classmethod
    def of(cls, record: dict) -> PassCosts:
        points = list(enumerate(record["verification_costs"], start=1))
        points += [(n, c) for n, c in zip(record["wide_rows"], record["wide_costs"], strict=True) if n > len(points)]
        return cls(tuple(points), record["sequence_cost"], record["batch_row_cost"])

    def rows(self, rows: int) -> float:
        """One sequence, `rows` new tokens: the curve, linear between measured row counts and past the last."""
        points = self.points
        for (n0, c0), (n1, c1) in zip(points, points[1:], strict=False):
            if rows <= n1:
                return c0 + (c1 - c0) * (rows - n0) / (n1 - n0) if rows > n0 else c0
        (n0, c0), (n1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) * (rows - n1) / (n1 - n0)

    def batch(self, sequences: int, rows: int, draft_rows: int = 0) -> float:
        """`sequences` sequences with `rows` rows in all (one per decoding sequence, prompt chunks) and `draft_rows`
        draft rows besides: the rows' cost, plus each further sequence's own attention and each draft row at their
        measured batch costs. One sequence: its curve."""
        if sequences <= 1:
            return self.rows(rows + draft_rows)
        return self.rows(rows) + (sequences - 1) * self.sequence + draft_rows * self.batch_row


def pass_costs(model: Model) -> PassCosts:
    """The model's `PassCosts` (kept with its calibration record in memory; the JSON on disk keeps the figures)."""
    record = calibration(model)
    if "pass_costs" not in record:
        record["pass_costs"] = PassCosts.of(record)
    return record["pass_costs"]

