"""The log-probabilities of emitted tokens, read from the target's own rows.

Contract: `token_logprobs(rows, tokens, top)` takes the distributions the loop chose `tokens` from, one row
per token ([n, vocab]: the target's verification rows, never a drafter's), and returns one `TokenLogprob`
per token: its log-probability and the `top` most likely tokens with theirs. Greedy rows are the target's
logits (masked by the grammar when one constrains the output): their log-softmax. Sampled rows are the
processed probabilities p (temperature, top-k, top-p, grammar) that the token was drawn from, as vLLM
reports them: their log. A token outside the processed distribution has log-probability -inf, reported as
`FLOOR` (JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0  # the log-probability reported for a token of probability 0 (vLLM's value)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position, most likely first


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int, probabilities: bool) -> list[TokenLogprob]:
    """rows [>= n, vocab] (logits, or probabilities when `probabilities`), tokens [n] -> n TokenLogprobs."""
    rows = rows[: len(tokens)].float()
    logp = torch.log(rows) if probabilities else torch.log_softmax(rows, dim=-1)  # [n, vocab]
    logp = logp.clamp_min(FLOOR)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [n]
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [n, top]
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(tokens, chosen, tops, strict=True)]
