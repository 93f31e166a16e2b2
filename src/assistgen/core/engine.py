"""The one generation loop: prefill -> draft -> verify -> accept -> roll back -> emit, over a batch.

Contract: `step(states)` advances every running `GenerationState` (one generation each, made by `begin`)
by one target forward pass over all their rows together (`begin` starts a generation from its request's admission,
`admission.py`: the context, the prompt's check and the grammar, found once): a joining generation's next prompt chunk
(prefill), and for each decoding one its last token plus the draft it verifies (`feed_together` of the
backend seam: each sequence attends only to its own positions). It returns one `Chunk` per generation
(None for one still prefilling). The pass that ends a prompt emits the first token from the prompt's last row, as
plain decoding does, with no draft beside it (`open_with`): the time to the first token is the prefill's.
`stream()` is a generator of `Chunk`s for one generation: the same
`step` over a batch of one, its cache borrowed from and given back to a prefix cache (`prefix.take_for`,
`give_back`). Every way of generating in assistgen (plain decoding, every drafter, the
batch API, the CLI, the server's `serving.batching.BatchEngine`, the benchmarks) goes through `step`;
plain decoding is the loop with a drafter that proposes nothing. The target's cache always holds the
sequence minus its last token (and after a kept alternative, minus that draft's tokens too: `unfed`), so one
verification feeds [last token, d_1 .. d_k] and reads k+1
next-token distributions. Greedy output equals the target's own greedy decoding; sampled output
follows the target's distribution (see `sampling.py`), each generation with its own sampler. How many
of each draft to verify is decided for the whole step by the one optimizer, `gain.lookahead`, from
the schedules' acceptance estimates and the measured cost of the step's rows (`spec.costs.PassCosts`), for
one generation or many alike, so drafting never costs the step more than it brings. A step only reads costs (the
schedules' runs', priced when they were prepared, or the cost book's, `policy.costs.known_costs`): nothing is
measured inside it. The loop sees the
target only through `backends.base` (cache verbs and clock, vocabulary, EOS, context length): it never
knows which library computes the logits. Under a grammar (`config.structure`, `constraint.py`) the loop masks
the target's rows at every verified position, cuts a draft at the first token the grammar forbids (judged as a
rejection there: `constrain`), and, when it speculates, asks the grammar's own drafter first
(`core.grammar`: the continuation the grammar forces). With `config.logprobs` each chunk carries its tokens'
log-probabilities, read from the same rows (`logprobs.py`); with `config.prompt_logprobs` the prefill keeps
every prompt row and the first chunk carries the prompt's. Where the schedule says a pass costs about the
same for more rows (an offloaded target: the run's `alternatives`, `policy.alternatives`), a greedy generation also
verifies other
drafters' drafts in forks of its cache, in the same pass (`core.alternatives`), and keeps the tokens of the one
accepted furthest (`keep_furthest`): still the target's own greedy ones. The forks are dropped, and the
generation's cache is still filled in order (the kept draft's tokens are fed again in the next pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from assistgen.backends.base import Cache, LanguageModel
from assistgen.config import GenerationConfig
from assistgen.core.admission import Admission, admit
from assistgen.core.alternatives import add_alternatives, keep_furthest
from assistgen.core.constraint import Constraint
from assistgen.core.grammar import GrammarDrafter
from assistgen.core.logprobs import token_logprobs
from assistgen.core.plan import Planned, StepPlan
from assistgen.core.prefix import PrefixCache, give_back, take_for
from assistgen.core.processing import active, process_rows
from assistgen.core.state import Chunk, GenerationState
from assistgen.core.text import TextStream
from assistgen.core.verify import Verdict, Verification, verify_all
from assistgen.drafters.base import drafters_of
from assistgen.policy.costs import known_costs
from assistgen.policy.lengths import verified_lengths
from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Drafter, first_draft
from assistgen.spec.sampling import Sampler
from assistgen.spec.steps import Schedule, StepOutcome
from assistgen.stats import Stats


def begin(target: LanguageModel, prompt_ids: list[int], drafter: Drafter, schedule: Schedule,
          config: GenerationConfig, cache: Cache | None = None, admitted: Admission | None = None) -> GenerationState:
    """A generation ready for its first `step` (its prompt not yet fed, or only the part after what `cache`, a cache
    of the target holding a prefix of the prompt, already holds: `prefix.PrefixCache`). `admitted`: the request's
    admission, made for these ids and config (`admission.admit`, e.g. on the thread that queued it); None: admitted
    here, a bad prompt or structure raising ConfigError."""
    if admitted is None:
        admitted = admit(target, prompt_ids, config, drafter.context_length)
    elif drafter.context_length and drafter.context_length < admitted.context:
        raise ValueError(f"begin: the request was admitted for a context of {admitted.context} tokens, but its "
                         f"drafter takes {drafter.context_length}: admit it with the drafter's context")
    if cache is not None and not (len(cache) < len(prompt_ids) and cache.tokens == prompt_ids[: len(cache)]
                                  and config.prompt_logprobs is None):
        raise ValueError("begin: the cache given must hold a proper prefix of the prompt (and no prompt logprobs "
                         "may be asked for: they need every prompt row)")
    drafters = drafters_of(drafter)
    constraint = None if admitted.grammar is None else Constraint.of(admitted.grammar, admitted.eos)
    if constraint is not None and drafters:  # speculating: what the grammar forces is drafted first
        drafters = [GrammarDrafter(constraint)] + drafters
    started = target.clock()
    # (its state; its decisions begin after the prefill's token: the prompt and that token, budget - 1 to go)
    run = schedule.prepare(target, drafters, len(prompt_ids) + 1, config.greedy, config.budget - 1)
    return GenerationState(target, list(prompt_ids), drafter, drafters, run, config, Sampler(config),
                           TextStream(target.tokenizer, config.stop),
                           Stats(mode=drafter.name, prompt_tokens=len(prompt_ids),
                                 cached_tokens=len(cache) if cache is not None else 0,
                                 exact=target.capabilities.exact),
                           set() if config.ignore_eos else set(admitted.eos), admitted.context,
                           cache if cache is not None else target.new_cache(), started, constraint=constraint,
                           ends=admitted.eos)


def stream(
    target: LanguageModel, prompt_ids: list[int], drafter: Drafter, schedule: Schedule, config: GenerationConfig,
    prefix: PrefixCache | None = None, namespace: str | None = None,
) -> Iterator[Chunk]:
    """One generation, chunk by chunk: `step` over a batch of one (the whole prompt fed at once, or what follows the
    longest prefix `prefix` keeps for `namespace`; the generation's cache is given back to it at the end)."""
    admitted = admit(target, prompt_ids, config, drafter.context_length)
    cache = take_for(prefix, prompt_ids, namespace, config)
    try:
        state = begin(target, prompt_ids, drafter, schedule, config, cache, admitted)
    except Exception:
        if cache is not None:
            cache.crop(0)
        raise
    try:
        while state.finish is None:
            chunk = step([state])[0]
            if chunk is not None:
                yield chunk
    finally:
        give_back(prefix, state.cache, namespace)


def step(states: list[GenerationState], prefill_budget: int | None = None) -> list[Chunk | None]:
    """One target forward pass for every generation (all of one target): verification of each decoding one's
    draft, and the next prompt tokens of those still prefilling, at most `prefill_budget` of them in all
    (None: every whole prompt), given to the earliest first, so that joining requests never stall the running
    ones for more than a pass over that many rows. A prefilling generation that gets none waits (its chunk None)."""
    target, clock = states[0].target, states[0].cache.clock
    plan = plan_step(states, prefill_budget)
    feeds = plan.feeds()
    t = clock()
    logits = target.feed_together(feeds)  # per generation [keep, vocab] (decoding, prefilling), then alternatives'
    elapsed = clock() - t
    decoding, prefill = plan.decoding, plan.prefill
    own, other_logits = logits[: len(decoding)], iter(logits[len(decoding) + len(prefill):])
    opening = []  # (generation, its masked row of the prompt's last token): the prefill gave its first token
    for (s, ids), rows in zip(prefill, logits[len(decoding): len(decoding) + len(prefill)], strict=True):
        s.stats.prefill_s += elapsed
        s.stats.target_forward_passes += 1
        if s.config.prompt_logprobs is not None:
            record_prompt_logprobs(s, rows, len(ids))
        if len(s.cache) == len(s.ids):  # the prompt is all in: its last row predicts the first token
            opening.append((s, opening_row(s, rows[-1:])))
    fed, rows_in_all = len(decoding) + len(prefill), sum(len(ids) for _, ids, _ in feeds)
    costs = plan.costs if plan.costs is not None or fed == 1 else known_costs(target)  # (fixed rules only: the
    # target's own costs, as the book holds them, share out the step's time; a step never measures)
    kept = []  # (plan with the kept draft, its rows [verified+1, vocab], the other drafts' outcomes, kept another's)
    for p, rows in zip(decoding, own, strict=True):
        share = elapsed if fed == 1 else elapsed * time_share(p.rows, fed, rows_in_all, costs)
        rows, lost, switched = rows[len(rows) - p.verified - 1:], [], False
        if p.alternatives:
            others = [r[len(r) - len(a.proposal.draft.tokens) - 1:] for a, r in zip(p.alternatives, other_logits,
                                                                                    strict=False)]
            p, rows, lost, switched = keep_furthest(p, rows, others)
        rows = processed(p.state, rows, p.proposal.draft.tokens[: p.verified])
        kept.append((p, rows, share, lost, switched))
    verdicts = verify_all([verification(p, rows) for p, rows, *_ in kept]  # one read to the host for the step
                          + [Verification(rows, [], s.sampler, position=len(s.ids)) for s, rows in opening])
    chunks = {id(p.state): accept(p, rows, verdict, share, lost, switched)
              for (p, rows, share, lost, switched), verdict in zip(kept, verdicts[: len(kept)], strict=True)}
    chunks.update({id(s): open_with(s, rows, verdict)
                   for (s, rows), verdict in zip(opening, verdicts[len(kept):], strict=True)})
    return [chunks.get(id(s)) for s in states]


def plan_step(states: list[GenerationState], prefill_budget: int | None) -> StepPlan:
    """The step's plan, phase by phase: the prompt chunks, each decoding generation's draft, how much of each is
    verified (for the whole step at once), the grammar's cut, then the alternatives verified beside them."""
    decoding = [s for s in states if not s.prefilling]
    prefill = prefill_rows([s for s in states if s.prefilling], prefill_budget)
    planned = [draft_for(s) for s in decoding]
    costs = step_costs(decoding)
    rows = sum(len(r) for r in prefill.values())
    planned = choose_verified(planned, rows, costs)
    planned = [constrain(p) if p.state.constraint is not None else p for p in planned]
    planned = add_alternatives(planned, rows, costs)
    return StepPlan(tuple(planned), tuple((s, prefill[id(s)]) for s in states if prefill.get(id(s))), costs)


PROMPT_ALIGN = 16  # a prompt chunk that does not end the prompt is a multiple of this many rows


def prefill_rows(prefilling: list[GenerationState], budget: int | None) -> dict[int, list[int]]:
    """{id(state): the prompt tokens it feeds this step}, earliest first, `budget` tokens in all (None: no limit).
    The chunk that ends a prompt feeds its last token too, and its last row gives the first token (`open_with`):
    the first token never waits for a draft's verification. Chunks other than a prompt's last are multiples of
    PROMPT_ALIGN rows, so that kernels that take rows in groups (llama.cpp's) group a prompt's rows the same way
    whether it came in one feed or several."""
    rows = {}
    for s in prefilling:
        start, end = len(s.cache), len(s.ids)
        if budget is None or budget >= end - start:
            take = end - start
        else:  # (a budget below PROMPT_ALIGN still feeds the first in line)
            take = budget - budget % PROMPT_ALIGN or (0 if rows else budget)
        if take <= 0:
            break
        rows[id(s)] = s.ids[start : start + take]
        if budget is not None:
            budget -= take
    return rows


def record_prompt_logprobs(s: GenerationState, rows, fed: int) -> None:
    """rows [fed, vocab] of the prompt chunk just fed (it ends at len(cache)): each but the prompt's last predicts
    the prompt's next token."""
    end = len(s.cache)
    following = s.ids[end - fed + 1 : end + 1]  # [fed] ([fed - 1] when the chunk ends the prompt)
    s.prompt_logprobs = (s.prompt_logprobs or []) + token_logprobs(rows[: len(following)], following,
                                                                   s.config.prompt_logprobs, probabilities=False)


def opening_row(s: GenerationState, row):
    """row [1, vocab] of the prompt's last token, processed as plain decoding processes it (`processing`), -inf where
    the grammar forbids the first token."""
    if active(s.config):
        row = process_rows(row, s.config, s.prompt, s.output, [], s.ends)
    if s.constraint is None:
        return row
    s.constraint.check([])  # (no draft: the mask of the first row only)
    return s.constraint.mask(row)


def processed(s: GenerationState, rows, draft: list[int]):
    """A decoding generation's rows [n+1, vocab] (row i after its output and draft[:i]) processed as plain decoding
    processes each position (`processing`), then masked by its grammar."""
    if active(s.config):
        rows = process_rows(rows, s.config, s.prompt, s.output, draft, s.ends)
    return rows if s.constraint is None else s.constraint.mask(rows)


def draft_for(s: GenerationState) -> Planned:
    """The generation's plan with this step's draft: as many tokens as its schedule wants and can be used."""
    room = s.room
    proposal = first_draft(s.drafters, s.ids, lambda d: min(s.run.next_k(d), room), s.sampler, s.run.min_confidence,
                           s.cache.clock)
    s.stats.draft_forward_passes += proposal.forward_passes
    s.stats.draft_s += proposal.total_seconds
    return Planned(s, proposal)


def step_costs(decoding: list[GenerationState]) -> PassCosts | None:
    """What the step is priced with: the first decoding generation's schedule's costs (None: only fixed rules)."""
    return next((s.run.costs for s in decoding if s.run.costs is not None), None)


def choose_verified(planned: list[Planned], prefill_rows: int, costs: PassCosts | None) -> list[Planned]:
    """How many of each draft the step verifies: the most tokens per unit of time for the whole step
    (`lengths.verified_lengths`, over `gain.lookahead`)."""
    chosen = verified_lengths([p.state.run for p in planned], [p.proposal.draft for p in planned],
                              [p.proposal.drafter for p in planned], [p.state.room for p in planned], costs,
                              prefill_rows)
    return [replace(p, verified=n) for p, n in zip(planned, chosen, strict=True)]


def constrain(p: Planned) -> Planned:
    """The verified draft cut at the first token the grammar forbids. That token has probability 0 under the
    masked target, so verifying it would reject it for sure: the loop treats it as that rejection (`forbidden`;
    when sampling, the next token then comes from the residual norm(max(p - q, 0)) at its position, as it would
    have). The number verified was chosen before the cut, from the draft alone, so the cut changes no choice."""
    verified, forbidden = p.state.constraint.check(p.proposal.draft.tokens[: p.verified])
    return replace(p, verified=verified, forbidden=forbidden)


def time_share(mine: int, sequences: int, rows: int, costs: PassCosts | None) -> float:
    """The share of a batched step's time (`sequences` generations, `rows` rows in all) that a generation's `mine`
    rows would have cost alone (for its schedule, which learns the time of a plain step from its steps). Without
    costs (fixed rules on a target never measured; nothing is measured in a step) each row an equal share: only
    the statistics read a fixed rule's time."""
    if costs is None:
        return min(1.0, mine / rows)
    return min(1.0, costs.rows(mine) / costs.batch(sequences, rows))


def verification(p: Planned, logits) -> Verification:
    """What judging the plan's draft needs: the target's rows [verified+1, vocab] (masked), the verified tokens, the
    sampler, the draft's q rows for them (and for the forbidden token after them)."""
    draft, n = p.proposal.draft, p.verified
    rows = n + (p.forbidden is not None)
    q = None if draft.probs is None or p.state.sampler.greedy else draft.probs[:rows]
    return Verification(logits, draft.tokens[:n], p.state.sampler, q, p.forbidden, len(p.state.ids))


def accept(p: Planned, logits, verdict: Verdict, verify_s: float, losers: list[StepOutcome] = (),
           from_alternative: bool = False) -> Chunk:
    """Take the verdict on the plan's draft (the target's logits [verified+1, vocab] it was judged on): roll back,
    update the generation's state, emit; `losers`: the drafts verified beside it and not kept (`keep_furthest`;
    `from_alternative`: the kept one was one of those)."""
    s, n, draft = p.state, p.verified, p.proposal.draft
    accepted, token, probs = verdict.accepted, verdict.token, verdict.p
    s.stats.verify_s += verify_s
    s.cache.crop(min(len(s.cache), len(s.ids) + accepted))  # roll back the rejected draft positions
    s.drafter.observe(accepted, probs)
    s.run.update(StepOutcome(draft, p.proposal.drafter, n, accepted, token, p.proposal.seconds, verify_s,
                             len(losers), sum(o.verified for o in losers), from_alternative))
    for outcome in losers:
        s.run.alternatives.learn(outcome)
    s.stats.record_step(n, accepted)
    return emit(s, draft.tokens[:accepted] + [token], logits if probs is None else probs, probs is not None)


def open_with(s: GenerationState, row, verdict: Verdict) -> Chunk:
    """The first token, chosen from the row [1, vocab] of the prompt's last token (masked) in the pass that ended
    the prompt, as plain decoding chooses it. That pass is the prefill's, not a verification step: the statistics
    and the schedule learn nothing from it."""
    return emit(s, [verdict.token], row if verdict.p is None else verdict.p, verdict.p is not None)


def emit(s: GenerationState, new: list[int], rows, probabilities: bool) -> Chunk:
    """The step's tokens `new` (rows [len(new), vocab]: the logits, or the probabilities, each was chosen from),
    cut at the stops, added to the generation, and its chunk."""
    new, finish = apply_stops(new, s.stats.new_tokens, s.config, s.eos, s.text)
    if s.constraint is not None:
        s.constraint.advance(new)
    logprobs = None
    if s.config.logprobs is not None:  # row i chose new[i]
        logprobs = token_logprobs(rows, new, s.config.logprobs, probabilities=probabilities)
    s.ids.extend(new)
    s.stats.new_tokens += len(new)
    if finish is None and len(s.ids) >= s.context:
        finish = "context"
    s.stats.total_s = s.cache.clock() - s.started
    if finish:
        s.finish = finish
        s.stats.finish_reason = finish
        s.drafter.finish(s.ids)
        s.stats.notes.update(s.drafter.report())
        s.stats.notes.update(s.run.report())
    prompt_logprobs = None
    if s.config.prompt_logprobs is not None and s.stats.new_tokens == len(new):  # (the first chunk)
        prompt_logprobs = s.prompt_logprobs or []
    return Chunk(new, s.text.delta(final=finish is not None), finish, s.stats, logprobs, prompt_logprobs)


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
