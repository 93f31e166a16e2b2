"""A step's verification, every generation of the batch at once, with one read from the device to the host.

Contract: `verify_all(jobs)` judges each `Verification` (a generation's rows [n+1, vocab] over [last token, d_1..d_n],
masked by its grammar where it has one; its n draft tokens; its sampler; its draft's q; the forbidden token after
them) by the rules of `sampling.py` and returns a `Verdict` each: accepted draft tokens, the next token, and p
[n+1, vocab] when sampling. Everything a verdict depends on is computed on the device first (each greedy row's
argmax; each sampled draft token's p and q) and read to the host in one transfer (`to_host`), where the acceptance
decisions are taken, drawing the uniforms of the CPU generator in Algorithm 1's order (`accepted_count`). The token
a sampled generation draws where it stops is drawn after that read, from the one position it stopped at, except with
`EAGER` (default: on a device other than the CPU, where each read waits for the device): then a token is drawn
beforehand at every position it could stop at, each from the generator state the lazy draw would have used, and read
with the rest, so that the step reads once; the generators are then left where the lazy draw leaves them, and the
tokens are the same (a draft token with q = 0 at the stop, which draws no uniform, falls back to the lazy draw).
Samplers without generators (the enumerated rejection tests' scripted ones) are judged lazily.
A sampled job whose draft has no probabilities (a copy: lookup, n-gram, suffix, a prediction) is judged by keyed
draws instead (`keyed`): the target's token at each position is the inverse CDF of p at that position's keyed uniform
(`spec.sampling.keyed_uniform`), the draft accepted up to the first token that differs, as greedy verification
takes the argmax. Each token comes from p exactly, as the rejection rule's would (a copied token is kept with
probability p(x) either way), and a seeded generation samples the same tokens whatever was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from assistgen.core.sampling import accepted_count, draft_probabilities, greedy_accepted, stop_distribution
from assistgen.spec.sampling import Sampler, inverse_cdf


@dataclass(frozen=True)
class Verification:
    logits: torch.Tensor  # [n+1, vocab]: row i predicts the token after draft[:i]
    tokens: list[int]  # the n draft tokens judged
    sampler: Sampler
    q: torch.Tensor | None = None  # [n (+1 with forbidden), vocab] the draft's probabilities; None: one-hot
    forbidden: int | None = None  # draft token n+1, which the grammar rejects (None: none is judged)
    position: int | None = None  # the sequence position row 0 predicts (keyed draws); None: not known


@dataclass(frozen=True)
class Verdict:
    accepted: int
    token: int
    p: torch.Tensor | None  # [n+1, vocab] the target's processed probabilities (sampling), None (greedy)


@dataclass
class _Sampled:
    """A sampled job's device-side work: p, and (eager) the tokens drawn beforehand with the generator states."""

    p: torch.Tensor
    q: torch.Tensor | None
    drawn: torch.Tensor | None = None  # [n+1] a token drawn at each position the rule can stop at
    after: list | None = None  # the device generator's state after each of those draws


@dataclass
class _Keyed:
    """A sampled job judged by keyed draws: p, and (eager) the uniforms' tokens at every position."""

    p: torch.Tensor
    uniforms: list[float]
    eager: bool


EAGER: bool | None = None  # draw the stop tokens beforehand; None: on a device other than the CPU


def keyed(job: Verification) -> bool:
    """Whether the job is judged by keyed draws: sampled, its draft copied (q one-hot: a drafter without
    probabilities), its position known, its sampler keyed (the enumerated tests' scripted ones are not)."""
    return job.q is None and job.position is not None and isinstance(getattr(job.sampler, "key", None), int)


