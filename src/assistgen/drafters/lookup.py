"""Prompt lookup (Saxena 2023): find the last n-gram earlier in the context, propose what followed.

Contract: `PromptLookupDrafter` runs no model and proposes token ids without probabilities; n goes from
`max_ngram` down to `min_ngram` and the most recent earlier match wins (`lookup_continuation`). Each draft names
its source by how far the match runs (`lookup_draft`): the n that matched, and the tokens before both the match
and the sequence's tail that agree too, up to `RUN_CAP`; past 3 tokens in powers of two ("lookup:3", "lookup:4"
for 4-7, "lookup:8" for 8-15, ...), so that acceptance is tracked apart for a fresh 3-token match and for a copy
that has run for 20 tokens (a long run is far likelier to go on).
"""

from __future__ import annotations

import numpy as np

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

RUN_CAP = 32  # the longest match run a draft's source tells apart (longer ones are named by this bucket)


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
        return lookup_draft(ids, k, self.max_ngram, self.min_ngram)


def lookup_draft(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> Draft:
    """The lookup draft of up to k tokens, its source named by its match's run (`run_bucket`)."""
    tokens, n, start = lookup_match(ids, k, max_ngram, min_ngram)
    if not tokens:
        return Draft(tokens=tokens, source="lookup:0")
    return Draft(tokens=tokens, source=f"lookup:{run_bucket(match_run(ids, start, n))}")


def lookup_continuation(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of ids' last n-gram, and that n (0: none)."""
    tokens, n, _ = lookup_match(ids, k, max_ngram, min_ngram)
    return tokens, n


def lookup_match(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int, int]:
    """`lookup_continuation`'s tokens and n, and where the continuation starts in ids (0 with no match). One pass
    over the sequence finds the earlier occurrences of its last token; the longer n-grams are checked on those
    only."""
    if k <= 0 or len(ids) < 2:
        return [], 0, 0
    seq = np.asarray(ids, dtype=np.int64)
    last = len(seq) - 1
    ends = np.flatnonzero(seq[:-1] == seq[last])  # [hits]: earlier positions holding the last token
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        matched = ends[ends >= n - 1]
        for back in range(1, n):  # the n-gram ending there equals the tail's
            matched = matched[seq[matched - back] == seq[last - back]]
        if len(matched):
            start = int(matched[-1]) + 1
            return seq[start : start + k].tolist(), n, start
    return [], 0, 0


def match_run(ids: list[int], start: int, n: int, cap: int = RUN_CAP) -> int:
    """How many tokens the match that ends just before `start` runs: its n tokens, and those before them that
    equal the ones before the sequence's tail (at most `cap`)."""
    run = n
    while run < cap and start - run - 1 >= 0 and ids[start - run - 1] == ids[len(ids) - run - 1]:
        run += 1
    return run


def run_bucket(run: int) -> int:
    """A match run's bucket: itself up to 3, else the power of two at or below it (4-7: 4, 8-15: 8, ...)."""
    return run if run <= 3 else 1 << (run.bit_length() - 1)
