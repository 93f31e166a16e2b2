"""Verifying a draft against the target: the greedy rule and speculative sampling's rejection rule.

Vocabulary (as in Leviathan et al. 2023 and vLLM's rejection sampler):
- p: the target's distribution at a position, after temperature / top-k / top-p.
- q: the draft's distribution at that position, processed the same way (or none: a drafter such
  as prompt lookup proposes tokens without probabilities; its q is then one-hot on the token).
- accepted tokens: the longest prefix of the draft that the target keeps.
- recovered token: at the first rejection, a token drawn from norm(max(p - q, 0)).
- bonus token: when every draft token is accepted, one more token drawn from p.
Each verification step therefore emits accepted + 1 tokens.

Contract: pure functions of tensors plus the generation's `spec.sampling.Sampler` (temperature, top-k, top-p
and the seeded generators); greedy is its own explicit branch (argmax), never a small temperature. Speculative
sampling (Leviathan et al. 2023, Algorithm 1) is in pieces: the draft tokens' p and q (`draft_probabilities`), the
accepted prefix (`accepted_count`: one uniform per token until the first rejection) and what the next token is drawn
from (`stop_distribution`: the residual at a rejection, else the bonus distribution); `core.verify` puts them
together for a whole batch. Draws
happen on the device of the probabilities given (the target's, for p; q is moved there when a drafter runs
elsewhere). Nothing here knows about models or caches.
"""

from __future__ import annotations

import torch

from assistgen.spec.sampling import Sampler, top_p_filter  # noqa: F401 - re-exported: the sampler the rules draw with


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """Longest prefix of `draft` equal to the target's argmax, plus the target's next token.

    target_logits: [k+1, vocab], row i predicts the token after draft[:i].
    Returns (number of accepted draft tokens, the token the target emits after them).
    """
    choice = target_logits.argmax(dim=-1).tolist()  # [k+1]
    accepted = greedy_accepted(choice, draft)
    return accepted, choice[accepted]


def greedy_accepted(choice: list[int], draft: list[int]) -> int:
    """How many draft tokens equal the target's choices (its argmax per row), from the first."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choice[accepted]:
        accepted += 1
    return accepted


def draft_probabilities(p: torch.Tensor, q: torch.Tensor | None, draft: list[int]):
    """p_i(x_i) and q_i(x_i) of each draft token x_i ([k], [k] on p's device; q None: one-hot, so 1)."""
    rows = torch.arange(len(draft), device=p.device)
    tokens = torch.tensor(draft, dtype=torch.long)
    if p.device.type == "cuda":  # (from pinned memory, queued: the host does not wait for the device)
        tokens = tokens.pin_memory().to(p.device, non_blocking=True)
    else:
        tokens = tokens.to(p.device)
    p_x = p[rows, tokens]
    return p_x, (torch.ones_like(p_x) if q is None else q[rows, tokens])


def accepted_count(p_x: list[float], q_x: list[float], sampler: Sampler) -> tuple[int, bool]:
    """The rule's accepted prefix: draft token i is kept with probability min(1, p_x[i] / q_x[i]), one uniform each,
    until the first rejection. Returns (accepted, whether the stop drew its uniform: False only for a token its
    drafter gave q = 0, rejected without one)."""
    for i, (p_i, q_i) in enumerate(zip(p_x, q_x, strict=True)):
        if not q_i > 0:  # (q = 0, or not a number: rejected without a uniform, as always)
            return i, False
        if not sampler.uniform() < min(1.0, p_i / q_i):
            return i, True
    return len(p_x), True


def stop_distribution(p: torch.Tensor, q: torch.Tensor | None, draft: list[int], at: int,
                      rejected: int | None = None) -> torch.Tensor:
    """What the token after `at` accepted draft tokens is drawn from [vocab]: the residual norm(max(p - q, 0)) at a
    rejection (at < k, or at k when `rejected` names the forbidden next token), else the bonus distribution p_k."""
    k = len(draft)
    if at < k:
        return residual(p[at], None if q is None else q[at], draft[at])
    if rejected is not None:
        return residual(p[k], None if q is None else q[k], rejected)
    return p[k]


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(p - q, 0)) for one position. p, q: [vocab]; q None means one-hot on `token`."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    return torch.where(total > 0, r / total, p)  # (total 0: p == q up to rounding, and any draw from p is exact;
    # chosen on the device, so that nothing waits for it)
