"""The references the tests and benchmarks compare the library with, kept out of the package (the loop never calls
them; benchmarks put this folder on their path to import them).

- `verify_speculative`: speculative sampling for one generation as Leviathan et al. 2023 write it (Algorithm 1),
  composed of `core.sampling`'s pieces, which the loop's `core.verify.verify_all` composes for a whole batch; the
  rule the exact rejection tests enumerate.
- `verify`: one generation's draft judged by the loop's own `verify_all`, as a step judges it (under a grammar too).
- `first_divergence`: checking greedy exactness when floating point differs between one-token and multi-token
  passes. Given two greedy token sequences for the same prompt, it finds the first position where they differ and
  the target's top-2 logit margin there (from one forward pass over the whole prefix in a fresh cache of the model,
  through the backend seam). A divergence at a margin below NEAR_TIE is a floating-point tie, not a wrong
  acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from assistgen.core.sampling import accepted_count, draft_probabilities, stop_distribution
from assistgen.core.verify import Verification, verify_all
from assistgen.spec.sampling import Sampler


def verify_speculative(
    p: torch.Tensor, q: torch.Tensor | None, draft: list[int], sampler: Sampler, rejected: int | None = None
) -> tuple[int, int]:
    """Speculative sampling, Leviathan et al. 2023, Algorithm 1.

    p: [k+1, vocab] target probabilities; q: [k, vocab] draft probabilities (moved to p's device if
    the drafter runs on another one), or None for a drafter without probabilities (then q is one-hot
    on each draft token, which is the same as sampling y ~ p and accepting the draft token only if y
    equals it).
    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    draw the recovered token from norm(max(p_i - q_i, 0)); if all are accepted draw a bonus from p_k, or,
    when `rejected` names a next draft token known to be rejected (p_k gives it 0: a grammar forbids it),
    the recovered token at k from norm(max(p_k - q_k, 0)) (q then has k+1 rows).
    """
    if q is not None:
        q = q.to(p.device)  # the same tensor when it is already there
    p_x, q_x = draft_probabilities(p, q, draft)
    accepted, _ = accepted_count(p_x.tolist(), q_x.tolist(), sampler)
    return accepted, sampler.draw(stop_distribution(p, q, draft, accepted, rejected))


def verify(logits, draft, n: int, sampler: Sampler, forbidden: int | None = None):
    """Judge the first n draft tokens against the target's logits [n+1, vocab] over [last token, d_1..d_n] (one
    generation's `verify_all`); `forbidden`: draft token n + 1, which the grammar rejects (None: none follows, or it
    is not judged).

    Returns (accepted draft tokens, next token, p [n+1, vocab] when sampling else None).
    """
    rows = n + (forbidden is not None)  # q's rows for the judged tokens
    q = None if draft.probs is None or sampler.greedy else draft.probs[:rows]
    verdict = verify_all([Verification(logits, draft.tokens[:n], sampler, q, forbidden)])[0]
    return verdict.accepted, verdict.token, verdict.p


NEAR_TIE = 1e-4


@dataclass
class Divergence:
    position: int  # index into the new tokens
    margin: float  # top-1 minus top-2 logit of the target at that position

    @property
    def near_tie(self) -> bool:
        return self.margin < NEAR_TIE


@torch.inference_mode()
def top2_margin(model, ids: list[int]) -> float:
    top = model.new_cache().feed(ids)[-1].topk(2).values
    return float(top[0] - top[1])


def first_divergence(model, prompt: list[int], a: list[int], b: list[int]) -> Divergence | None:
    """None when one sequence is a prefix of the other (e.g. identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return Divergence(i, top2_margin(model, prompt + a[:i]))
    return None