def verify_all(jobs: list[Verification]) -> list[Verdict]:
    if not jobs:
        return []
    eager = jobs[0].logits.device.type != "cpu" if EAGER is None else EAGER
    pieces, work = [], []
    for job in jobs:  # device side (on a GPU nothing here waits for it, but the draft ids' upload)
        if job.sampler.greedy:
            pieces.append(job.logits.argmax(dim=-1))  # [n+1]
            work.append(None)
            continue
        p = job.sampler.probs(job.logits)  # [n+1, vocab]
        if keyed(job):  # (the token at each position: the inverse CDF at its keyed uniform)
            sampled = _Keyed(without(p, len(job.tokens), job.forbidden),
                             job.sampler.keyed_uniforms(job.position, len(job.tokens) + 1), eager)
            if eager:
                uniforms = torch.tensor(sampled.uniforms, dtype=torch.float64).to(p.device)
                pieces.append(inverse_cdf(sampled.p, uniforms))
            work.append(sampled)
            continue
        q = None if job.q is None else job.q.to(p.device)
        p_x, q_x = draft_probabilities(p, q, job.tokens)  # [n], [n]
        sampled = _Sampled(p, q)
        pieces += [p_x, q_x]
        if eager and isinstance(getattr(job.sampler, "generator", None), torch.Generator):
            draw_beforehand(sampled, job)
            pieces.append(sampled.drawn)
        work.append(sampled)
    values = to_host(pieces)  # the step's one read
    verdicts, at = [], 0
    for job, sampled in zip(jobs, work, strict=True):  # host side
        n = len(job.tokens)
        if sampled is None:
            choice = [int(v) for v in values[at : at + n + 1]]
            at += n + 1
            accepted = greedy_accepted(choice, job.tokens)
            verdicts.append(Verdict(accepted, choice[accepted], None))
            continue
        if isinstance(sampled, _Keyed):
            if sampled.eager:
                choice = [int(v) for v in values[at : at + n + 1]]
                at += n + 1
            else:
                choice = keyed_choices(sampled, job.tokens)
            accepted = greedy_accepted(choice, job.tokens)
            verdicts.append(Verdict(accepted, choice[accepted], sampled.p))
            continue
        p_x, q_x = values[at : at + n], values[at + n : at + 2 * n]
        at += 2 * n
        accepted, drew = accepted_count(p_x, q_x, job.sampler)
        if sampled.drawn is not None:
            drawn = values[at : at + n + 1]
            at += n + 1
            if drew:  # the token the lazy draw gives, and its generator where that draw leaves it
                job.sampler.generator_for(sampled.p.device).set_state(sampled.after[accepted])
                verdicts.append(Verdict(accepted, int(drawn[accepted]), sampled.p))
                continue
        token = job.sampler.draw(stop_distribution(sampled.p, sampled.q, job.tokens, accepted, job.forbidden))
        verdicts.append(Verdict(accepted, token, sampled.p))
    return verdicts


def without(p: torch.Tensor, row: int, token: int | None) -> torch.Tensor:
    """p [n+1, vocab] with `token` given probability 0 at `row` (a forbidden draft token: the masked target gives it
    none already; judged as the rejection rule judges it); p itself when there is none."""
    if token is None:
        return p
    p = p.clone()
    p[row, token] = 0.0
    return p


def keyed_choices(sampled: _Keyed, draft: list[int]) -> list[int]:
    """The keyed tokens position by position, up to the first that differs from the draft (the rest are never used)."""
    choice = []
    for i, u in enumerate(sampled.uniforms):
        row = sampled.p[i : i + 1]
        choice.append(int(inverse_cdf(row, torch.tensor([u], dtype=torch.float64, device=row.device))[0]))
        if i >= len(draft) or choice[-1] != draft[i]:
            break
    return choice


def draw_beforehand(sampled: _Sampled, job: Verification) -> None:
    """A token at each position a where the rule can stop (a rejection at a < n, or n: the bonus, or the recovered
    token of the forbidden one), each drawn from the state the lazy draw would start from there: the device
    generator as it is (one draw of exponentials then serves every position), or, when it is the CPU generator the
    uniforms also come from, as it is after the a + 1 uniforms drawn up to a rejection at a (n for the stop at n).
    The generators are restored afterwards; `after` holds where each position's draw leaves them."""
    sampler, n = job.sampler, len(job.tokens)
    generator = sampler.generator_for(sampled.p.device)
    start = generator.get_state()
    stops = torch.stack([stop_distribution(sampled.p, sampled.q, job.tokens, a, job.forbidden)
                         for a in range(n + 1)])  # [n+1, vocab]
    if generator is not sampler.generator:  # every position's draw starts from the same state
        sampled.drawn = race(stops, generator)
        sampled.after = [generator.get_state()] * (n + 1)
    else:
        drawn, after = [], []
        for a in range(n + 1):  # after u_0 .. u_a for a rejection at a < n, u_0 .. u_{n-1} for the stop at n
            generator.set_state(start)
            for _ in range(a + (a < n)):
                torch.rand((), generator=generator)  # (one at a time, as `Sampler.uniform` draws them)
            drawn.append(race(stops[a : a + 1], generator))
            after.append(generator.get_state())
        sampled.drawn, sampled.after = torch.cat(drawn), after
    generator.set_state(start)


def race(distributions: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from each row of `distributions` [rows, vocab], all with the same exponentials (one draw from
    `generator`): argmax(p / e), which is what `torch.multinomial(p, 1)` computes for one sample (checked token for
    token and generator state for state: tests/core/test_verify.py), without its checks, which wait for the device."""
    exponentials = torch.empty_like(distributions[0]).exponential_(1, generator=generator)  # [vocab]
    return (distributions / exponentials).argmax(dim=-1)  # [rows]


def to_host(pieces: list[torch.Tensor]) -> list:
    """The one read of a step's verification: the pieces' values, flat, in order (integers as they are when every
    piece holds token ids, as greedy ones do; else as float64, which holds float32 probabilities and token ids
    exactly)."""
    if not pieces:  # (only keyed jobs judged lazily: nothing to read)
        return []
    if len(pieces) == 1 and not pieces[0].is_floating_point():
        return pieces[0].tolist()
    if all(not x.is_floating_point() for x in pieces):
        return torch.cat(pieces).tolist()
    return torch.cat([x.to(torch.float64) for x in pieces]).tolist()
