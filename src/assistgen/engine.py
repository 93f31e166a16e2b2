"""The one generation loop: prefill -> draft -> verify -> accept -> roll back -> emit.

Contract: `stream()` is a generator of `Chunk`s, one per verification step. Every way of
generating in assistgen (plain decoding, every drafter, the batch API, the CLI, the benchmarks)
goes through it; plain decoding is the loop with a drafter that proposes nothing. The target's
KV cache always holds the sequence minus its last token, so one verification feeds
[last token, d_1 .. d_k] and reads k+1 next-token distributions. Greedy output equals the target's
own greedy decoding; sampled output follows the target's distribution (see `sampling.py`). Every
figure the loop times (prefill, drafting, verification, the total) is read with `timing.clock` on
the target's device, taken once from the target (its cache's `device`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from assistgen.cache import KVCache
from assistgen.config import ConfigError, GenerationConfig
from assistgen.drafters import Draft, Drafter, NoDrafter, attempts
from assistgen.models import Model
from assistgen.sampling import Sampler, verify_greedy, verify_speculative
from assistgen.schedules import Schedule, ScheduleRun, Step
from assistgen.stats import Stats
from assistgen.text import TextStream
from assistgen.timing import clock


@dataclass
class Chunk:
    tokens: list[int]  # token ids emitted by this step
    text: str  # text that became safe to show with this step
    finish_reason: str | None = None  # set on the last chunk: length | eos | stop | context
    stats: Stats | None = None  # the generation's statistics, live; final on the last chunk


def stream(
    target: Model, prompt_ids: list[int], drafter: Drafter, schedule: Schedule, config: GenerationConfig
) -> Iterator[Chunk]:
    config.validate()
    context = context_limit(target, drafter)
    check_prompt(prompt_ids, target, context)
    eos = set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids)
    sampler = Sampler(config)
    text = TextStream(target.tokenizer, config.stop)
    stats = Stats(mode=drafter.name, prompt_tokens=len(prompt_ids))
    cache = KVCache(target.hf)
    device = cache.device  # the target's: every timing below synchronizes it
    ids = list(prompt_ids)
    parts = drafter_parts(drafter)
    started = clock(device)

    run = schedule.prepare(target, parts, len(prompt_ids), config.greedy, config.max_new_tokens)  # its state
    prefill(cache, ids, stats)
    finish = None
    while finish is None:
        # Draft no more than can be used: the sequence never outgrows the context, and a step emits
        # its accepted tokens plus one, so r tokens still wanted need at most r - 1 draft tokens.
        room = min(context - len(ids), config.max_new_tokens - stats.new_tokens) - 1
        draft, part, draft_s = propose(parts, ids, run, room, sampler, stats, device)
        n = max(0, min(run.trim(draft, part, room), room))
        accepted, token, p, verify_s = verify(cache, ids, draft, n, sampler, stats)
        cache.crop(len(ids) + accepted)  # roll back the rejected draft positions
        drafter.observe(accepted, p)
        run.update(Step(draft, part, n, accepted, token, draft_s, verify_s))
        stats.record_step(n, accepted)

        new = draft.tokens[:accepted] + [token]
        new, finish = apply_stops(new, stats.new_tokens, config, eos, text)
        ids.extend(new)
        stats.new_tokens += len(new)
        if finish is None and len(ids) >= context:
            finish = "context"
        stats.total_s = clock(device) - started
        if finish:
            stats.finish_reason = finish
            drafter.finish(ids)
            stats.notes.update(drafter.report())
            stats.notes.update(run.report())
        yield Chunk(new, text.delta(final=finish is not None), finish, stats)


def drafter_parts(drafter: Drafter) -> list:
    """The drafters to try in order, cheapest first (a `CompositeDrafter` has several; plain decoding none)."""
    if isinstance(drafter, NoDrafter):
        return []
    return list(getattr(drafter, "parts", [drafter]))


def prefill(cache: KVCache, ids: list[int], stats: Stats) -> None:
    """Fill the target cache with every prompt token but the last (the first step feeds that one)."""
    t = clock(cache.device)
    if len(ids) > 1:
        cache.feed(ids[:-1], logits_to_keep=1)
        stats.target_forward_passes += 1
    stats.prefill_s += clock(cache.device) - t


def propose(parts: list, ids: list[int], schedule: ScheduleRun, room: int, sampler: Sampler, stats: Stats,
            device=None):
    """Ask each drafter in turn for as many tokens as the schedule wants; the first non-empty draft wins.

    Returns (draft, name of the drafter that made it or "", that drafter's time, clocked on `device`).
    """
    for part, draft, elapsed in attempts(parts, ids, lambda p: min(schedule.next_k(p), room), sampler,
                                         schedule.min_confidence, device):
        stats.draft_forward_passes += draft.forward_passes
        stats.draft_s += elapsed
        if draft.tokens:
            return draft, part.name, elapsed
    return Draft(), "", 0.0


def verify(cache: KVCache, ids: list[int], draft: Draft, n: int, sampler: Sampler, stats: Stats):
    """One target forward over [last token, d_1..d_n] (the first n draft tokens).

    Returns (accepted draft tokens, next token, p [n+1, vocab] when sampling else None, seconds).
    """
    t = clock(cache.device)
    tokens = draft.tokens[:n]
    logits = cache.feed([ids[-1]] + tokens, logits_to_keep=n + 1)  # [n+1, vocab]
    p = None
    if sampler.greedy:
        accepted, token = verify_greedy(logits, tokens)
    else:
        p = sampler.probs(logits)
        q = None if draft.probs is None else draft.probs[:n]
        accepted, token = verify_speculative(p, q, tokens, sampler)
    elapsed = clock(cache.device) - t
    stats.verify_s += elapsed
    return accepted, token, p, elapsed


def apply_stops(
    new: list[int], generated: int, config: GenerationConfig, eos: set[int], text: TextStream
) -> tuple[list[int], str | None]:
    """Cut this step's tokens at max_new_tokens, the first EOS, or a completed stop string."""
    finish = None
    room = config.max_new_tokens - generated
    if len(new) >= room:
        new, finish = new[:room], "length"
    for i, token in enumerate(new):
        if token in eos:
            new, finish = new[: i + 1], "eos"
            break
    keep = text.add(new)
    if text.stopped:
        new, finish = new[:keep], "stop"
    return new, finish


def context_limit(target: Model, drafter: Drafter) -> int:
    limits = [c for c in (target.context_length, drafter.context_length) if c]
    return min(limits) if limits else 1 << 62


def check_prompt(prompt_ids: list[int], target: Model, context: int) -> None:
    if len(prompt_ids) == 0:
        raise ConfigError("The prompt is empty: give at least one token of text.")
    if len(prompt_ids) >= context:
        raise ConfigError(
            f"The prompt has {len(prompt_ids)} tokens but the context length is {context}: "
            "shorten the prompt so that at least one new token fits."
        )
    vocab = target.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"Prompt token ids {bad[:5]} are outside the model's vocabulary (0..{vocab - 1}).")
