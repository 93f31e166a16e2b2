"""A cross-request n-gram cache: what followed each recent n-gram, in every sequence seen so far.

Contract: `NGramCache` maps a tuple of n token ids (min_n <= n <= max_n) to the up to `continuation`
tokens that most recently followed it, in an LRU of at most `max_entries` entries (the least
recently written or looked-up entry is evicted first), so its memory is bounded
(`memory_bound_bytes`). `add(ids, start)` records a sequence, incrementally: the n-grams whose
continuation gained tokens at positions >= start; feeding a growing sequence piece by piece gives
the same cache as adding it whole. An n-gram at the very end of a sequence has no continuation yet
and is not recorded. All methods take a lock, so one cache can serve concurrent requests.

Caches are scoped by a namespace, so that one user's text never reaches another's drafts: a
server names one per user (or tenant), and `cache_for(namespace)` returns that namespace's cache
from the process's `NGramCacheRegistry`, which holds at most `MAX_NAMESPACES` caches (the least
recently used namespace is dropped) and so at most `REGISTRY.memory_bound_bytes()` (8 full caches
of the default size: about 1.4 GB; a cache holds about 3 entries per token of text). Text is shared
process-wide only when asked for: the namespace `SHARED_NAMESPACE` (`shared_cache()`, what
`ngram_cache=True` means in the API). `NGramCacheDrafter` drafts from the cache it is given (a new
one of its own when none is): before each proposal it records what the sequence gained since the
last one, so prompts and outputs of every request that uses the cache end up in it, then proposes
what followed the sequence's tail the last time. It proposes token ids only, no probabilities; it
knows nothing about models or acceptance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from assistgen.backends.base import shared_prefix
from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

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


SHARED_NAMESPACE = "shared"  # the namespace of `ngram_cache=True`: every request in the process that asks for it
MAX_NAMESPACES = 8  # namespaces the default registry keeps (the least recently used one beyond that is dropped)


class NGramCacheRegistry:
    """A bounded, locked map from a namespace string (a user, a tenant) to that namespace's `NGramCache`.

    It holds at most `max_namespaces` caches; asking for one more drops the least recently asked-for
    namespace (its text is forgotten; a drafter still using its cache keeps that object until it ends).
    Every cache has the same settings (`cache_settings`: the arguments of `NGramCache`), so the memory
    the registry holds is at most `memory_bound_bytes()`.
    """

    def __init__(self, max_namespaces: int = MAX_NAMESPACES, **cache_settings):
        if isinstance(max_namespaces, bool) or not isinstance(max_namespaces, int) or max_namespaces < 1:
            raise ValueError(f"NGramCacheRegistry: max_namespaces must be a positive integer, got {max_namespaces!r}")
        NGramCache(**cache_settings)  # check the settings now, not at the first request
        self.max_namespaces, self.cache_settings = max_namespaces, dict(cache_settings)
        self._caches: OrderedDict[str, NGramCache] = OrderedDict()
        self._lock = threading.Lock()

    def cache_for(self, namespace: str) -> NGramCache:
        """The cache of `namespace`, created empty on first use."""
        if not isinstance(namespace, str):
            raise TypeError(f"an n-gram cache namespace is a string, got {type(namespace).__name__}")
        with self._lock:
            cache = self._caches.get(namespace)
            if cache is None:
                cache = self._caches[namespace] = NGramCache(**self.cache_settings)
                if len(self._caches) > self.max_namespaces:
                    self._caches.popitem(last=False)
            self._caches.move_to_end(namespace)
            return cache

    def drop(self, namespace: str) -> None:
        """Forget a namespace and its text (nothing happens when it is not held)."""
        with self._lock:
            self._caches.pop(namespace, None)

    def namespaces(self) -> list[str]:
        """The namespaces held, least recently used first."""
        with self._lock:
            return list(self._caches)

    def memory_bound_bytes(self) -> int:
        """An upper bound on the memory of the caches it holds: `max_namespaces` full caches."""
        return self.max_namespaces * NGramCache(**self.cache_settings).memory_bound_bytes()


REGISTRY = NGramCacheRegistry()  # the process's namespaces; a request reaches only the one it names


def cache_for(namespace: str) -> NGramCache:
    """The process's cache for `namespace` (`REGISTRY`): requests share text only when they name the same one."""
    return REGISTRY.cache_for(namespace)


def shared_cache() -> NGramCache:
    """The process-wide cache that `ngram_cache=True` asks for: the namespace `SHARED_NAMESPACE`."""
    return cache_for(SHARED_NAMESPACE)


class NGramCacheDrafter(Drafter):
    """Proposes what followed the sequence's last n-gram in any sequence recorded in the cache (one request's state)."""

    name = "ngram-cache"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, cache: NGramCache | None = None):
        self.cache = cache if cache is not None else NGramCache()  # None: a cache of its own
        self.recorded: list[int] = []  # the sequence as last recorded into the cache

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        self.record(ids)
        tokens, n = self.cache.lookup(ids, k)
        return Draft(tokens=tokens, source=f"ngram:{n}") if tokens else Draft()

    def record(self, ids: list[int]) -> None:
        """Add what `ids` has beyond the part it shares with the sequence recorded last (all of it for a new one)."""
        common = shared_prefix(self.recorded, ids)  # usually all of it: the same generation, a few tokens longer
        if common < len(ids):
            self.cache.add(ids, start=common)
        self.recorded = list(ids)

    def finish(self, ids: list[int]) -> None:
        self.record(ids)  # the last step's tokens, and everything while other drafters were drafting

    def report(self) -> dict:
        return {"ngram_cache_entries": len(self.cache)}

