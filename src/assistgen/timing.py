"""Timing a model: the one clock and the step-time measurement that route tuning and the cost model share.

Contract: `clock(device)` reads a monotonic clock after the device has finished its queued work (a
GPU runs asynchronously, so an unsynchronized clock would time kernel launches; on the CPU it is the
bare clock): every figure the policy or a benchmark uses is read through it. `step_times(model)`
returns the seconds of one forward pass over n = 1..max_k+1 new tokens after a short context;
`machine(device)` names this machine's set-up (and the GPU, for a model on one), and
`measurement_path` is where a measurement of a model on it is cached. It knows nothing about
policies or routes.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time

import torch

from assistgen.devices import accelerator, model_device
from assistgen.gain import MAX_K
from assistgen.paths import cache_root, safe_name


def clock(device: torch.device | str | None = None) -> float:
    """Seconds on a monotonic clock, once `device`'s queued work is done."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def step_times(model, max_k: int = MAX_K, context: int = 128, repeats: int = 3,
               rows: list[int] | None = None) -> list[float]:
    """Seconds of one forward over n new tokens after `context` tokens, for n = 1..max_k+1 (or each n in `rows`):
    the best of `repeats`, taken round-robin over the n (a burst of noise then spoils one run of each n, not
    every run of one n)."""
    from assistgen.cache import KVCache

    rows = list(rows) if rows is not None else list(range(1, max_k + 2))
    device = model_device(model)
    ids, context = random_context(model, context, max(rows), seed=0)
    cache = KVCache(model.hf)
    cache.feed(ids[:context])

    def run(n: int) -> float:
        start = clock(device)
        cache.feed(ids[context : context + n], logits_to_keep=n)
        elapsed = clock(device) - start
        cache.crop(context)
        return elapsed

    return best_of_rounds([lambda n=n: run(n) for n in rows], repeats)


def random_context(model, context: int, new: int, seed: int) -> tuple[list[int], int]:
    """Random token ids for timing: `context` tokens (fewer where the model's context length needs it) followed by
    `new` more; returns (ids, the context length used)."""
    vocab = min(model.vocab_size, len(model.tokenizer))
    limit = model.context_length or context + new + 1
    context = max(1, min(context, limit - new - 1))
    ids = torch.randint(3, vocab, (context + new,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids, context


def best_of_rounds(runs: list, repeats: int) -> list[float]:
    """Each timed run's best of `repeats` rounds, taken round-robin over the runs (a burst of noise then spoils one
    round of each, not every round of one), after a warm-up round. runs: callables returning seconds."""
    best = [float("inf")] * len(runs)
    for round_ in range(repeats + 1):
        for i, run in enumerate(runs):
            elapsed = run()
            if round_:
                best[i] = min(best[i], elapsed)
    return best


def machine(device: torch.device | str | None = None) -> list[str]:
    """What makes timings on this machine differ from another's: software versions, processor, threads, and
    for a `device` on a GPU its name and compute capability (nothing more for the CPU: the same keys as before)."""
    from transformers import __version__ as transformers_version

    return [torch.__version__, transformers_version, platform.machine(), _cpu_name(), str(torch.get_num_threads()),
            *accelerator(device)]


def measurement_key(model, *extra: str) -> str:
    """A fingerprint of a model on this machine: its identity, size and software set-up, plus `extra`."""
    parts = [model.cache_key or model.name, str(sum(p.numel() for p in model.hf.parameters())),
             *machine(model_device(model)), *extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measurement_path(kind: str, model, *extra: str):
    """Where a measurement of `kind` ("costs", "routes") of this model on this machine is cached."""
    name = safe_name(model.cache_key or model.name)
    return cache_root() / kind / f"{name}-{measurement_key(model, *extra)}.json"


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
