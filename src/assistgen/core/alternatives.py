"""Alternatives in the loop: other drafters' drafts verified beside a generation's own, in forks of its cache.

Contract: where a generation's schedule run carries the alternatives extension (`ScheduleRun.alternatives`, a
`policy.alternatives.AlternativesRun`: greedy, an offloaded target), `add_alternatives` asks the drafters after the
one that drafted for alternative drafts and forks the generation's cache for those worth verifying in the step's
pass (the plans it returns carry them); after the pass, `keep_furthest` keeps the draft the target accepted
furthest (the target's own greedy tokens whichever wins). Runs without the extension are left alone:
the step is then what it is without alternatives.
"""

from __future__ import annotations

from dataclasses import replace

from assistgen.backends.base import shared_prefix
from assistgen.core.plan import Alternative, Planned
from assistgen.core.sampling import verify_greedy
from assistgen.policy.alternatives import StepPricing
from assistgen.policy.gain import alternative_gain, merged_reach
from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Draft, Proposal
from assistgen.spec.steps import StepOutcome


def add_alternatives(decoding: list[Planned], prefill_rows: int, costs: PassCosts | None) -> list[Planned]:
    """The plans with the alternative drafts worth verifying in this pass, from the drafters after the one that
    drafted (and those not asked), each in a fork of its generation's cache: as many tokens as the schedule says
    raise the step's expected tokens per unit of time (`AlternativesRun.k` before drafting, `length` after), at
    most `Adaptive.alternatives` of them. Greedy generations without a grammar only; none when a fork cannot be made
    (the backend's sequences are all in use)."""
    if costs is None or all(p.state.run.alternatives is None for p in decoding):
        return decoding
    bests = [p.state.run.alternatives.reach(p.proposal.draft, p.proposal.drafter, p.verified)
             if p.state.run.alternatives is not None else [] for p in decoding]
    # (each generation emits the target's own token and its draft's expected accepted ones)
    plan = StepPricing(costs, len(decoding) + (1 if prefill_rows else 0), len(decoding) + prefill_rows,
                    sum(p.verified for p in decoding), sum(1.0 + sum(best) for best in bests))
    return [replace(p, alternatives=find_alternatives(p, best, plan))
            if p.state.run.alternatives is not None and p.state.config.greedy and p.state.constraint is None else p
            for p, best in zip(decoding, bests, strict=True)]


def find_alternatives(planned: Planned, best: list[float], plan: StepPricing) -> tuple[Alternative, ...]:
    """`add_alternatives` for one generation; best[i-1]: the chance its own draft's accepted run reaches i tokens."""
    s, proposal = planned.state, planned.proposal
    verified, alternatives, found = [proposal.draft.tokens[: planned.verified]], s.run.alternatives, []
    for drafter in s.drafters:
        if drafter.name == proposal.drafter or drafter.name in proposal.empty:
            continue
        k = alternatives.k(drafter, best, plan, s.room, len(found))
        if k <= 0:
            continue
        start = s.cache.clock()
        draft = drafter.propose(s.ids, k, s.sampler, s.run.min_confidence)
        seconds = s.cache.clock() - start
        s.stats.draft_forward_passes += draft.forward_passes
        s.stats.draft_s += seconds
        shared = max(shared_prefix(tokens, draft.tokens) for tokens in verified)
        n = alternatives.length(draft, drafter.name, best, shared, plan)
        if n <= 0:
            continue
        try:
            fork = s.cache.fork()
        except ValueError:  # (no sequence left for it on the backend: verify without it)
            break
        draft = Draft(draft.tokens[:n], None, draft.forward_passes, draft.source or drafter.name)
        found.append(Alternative(Proposal(draft, drafter.name, seconds, seconds, draft.forward_passes), fork))
        verified.append(draft.tokens)
        other = alternatives.reach(draft, drafter.name, n)
        plan.add(alternative_gain(best, other, shared), n)
        best = merged_reach(best, other, shared)
    return tuple(found)


def keep_furthest(planned: Planned, logits, others: list) -> tuple[Planned, object, list[StepOutcome], bool]:
    """Of the generation's draft and its alternatives (verified in the same pass: `logits` [verified+1, vocab] and each
    alternative's), keep the one whose draft the target accepts furthest (ties: the generation's own). Returns the
    plan with the kept proposal (and no alternatives left), its logits, the others' outcomes (their acceptance is
    learnt by the schedule after the step) and whether the kept one was an alternative. The generation keeps its own
    cache, and the forks are dropped: an alternative's accepted tokens are fed again in the next pass (`unfed`), so
    that the cache holds every token in the order it was written, as when fed alone (llama.cpp's attention sums over
    its cells in their order, and a fork's cells lie after the sequence's own draft cells, which are given back)."""
    s = planned.state
    candidates = [(planned.proposal, planned.verified, logits)]
    candidates += [(a.proposal, len(a.proposal.draft.tokens), rows) for a, rows in zip(planned.alternatives, others,
                                                                                        strict=True)]
    judged = [verify_greedy(rows, p.draft.tokens[:n]) for p, n, rows in candidates]
    kept = max(range(len(candidates)), key=lambda i: (judged[i][0], -i))
    losers = [StepOutcome(p.draft, p.drafter, n, judged[i][0], judged[i][1], p.seconds)
              for i, (p, n, _) in enumerate(candidates) if i != kept]
    if kept:  # the cache keeps what it shares with the kept tokens
        s.cache.crop(len(s.ids) + shared_prefix(planned.proposal.draft.tokens[: planned.verified],
                                                candidates[kept][0].draft.tokens[: judged[kept][0]]))
    proposal, verified, logits = candidates[kept]
    return replace(planned, proposal=proposal, verified=verified, alternatives=()), logits, losers, kept > 0
