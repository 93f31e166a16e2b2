"""Prompt lookup (Saxena 2023): find the last n-gram earlier in the context, propose what followed.

Contract: `PromptLookupDrafter` runs no model and proposes token ids without probabilities; n goes from
`max_ngram` down to `min_ngram` and the most recent earlier match wins (`lookup_continuation`). Each
draft names its source by the n that matched ("lookup:3"), so acceptance is tracked per match length.
"""

from __future__ import annotations

import numpy as np

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        tokens, n = lookup_continuation(ids, k, self.max_ngram, self.min_ngram)
        return Draft(tokens=tokens, source=f"lookup:{n}")


def lookup_continuation(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of ids' last n-gram, and that n (0: none)."""
    if k <= 0:
        return [], 0
    seq = np.asarray(ids, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        pattern = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len-n, n], starts before the tail
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist(), n
    return [], 0
