"""A cross-request n-gram cache: what followed each recent n-gram, in every sequence seen so far.

Contract: `NGramCache` maps a tuple of n token ids (min_n <= n <= max_n) to the up to `continuation`
tokens that most recently followed it, in an LRU of at most `max_entries` entries (the least
recently written or looked-up entry is evicted first), so its memory is bounded
(`memory_bound_bytes`). `add(ids, start)` records a sequence, incrementally: the n-grams whose
continuation gained tokens at positions >= start; feeding a growing sequence piece by piece gives
the same cache as adding it whole. An n-gram at the very end of a sequence has no continuation yet
and is not recorded. All methods take a lock, so one cache can serve concurrent requests.
`NGramCacheDrafter` drafts from a cache (by default the process-wide `shared_cache()`): before each
proposal it records what the sequence gained since the last one, so prompts and outputs of every
request end up in the cache, then proposes what followed the sequence's tail the last time. It
proposes token ids only, no probabilities; it knows nothing about models or acceptance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from assistgen.drafters import Draft
from assistgen.sampling import Sampler

# Upper bounds (CPython 3.11+, 64-bit) behind memory_bound_bytes:
TUPLE_BYTES = 64  # tuple header with GC header and allocator rounding, without items
ITEM_BYTES = 8 + 32  # a pointer in a tuple + an int object (28 bytes up to 2**30, 32-byte allocator class)
ENTRY_BYTES = 256  # OrderedDict per entry: dict entry + index slots at low load, ordering node, free slots
FIXED_BYTES = 4096  # the cache object, its lock and an empty OrderedDict


class NGramCache:
    """LRU map: n-gram of token ids (tuple, n in min_n..max_n) -> up to `continuation` tokens that followed it."""

    def __init__(self, max_entries: int = 200_000, min_n: int = 2, max_n: int = 4, continuation: int = 8):
        for name, value in (("max_entries", max_entries), ("min_n", min_n), ("max_n", max_n),
                            ("continuation", continuation)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NGramCache: {name} must be a positive integer, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"NGramCache: need min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_entries, self.min_n, self.max_n, self.continuation = max_entries, min_n, max_n, continuation
        self._entries: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __bool__(self) -> bool:
        return True  # an empty cache is still a cache: `if cache:` asks whether one was given, not whether it is empty

    def add(self, ids: list[int], start: int = 0) -> None:
        """Record `ids`, of which `ids[:start]` were recorded by earlier calls (0: record all of it).

        Rewrites, in order of position, every n-gram ending at p whose continuation ids[p+1 : p+1+c]
        reaches a position >= start.
        """
        if not 0 <= start <= len(ids):
            raise ValueError(f"NGramCache.add: start must be in 0..{len(ids)}, got {start}")
        if start == len(ids):
            return  # nothing new: no continuation changed
        ids = list(ids)
        first = max(start - self.continuation, self.min_n - 1)  # earliest n-gram end whose continuation changed
        with self._lock:
            for end in range(first, len(ids) - 1):
                following = tuple(ids[end + 1 : end + 1 + self.continuation])
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    self._put(tuple(ids[end + 1 - n : end + 1]), following)

    def _put(self, key: tuple[int, ...], following: tuple[int, ...]) -> None:
        self._entries[key] = following
        self._entries.move_to_end(key)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that last followed the longest recorded n-gram ending `ids`, and that n (0: none)."""
        if k <= 0:
            return [], 0
        with self._lock:
            for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
                key = tuple(ids[-n:])
                following = self._entries.get(key)
                if following is not None:
                    self._entries.move_to_end(key)
                    return list(following[:k]), n
        return [], 0

    def items(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(n-gram, continuation) pairs, least recently used first."""
        with self._lock:
            return list(self._entries.items())

    def copy(self) -> NGramCache:
        """An independent cache with the same settings and entries (in the same LRU order)."""
        other = NGramCache(self.max_entries, self.min_n, self.max_n, self.continuation)
        with self._lock:
            other._entries = OrderedDict(self._entries)
        return other

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def memory_bound_bytes(self) -> int:
        """An upper bound on the memory the cache can hold when full: per entry a key tuple of at most
        max_n ints, a value tuple of at most `continuation` ints (every int counted as its own object,
        though most are shared with the caller's lists) and the OrderedDict's own bookkeeping."""
        per_entry = ENTRY_BYTES + 2 * TUPLE_BYTES + (self.max_n + self.continuation) * ITEM_BYTES
        return FIXED_BYTES + self.max_entries * per_entry


_shared: NGramCache | None = None
_shared_lock = threading.Lock()


def shared_cache() -> NGramCache:
    """The process-wide default cache (created on first use), so that requests in one process share it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = NGramCache()
        return _shared


class NGramCacheDrafter:
    """Proposes what followed the sequence's last n-gram in any sequence recorded in the cache (one request's state)."""

    name = "ngram-cache"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, cache: NGramCache | None = None):
        self.cache = cache if cache is not None else shared_cache()
        self.recorded: list[int] = []  # the sequence as last recorded into the cache

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        self.record(ids)
        tokens, n = self.cache.lookup(ids, k)
        return Draft(tokens=tokens, source=f"ngram:{n}") if tokens else Draft()

    def record(self, ids: list[int]) -> None:
        """Add what `ids` has beyond the part it shares with the sequence recorded last (all of it for a new one)."""
        seen = self.recorded
        if len(ids) >= len(seen) and ids[: len(seen)] == seen:
            common = len(seen)  # the usual case: the same generation, a few tokens longer
        else:
            common = shared_prefix(seen, ids)
        if common < len(ids):
            self.cache.add(ids, start=common)
        self.recorded = list(ids)

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        pass  # the next propose() records whatever the target emitted

    def finish(self, ids: list[int]) -> None:
        self.record(ids)  # the last step's tokens, and everything while other drafters were drafting

    def report(self) -> dict:
        return {"ngram_cache_entries": len(self.cache)}


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
