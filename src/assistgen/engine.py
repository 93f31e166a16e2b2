"""The one generation loop: prefill -> draft -> verify -> accept -> roll back -> emit, over a batch.

Contract: `step(sequences)` advances every running `Sequence` (one generation each, made by `begin`)
by one target forward pass over all their rows together: a joining sequence's next prompt chunk
(prefill), and for each decoding one its last token plus the draft it verifies (`cache.feed_together`:
each sequence attends only to its own positions). It returns one `Chunk` per sequence (None for one
still prefilling). `stream()` is a generator of `Chunk`s for one sequence: the same `step` over a
batch of one. Every way of generating in assistgen (plain decoding, every drafter, the batch API, the
CLI, the server's `batching.BatchEngine`, the benchmarks) goes through `step`; plain decoding is the
loop with a drafter that proposes nothing. The target's KV cache always holds the sequence minus its
last token, so one verification feeds [last token, d_1 .. d_k] and reads k+1 next-token
distributions. Greedy output equals the target's own greedy decoding; sampled output follows the
target's distribution (see `sampling.py`), each sequence with its own sampler. With several
sequences, how many of each draft to verify is chosen for the whole step from the target's measured
cost for the step's total rows (`gain.batch_lookahead`), so drafting never costs the batch more than
it brings. Every figure the loop times (prefill, drafting, verification, the total) is read with
`timing.clock` on the target's device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from assistgen.cache import KVCache, feed_together
from assistgen.config import ConfigError, GenerationConfig
from assistgen.costs import PassCosts, pass_costs
from assistgen.drafters import Draft, Drafter, NoDrafter, attempts
from assistgen.gain import batch_lookahead
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
    finish_reason: str | None = None  # set on the last chunk: length | eos | stop | context (| cancelled | error)
    stats: Stats | None = None  # the generation's statistics, live; final on the last chunk


@dataclass
class Sequence:
    """One generation's state between steps: its ids, cache, drafter, schedule run, sampler and statistics."""

    target: Model
    ids: list[int]  # prompt + emitted tokens
    drafter: Drafter
    parts: list  # the drafters to try, cheapest first
    run: ScheduleRun
    config: GenerationConfig
    sampler: Sampler
    text: TextStream
    stats: Stats
    eos: set[int]
    context: int  # the longest the sequence may grow
    cache: KVCache
    started: float
    finish: str | None = None
    # this step's draft, filled by `draft_for`
    draft: Draft = field(default_factory=Draft)
    part: str = ""
    draft_s: float = 0.0
    verified: int = 0

    @property
    def prefilling(self) -> bool:
        return len(self.cache) < len(self.ids) - 1


def begin(target: Model, prompt_ids: list[int], drafter: Drafter, schedule: Schedule,
          config: GenerationConfig) -> Sequence:
    """A generation ready for its first `step` (its prompt not yet fed); bad settings or prompts raise ConfigError."""
    config.validate()
    context = context_limit(target, drafter)
    check_prompt(prompt_ids, target, context)
    eos = set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids)
    cache = KVCache(target.hf)
    parts = drafter_parts(drafter)
    started = clock(cache.device)
    run = schedule.prepare(target, parts, len(prompt_ids), config.greedy, config.max_new_tokens)  # its state
    return Sequence(target, list(prompt_ids), drafter, parts, run, config, Sampler(config),
                    TextStream(target.tokenizer, config.stop), Stats(mode=drafter.name, prompt_tokens=len(prompt_ids)),
                    eos, context, cache, started)


def stream(
    target: Model, prompt_ids: list[int], drafter: Drafter, schedule: Schedule, config: GenerationConfig
) -> Iterator[Chunk]:
    """One generation, chunk by chunk: `step` over a batch of one (the whole prompt fed at once)."""
    sequence = begin(target, prompt_ids, drafter, schedule, config)
    while sequence.finish is None:
        chunk = step([sequence])[0]
        if chunk is not None:
            yield chunk


def step(sequences: list[Sequence], prefill_budget: int | None = None,
         costs: PassCosts | None = None) -> list[Chunk | None]:
    """One target forward pass for every sequence (all of one target): verification of each decoding sequence's
    draft, and the next prompt tokens of the sequences still prefilling, at most `prefill_budget` of them in all
    (None: every whole prompt), given to the earliest first, so that joining requests never stall the running
    ones for more than a pass over that many rows. A prefilling sequence that gets none waits (its chunk None).
    `costs`: the target's `PassCosts` for a batch, read once by a caller that steps many times (reading them
    re-derives the model's fingerprint, about 1.5 ms); None reads them here when there is more than one sequence."""
    device = sequences[0].cache.device
    decoding = [s for s in sequences if not s.prefilling]
    prefill_rows = prefill_plan([s for s in sequences if s.prefilling], prefill_budget)
    for s in decoding:
        draft_for(s)
    if len(sequences) > 1:
        costs = costs or pass_costs(sequences[0].target)
        share_rows(decoding, sum(len(r) for r in prefill_rows.values()), costs)
    fed = decoding + [s for s in sequences if prefill_rows.get(id(s))]
    feeds = [(s.cache, [s.ids[-1]] + s.draft.tokens[: s.verified], s.verified + 1) for s in decoding]
    feeds += [(s.cache, prefill_rows[id(s)], 1) for s in fed[len(decoding):]]
    t = clock(device)
    logits = feed_together(feeds)  # per sequence [keep, vocab]
    elapsed = clock(device) - t
    rows_in_all = sum(len(ids) for _, ids, _ in feeds)
    chunks: dict[int, Chunk] = {}
    for s, rows in zip(fed, logits, strict=True):
        if id(s) in prefill_rows:  # (it may have just finished its prompt)
            s.stats.prefill_s += elapsed
            s.stats.target_forward_passes += 1
        else:
            share = elapsed if len(fed) == 1 else elapsed * batch_share(s, len(fed), rows_in_all, costs)
            chunks[id(s)] = accept(s, rows, share)
    return [chunks.get(id(s)) for s in sequences]


