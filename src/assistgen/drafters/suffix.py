"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): the longest earlier match of the
sequence's tail, in this sequence and in earlier ones of its namespace, continued by what most often followed it.

Contract: `SuffixDrafter(history)` runs no model and proposes token ids without probabilities. To propose after a
sequence it finds the longest suffix of it (at most `max_depth` tokens) that occurred before, in the sequence itself
or in any sequence of `history` (a `SuffixHistory`: earlier requests' prompts and outputs of one namespace, e.g. an
API key, bounded in tokens, oldest dropped first), and drafts token by token the continuation most of those
occurrences share (each token the majority of the occurrences that agreed so far; a tie goes to the most recent),
for as long as some occurrence agrees. In a conversation this is the model's own earlier answer and the text the user
pasted, followed from the place where the current text lines up with it longest, not the most recent place a
short n-gram repeats. Each draft names its source by the matched length, in powers of two ("suffix:8" for 8..15
tokens), so that the policy learns acceptance per match length and verifies long drafts where long matches keep
being accepted. `finish(ids)` records the finished sequence into the history. Knows nothing about models or
acceptance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import numpy as np

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

SEPARATOR = -1  # between sequences in the searched text: no match or continuation crosses it


class SuffixHistory:
    """Earlier sequences of one namespace, at most `max_tokens` tokens in all (the oldest dropped first), kept as
    one array searched whole. Locked: the requests of one namespace may run at once."""

    def __init__(self, max_tokens: int = 1 << 18):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"SuffixHistory: max_tokens must be a positive integer, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._sequences: deque[np.ndarray] = deque()
        self._text = np.zeros(0, dtype=np.int64)  # the sequences, each followed by SEPARATOR
        self._lock = threading.Lock()

    def add(self, ids: list[int]) -> None:
        sequence = np.asarray(ids[-self.max_tokens:], dtype=np.int64)
        with self._lock:
            self._sequences.append(sequence)
            while sum(len(s) + 1 for s in self._sequences) > self.max_tokens + 1 and len(self._sequences) > 1:
                self._sequences.popleft()
            self._text = np.concatenate([np.append(s, SEPARATOR) for s in self._sequences])

    def text(self) -> np.ndarray:
        with self._lock:
            return self._text

    def __len__(self) -> int:
        return len(self.text())


MAX_HISTORIES = 8  # namespaces whose history the process keeps (the least recently used beyond that is dropped)
_HISTORIES: OrderedDict[str, SuffixHistory] = OrderedDict()
_HISTORIES_LOCK = threading.Lock()


def history_for(namespace: str) -> SuffixHistory:
    """The process's history of `namespace`: requests share earlier text only when they name the same one."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"a suffix history namespace is a non-empty string, got {namespace!r}")
    with _HISTORIES_LOCK:
        history = _HISTORIES.get(namespace)
        if history is None:
            history = _HISTORIES[namespace] = SuffixHistory()
            if len(_HISTORIES) > MAX_HISTORIES:
                _HISTORIES.popitem(last=False)
        _HISTORIES.move_to_end(namespace)
        return history


class SuffixDrafter(Drafter):
    name = "suffix"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, history: SuffixHistory | None = None, max_depth: int = 32):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"SuffixDrafter: max_depth must be a positive integer, got {max_depth!r}")
        self.history = history
        self.max_depth = max_depth

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        earlier = self.history.text() if self.history is not None else np.zeros(0, dtype=np.int64)
        tokens, matched = suffix_continuation(earlier, np.asarray(ids, dtype=np.int64), k, self.max_depth)
        if not tokens:
            return Draft()
        return Draft(tokens=tokens, source=f"suffix:{1 << (matched.bit_length() - 1)}")

    def finish(self, ids: list[int]) -> None:
        if self.history is not None:
            self.history.add(ids)

    def report(self) -> dict:
        return {"suffix_history_tokens": len(self.history)} if self.history is not None else {}


def suffix_continuation(earlier: np.ndarray, sequence: np.ndarray, k: int, max_depth: int) -> tuple[list[int], int]:
    """Up to k tokens continuing `sequence` [n] after the longest suffix of it (at most max_depth tokens) found in
    `earlier` (sequences separated by SEPARATOR) or earlier in `sequence` itself, and that suffix's length (0: none).

    Each draft token is the one that follows most of the occurrences that agree with the draft so far (ties: the
    most recent occurrence's), until none agrees."""
    if k <= 0 or len(sequence) < 2:
        return [], 0
    text = np.concatenate([earlier, sequence]) if len(earlier) else sequence  # [m]
    end = len(text) - 1  # the tail's last token: occurrences must end before it
    ends = np.flatnonzero(text[:end] == text[end])  # [c] candidate occurrences of the last token
    if not len(ends):
        return [], 0
    matched = np.ones(len(ends), dtype=np.int64)  # [c] how many tokens of the tail each occurrence matches
    alive = np.ones(len(ends), dtype=bool)
    for depth in range(1, min(max_depth, len(sequence))):
        before = ends - depth
        alive &= before >= 0
        alive[alive] = text[before[alive]] == text[end - depth]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    occurrences = ends[matched == longest]  # [o], in order of position
    draft: list[int] = []
    for step in range(1, k + 1):
        at = occurrences + step
        occurrences, at = occurrences[at <= end], at[at <= end]  # (continuations known up to the tail's end)
        following = text[at]
        occurrences, following = occurrences[following != SEPARATOR], following[following != SEPARATOR]
        if not len(occurrences):
            break
        values, counts = np.unique(following, return_counts=True)
        best = values[counts == counts.max()]
        token = best[0] if len(best) == 1 else following[np.isin(following, best)][-1]  # (tie: most recent)
        draft.append(int(token))
        occurrences = occurrences[following == token]
    return draft, (longest if draft else 0)
