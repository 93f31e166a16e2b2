"""Predicted Outputs: drafting from text the caller expects the output to repeat (OpenAI's `prediction`).

Contract: `PredictionDrafter(Prediction(tokens, prompt_length))` runs no model and proposes token ids without
probabilities: the continuation of the predicted tokens from where the output lines up with them
(`aligned_continuation`). Before the output has a token the draft is the prediction's start; after, it is what
follows the occurrence in the prediction of the output's longest tail (at most `max_depth` tokens), among equally
long ones the first at or after the cursor (else the nearest before it), where the last draft began; past the
output's first token a draft needs at least `CONFIRM` tokens lined up (one common token, a newline, is no evidence
of where the output is): after an insertion the
output's tail lines up again as soon as it repeats predicted text, after a deletion at the next predicted text it
writes. Only the output is aligned, never the prompt (which often holds the same text). Each draft names its source
by the matched length in powers of two ("prediction:0" at the start, "prediction:8" for 8..15 tokens), so that the
policy learns acceptance per match length. `acceptance_prior` is high: the caller vouches for the text.
`prediction_usage(predicted, output)` counts the predicted tokens that appear in the output, in order (difflib's
matching blocks over token ids), and those that do not: OpenAI's `accepted_prediction_tokens` and
`rejected_prediction_tokens`, the same whatever was drafted.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

PRIOR = 0.8  # the acceptance assumed before any draft from a prediction is verified
CONFIRM = 2  # the output's last tokens that must line up with the prediction to move the cursor there


@dataclass(frozen=True)
class Prediction:
    """The predicted output as token ids, and where the output begins in the sequences the drafter is shown."""

    tokens: tuple[int, ...]
    prompt_length: int


class PredictionDrafter(Drafter):
    name = "prediction"
    context_length = None
    model = None
    acceptance_prior = PRIOR

    def __init__(self, prediction: Prediction, max_depth: int = 32):
        self.prediction = prediction
        self.tokens = np.asarray(prediction.tokens, dtype=np.int64)  # [p]
        self.max_depth = max_depth
        self.cursor = 0  # where in the prediction the output was last seen to line up

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        output = np.asarray(ids[self.prediction.prompt_length:], dtype=np.int64)  # [o]
        start, matched = aligned_continuation(self.tokens, output, self.cursor, self.max_depth)
        if start is None or start >= len(self.tokens) or k <= 0 or (matched < CONFIRM and len(output) > 1):
            return Draft()  # (past the output's first token, one common token is no evidence: a newline, a brace)
        self.cursor = start
        return Draft(tokens=[int(t) for t in self.tokens[start:start + k]],
                     source=f"prediction:{0 if matched == 0 else 1 << (matched.bit_length() - 1)}")

    def report(self) -> dict:
        return {"prediction_tokens": len(self.tokens)}


def aligned_continuation(predicted: np.ndarray, output: np.ndarray, cursor: int,
                         max_depth: int) -> tuple[int | None, int]:
    """(where in `predicted` [p] the output [o] continues, how many of the output's last tokens line up there);
    (0, 0) for an empty output, (None, 0) when the output's last token occurs nowhere in the prediction. Among
    occurrences with the longest match, the first whose continuation is at or after `cursor`, else the last before."""
    if not len(output):
        return 0, 0
    ends = np.flatnonzero(predicted == output[-1])  # [c] occurrences of the output's last token
    if not len(ends):
        return None, 0
    matched = np.ones(len(ends), dtype=np.int64)  # [c]
    alive = np.ones(len(ends), dtype=bool)
    for depth in range(1, min(max_depth, len(output))):
        before = ends - depth
        alive &= before >= 0
        alive[alive] = predicted[before[alive]] == output[-1 - depth]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    starts = ends[matched == longest] + 1  # [b] in order
    ahead = starts[starts >= cursor]
    return int(ahead[0] if len(ahead) else starts[-1]), longest


def prediction_usage(predicted: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens: those of `predicted` that appear in `output` in order, and the rest."""
    matcher = difflib.SequenceMatcher(None, predicted, output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(predicted) - accepted
