"""Timing a model's forward passes through the seam: what route tuning and the cost model both measure.

Contract: `step_times(model)` returns the seconds of one forward pass over n = 1..max_k+1 new tokens (or each n of
`rows`) after a short random context, each timed right after an untimed one-row pass, as decoding meets it (a library
may reuse the last pass's set-up for a pass of the same shape, as llama.cpp reuses its compute graph: a decoding step
follows a one-row step, a verification pays the set-up), the best of a few rounds taken round-robin (`best_of_rounds`:
a burst of noise then spoils one round of each row count, not every round of one); `random_context` makes the random
ids (fed in pieces by `fed_in_pieces`). `step_time_pieces` and `rounds` are the same measurements as generators that
yield after each timed pass (their return value the result: `finish` runs one to its end), for a caller that measures
between other work and may drop a measurement half done (closing it frees its caches). `watched(measure)` runs a
measurement and adds to its record the share of the CPUs other processes took meanwhile (`others_share`);
`is_quiet(record)` says whether that share was small enough for the record to be kept on disk as this machine's (a
measurement made while other work shared the cores prices every later run wrongly: it is used for the run that made
it, and made again next time). It uses only `backends.base` verbs (`new_cache`, `feed`, `crop`, `clock`), so it times
any backend; it knows nothing about policies or routes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from assistgen.backends.base import MAX_K
from assistgen.backends.machine import cpu_ticks, others_share

CONTENDED = 0.1  # other processes' share of our CPUs above which a measurement is not kept (a fifth of a core of two)


def step_times(model, max_k: int = MAX_K, context: int = 128, repeats: int = 3,
               rows: list[int] | None = None) -> list[float]:
    """Seconds of one forward over n new tokens after `context` tokens, for n = 1..max_k+1 (or each n in `rows`)."""
    return finish(step_time_pieces(model, max_k, context, repeats, rows))


@torch.inference_mode()
def step_time_pieces(model, max_k: int = MAX_K, context: int = 128, repeats: int = 3,
                     rows: list[int] | None = None) -> Generator[None, None, list[float]]:
    """`step_times`, yielding after each timed pass."""
    rows = list(rows) if rows is not None else list(range(1, max_k + 2))
    ids, context = random_context(model, context, max(rows), seed=0)
    cache = model.new_cache()
    yield from fed_in_pieces(cache, ids[:context])

    def run(n: int) -> float:
        cache.feed(ids[context : context + 1], logits_to_keep=1)  # (untimed: the timed pass follows a one-row
        cache.crop(context)  # pass, as a decoding step does)
        start = model.clock()
        cache.feed(ids[context : context + n], logits_to_keep=n)
        elapsed = model.clock() - start
        cache.crop(context)
        return elapsed

    return (yield from rounds([lambda n=n: run(n) for n in rows], repeats))


def fed_in_pieces(cache, ids: list[int], piece: int = 16) -> Generator[None, None, None]:
    """Feed a timing context `piece` tokens at a time, yielding after each (a caller waits at most one piece)."""
    for start in range(0, len(ids), piece):
        cache.feed(ids[start:start + piece])
        yield


def random_context(model, context: int, new: int, seed: int) -> tuple[list[int], int]:
    """Random token ids for timing: `context` tokens (fewer where the model's context length needs it) followed by
    `new` more; returns (ids, the context length used)."""
    vocab = min(model.vocab_size, len(model.tokenizer))
    limit = model.context_length or context + new + 1
    context = max(1, min(context, limit - new - 1))
    ids = torch.randint(3, vocab, (context + new,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids, context


def best_of_rounds(runs: list, repeats: int) -> list[float]:
    """Each timed run's best of `repeats` rounds, taken round-robin over the runs, after a warm-up round.
    runs: callables returning seconds."""
    return finish(rounds(runs, repeats))


def rounds(runs: list, repeats: int) -> Generator[None, None, list[float]]:
    """`best_of_rounds`, yielding after each run."""
    best = [float("inf")] * len(runs)
    for round_ in range(repeats + 1):
        for i, run in enumerate(runs):
            elapsed = run()
            if round_:
                best[i] = min(best[i], elapsed)
            yield
    return best


def finish(pieces: Generator):
    """Run a measurement's pieces to the end; its result."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def watched(measure: Callable[[], dict]) -> dict:
    """`measure()`'s record with `others_share`: the share of this process's CPUs that other processes took while it
    ran (None where the machine does not say)."""
    start = cpu_ticks()
    record = measure()
    end = cpu_ticks()
    record["others_share"] = others_share(end - start if start and end else None)
    return record


def is_quiet(record: dict) -> bool:
    """Whether a watched measurement ran with the cores to itself (or the machine does not say), so that it may be
    kept as this machine's."""
    share = record.get("others_share")
    return share is None or share <= CONTENDED
