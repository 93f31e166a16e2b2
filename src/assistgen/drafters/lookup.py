"""Prompt lookup (Saxena 2023): find the last n-gram earlier in the context, propose what followed.

Contract: `PromptLookupDrafter` runs no model and proposes token ids without probabilities; n goes from
`max_ngram` down to `min_ngram` and the most recent earlier match wins (`lookup_continuation`). Each
draft names its source by the n that matched ("lookup:3"), so acceptance is tracked per match length. The
draft's `others` are the continuations of other earlier matches that differ from it (older occurrences, shorter
n-grams), at most `others` of them, source "lookup:N~": the generation loop may verify them beside it where rows are
cheap (`engine.add_alternatives`).
"""

from __future__ import annotations

import numpy as np

from assistgen.core.sampling import Sampler
from assistgen.drafters.base import Draft, Drafter


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, others: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.others = max_ngram, min_ngram, others

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        found = lookup_continuations(ids, k, self.max_ngram, self.min_ngram, 1 + self.others)
        if not found:
            return Draft(source="lookup:0")
        (tokens, n), rest = found[0], found[1:]
        return Draft(tokens=tokens, source=f"lookup:{n}",
                     others=[Draft(tokens=t, source=f"lookup:{m}~") for t, m in rest])


def lookup_continuation(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of ids' last n-gram, and that n (0: none)."""
    found = lookup_continuations(ids, k, max_ngram, min_ngram, 1)
    return found[0] if found else ([], 0)


def lookup_continuations(ids: list[int], k: int, max_ngram: int, min_ngram: int,
                         count: int) -> list[tuple[list[int], int]]:
    """Up to `count` different continuations (up to k tokens each, and the n that matched) of earlier occurrences
    of ids' last n-gram: the longest n first, and for each n the most recent occurrence first; a continuation that
    begins another one already found is skipped (verifying it would add nothing)."""
    if k <= 0 or count <= 0:
        return []
    seq = np.asarray(ids, dtype=np.int64)
    found: list[tuple[list[int], int]] = []
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        pattern = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len-n, n], starts before the tail
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        for hit in hits[::-1]:
            start = int(hit) + n
            tokens = seq[start : start + k].tolist()
            if not any(t[: len(tokens)] == tokens for t, _ in found):
                found.append((tokens, n))
                if len(found) == count:
                    return found
    return found
