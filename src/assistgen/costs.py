"""The cost model: what one verification step costs relative to plain decoding, per model and machine.

Contract: `verification_costs(model)` returns v with v[k] = t(k+1) / t(1), where t(n) is the time of one
target forward pass over n new tokens after a short context. A step that verifies k draft tokens
feeds k+1 tokens, so it costs v[k] plain steps (v[0] = 1). When the small-row linear transform is on
(`transforms.py`), the same measurement picks its route per row count: the whole model is timed
with every linear on MKL's route and on oneDNN's, and each row count takes the faster
(`tune_routes`; `load_model` does this). Both are measured once per model, machine and software
stack (a few seconds) and cached as JSON under `$ASSISTGEN_CACHE/costs/`, keyed by a fingerprint
(model, torch and transformers versions, CPU, threads, transform on or off), so a change of any of
them measures again; `refresh=True` or deleting the file re-measures. Models built in memory (no
`cache_key`) are measured once per process. How long a drafter takes per proposed token is
measured online by the adaptive schedule, not here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import time

import torch

from assistgen.models import Model, cache_root

MAX_K = 16  # costs are measured for k = 0..MAX_K draft tokens


@torch.inference_mode()
def measure_step_times(model: Model, max_k: int = MAX_K, context: int = 128, repeats: int = 3) -> list[float]:
    """Seconds of one forward over n = 1..max_k+1 new tokens after `context` tokens (best of `repeats`)."""
    from assistgen.cache import KVCache

    vocab = min(model.vocab_size, len(model.tokenizer))
    limit = model.context_length or context + max_k + 1
    context = max(1, min(context, limit - max_k - 2))
    ids = torch.randint(3, vocab, (context + max_k + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = KVCache(model.hf)
    cache.feed(ids[:context])
    times = []
    for k in range(max_k + 1):
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            cache.feed(ids[context : context + k + 1], logits_to_keep=k + 1)
            best = min(best, time.perf_counter() - start)
            cache.crop(context)
        times.append(best)
    return times


def fingerprint(model: Model) -> str:
    from transformers import __version__ as transformers_version

    from assistgen.transforms import grouped_attention_applied, is_applied

    parts = [
        model.cache_key or model.name,
        str(sum(p.numel() for p in model.hf.parameters())),
        torch.__version__,
        transformers_version,
        platform.machine(),
        _cpu_name(),
        str(torch.get_num_threads()),
        f"small-rows={is_applied(model.hf)}",
        f"grouped-attention={grouped_attention_applied(model.hf)}",
        "routes=v2",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def costs_path(model: Model):
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in (model.cache_key or model.name))
    return cache_root() / "costs" / f"{safe[:80]}-{fingerprint(model)}.json"


def verification_costs(model: Model, refresh: bool = False) -> list[float]:
    """The model's v[0..MAX_K], from memory, from disk, or measured now (and saved)."""
    return calibration(model, refresh)["verification_costs"]


def tune_routes(model: Model, refresh: bool = False) -> list[str] | None:
    """Give the transformed model's linears the fastest route per row count (measured once, cached)."""
    from assistgen.transforms import DEFAULT_MAX_ROWS, small_rows_linear

    routes = calibration(model, refresh).get("routes")
    if routes:
        small_rows_linear(model.hf, mode="on", max_rows=DEFAULT_MAX_ROWS, routes=routes)
    return routes


def calibration(model: Model, refresh: bool = False) -> dict:
    """{"verification_costs": v, "routes": per-row-count route or None}: memo, disk, or measured now."""
    key = fingerprint(model)
    memo = getattr(model.hf, "_assistgen_costs", {})
    if key in memo and not refresh:
        return memo[key]
    path = costs_path(model) if model.cache_key else None
    record = None
    if path is not None and path.exists() and not refresh:
        try:
            record = json.loads(path.read_text())
            record["verification_costs"]  # noqa: B018 - a file without it is measured again
        except (OSError, ValueError, KeyError):
            record = None
    if record is None:
        record = measure_calibration(model)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
    model.hf._assistgen_costs = {**memo, key: record}
    return record


def measure_calibration(model: Model) -> dict:
    """Time the model per row count; with the small-row transform on, on each route, keeping the faster."""
    from assistgen.transforms import DEFAULT_MAX_ROWS, is_applied, remove_small_rows_linear, small_rows_linear

    record = {"model": model.name, "measured": time.strftime("%Y-%m-%d %H:%M"), "routes": None}
    if not is_applied(model.hf):
        times = measure_step_times(model)
    else:
        by_route = {}
        for route in ("mkl", "onednn"):
            remove_small_rows_linear(model.hf)
            small_rows_linear(model.hf, mode="on", max_rows=DEFAULT_MAX_ROWS, routes=route)
            by_route[route] = measure_step_times(model, repeats=2)
        routes = route_table(by_route)
        small_rows_linear(model.hf, mode="on", max_rows=DEFAULT_MAX_ROWS, routes=routes)  # reuses the packed weights
        times = [by_route[routes[n + 1]][n] for n in range(MAX_K + 1)]  # n+1 rows
        record["routes"] = routes
        record["step_seconds"] = {r: [round(t, 5) for t in ts] for r, ts in by_route.items()}
    record["verification_costs"] = [t / times[0] for t in times]
    return record


def route_table(by_route: dict[str, list[float]]) -> list[str]:
    """The faster route per row count (index = rows, 0..DEFAULT_MAX_ROWS) from step times per route,
    by_route[route][n] for n+1 rows; ties go to MKL, rows beyond the measured ones keep the last choice."""
    from assistgen.transforms import DEFAULT_MAX_ROWS

    measured = len(next(iter(by_route.values())))
    chosen = [min(("mkl", "onednn"), key=lambda r: by_route[r][n]) for n in range(measured)]
    return ["mkl"] + chosen + [chosen[-1]] * (DEFAULT_MAX_ROWS - measured)