def prefill_plan(prefilling: list[Sequence], budget: int | None) -> dict[int, list[int]]:
    """{id(sequence): the prompt tokens it feeds this step}, earliest first, `budget` tokens in all (None: no limit).
    The cache always ends one short of the sequence."""
    plan = {}
    for s in prefilling:
        start, end = len(s.cache), len(s.ids) - 1
        take = end - start if budget is None else min(end - start, budget)
        if take <= 0:
            break
        plan[id(s)] = s.ids[start : start + take]
        if budget is not None:
            budget -= take
    return plan


def draft_for(s: Sequence) -> None:
    """Ask the sequence's drafters for this step's draft and let its schedule say how much of it to verify."""
    # Draft no more than can be used: the sequence never outgrows the context, and a step emits
    # its accepted tokens plus one, so r tokens still wanted need at most r - 1 draft tokens.
    room = min(s.context - len(s.ids), s.config.max_new_tokens - s.stats.new_tokens) - 1
    s.draft, s.part, s.draft_s = propose(s.parts, s.ids, s.run, room, s.sampler, s.stats, s.cache.device)
    s.verified = max(0, min(s.run.trim(s.draft, s.part, room), room))


def share_rows(decoding: list[Sequence], other_rows: int, costs: PassCosts) -> None:
    """Cut the sequences' verified drafts so that the whole step emits the most tokens per unit of time, given the
    target's measured cost of a batched pass (`costs.PassCosts.batch`; `other_rows`: prefill rows already in it).
    A schedule without acceptance estimates (a fixed rule) keeps its length."""
    if not any(s.verified for s in decoding):
        return
    rates = [s.run.rates(s.draft, s.part) if s.verified else None for s in decoding]
    limits = [s.verified for s in decoding]
    fixed = sum(0 if r is not None else n for r, n in zip(rates, limits, strict=True))
    sequences, base = len(decoding) + (1 if other_rows else 0), len(decoding) + other_rows
    chosen = batch_lookahead([r for r in rates if r is not None],
                             [n for r, n in zip(rates, limits, strict=True) if r is not None],
                             lambda rows: costs.batch(sequences, base, rows - base), base + fixed)
    it = iter(chosen)
    for s, r in zip(decoding, rates, strict=True):
        if r is not None:
            s.verified = next(it)


def batch_share(s: Sequence, sequences: int, rows: int, costs: PassCosts) -> float:
    """The share of a batched step's time (`sequences` sequences, `rows` rows in all) that the sequence's rows would
    have cost alone (for its schedule, which learns the time of a plain step from its steps)."""
    return min(1.0, costs.rows(s.verified + 1) / costs.batch(sequences, rows))


def accept(s: Sequence, logits, verify_s: float) -> Chunk:
    """Verify the sequence's draft against the target's logits [verified+1, vocab], roll back, emit."""
    n = s.verified
    accepted, token, p = verify(logits, s.draft, n, s.sampler)
    s.stats.verify_s += verify_s
    s.cache.crop(len(s.ids) + accepted)  # roll back the rejected draft positions
    s.drafter.observe(accepted, p)
    s.run.update(Step(s.draft, s.part, n, accepted, token, s.draft_s, verify_s))
    s.stats.record_step(n, accepted)

    new = s.draft.tokens[:accepted] + [token]
    new, finish = apply_stops(new, s.stats.new_tokens, s.config, s.eos, s.text)
    s.ids.extend(new)
    s.stats.new_tokens += len(new)
    if finish is None and len(s.ids) >= s.context:
        finish = "context"
    s.stats.total_s = clock(s.cache.device) - s.started
    if finish:
        s.finish = finish
        s.stats.finish_reason = finish
        s.drafter.finish(s.ids)
        s.stats.notes.update(s.drafter.report())
        s.stats.notes.update(s.run.report())
    return Chunk(new, s.text.delta(final=finish is not None), finish, s.stats)


def drafter_parts(drafter: Drafter) -> list:
    """The drafters to try in order, cheapest first (a `CompositeDrafter` has several; plain decoding none)."""
    if isinstance(drafter, NoDrafter):
        return []
    return list(getattr(drafter, "parts", [drafter]))


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


def verify(logits, draft: Draft, n: int, sampler: Sampler):
    """Judge the first n draft tokens against the target's logits [n+1, vocab] over [last token, d_1..d_n].

    Returns (accepted draft tokens, next token, p [n+1, vocab] when sampling else None).
    """
    tokens = draft.tokens[:n]
    if sampler.greedy:
        accepted, token = verify_greedy(logits, tokens)
        return accepted, token, None
    p = sampler.probs(logits)
    q = None if draft.probs is None else draft.probs[:n]
    accepted, token = verify_speculative(p, q, tokens, sampler)
    return accepted, token, p


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
