"""Prefix reuse across generations: the caches of finished generations, kept so that the next ones feed only what
is new.

Contract: `PrefixCache(model, capacity, max_entries)` keeps target caches (`backends.base.Cache`) of `model` whose
generations have finished, each under a namespace: an entry serves only generations of its own namespace (a server
passes one per API key, so that a conversation's keys and values never reach another key's request unless the
operator shares one namespace). `capacity` bounds the bytes the kept caches hold (`Cache.nbytes()`) and
`max_entries` their number; past either, the least recently used entries are dropped (their memory given back).
`take(ids, namespace, public)` returns a cache holding the longest kept prefix of `ids` (at most len(ids) - 1
tokens: the loop feeds at least the last one) and removes its entry, or forks it when the request shares only part of
it or the backend's forks share their parent's rows (`Capabilities.shared_forks`: llama.cpp), so that the entry
still serves the others that share it (requests of one conversation sent again while the first still runs); None
when nothing kept shares a token with `ids` or the entry's namespace differs. The generation's cache, given back,
supersedes the entry it extends. `give(cache, namespace, public)` keeps a finished generation's cache (its `tokens` are
what its keys and values were computed from, whatever was emitted). `public`: how many of the prompt's first tokens
came from no one's content (`chat.templates.template_prefix`: a chat template's default system prompt); `give` also
keeps those tokens' rows once under `PUBLIC`, and `take` reuses a `PUBLIC` entry up to `public` tokens for any
namespace, `NOBODY` (a request that keeps nothing of its own) included: every conversation shares its template's
opening, as llama-server's slots and vLLM's prefix cache do, and nothing a request sent reaches another namespace.
`take_for` and `give_back` are the one place a generation borrows and returns a cache (the engine's `stream` and the
serving engine both use them): nothing is borrowed when prompt logprobs are asked for (they need every prompt row),
and without a prefix cache the rows are given back at once. A cache's keys and values depend only on its tokens (on
llama.cpp's row-exact build: prompts computed on the row-exact kernels, `LlamaSettings.exact_prompts`), so a
generation continued from a kept prefix computes what it computes from an empty cache. Counters follow vLLM's
prefix-cache metrics: `queries` (prompt tokens looked up), `hits` (tokens found), `evictions`. Not thread-safe:
the serving engine's thread or a single caller owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from assistgen.backends.base import Cache, LanguageModel, shared_prefix
from assistgen.config import DEFAULT_PREFIX_CACHE, ConfigError, GenerationConfig

PUBLIC = "\0public"  # the namespace of template-only prefixes: no key's namespace ("api-key:...", "shared") is it
NOBODY = "\0nobody"  # a request's namespace that keeps nothing of its own: it shares only `PUBLIC` prefixes


@dataclass
class Entry:
    cache: Cache
    namespace: str | None
    nbytes: int


@dataclass
class PrefixCache:
    model: LanguageModel
    capacity: int  # bytes the kept caches may hold
    max_entries: int | None = None  # None: only the bytes bound
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # least recently used first
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them, found in a kept cache
    evictions: int = 0
    kept_bytes: int = 0  # what the entries hold now
    _next: int = 0

    def __post_init__(self):
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError(f"The prefix cache's capacity must be a number of bytes >= 0, got {self.capacity!r}.")

    def take(self, ids: list[int], namespace: str | None = None, public: int = 0) -> Cache | None:
        """A cache holding the longest kept prefix of `ids` (cut to at most len(ids) - 1 tokens), or None: from the
        namespace's entries, or its first `public` tokens from a `PUBLIC` entry."""
        self.queries += len(ids)
        best, length = None, 0
        for key, entry in self.entries.items():
            reach = len(ids) - 1 if entry.namespace == namespace else \
                min(public, len(ids) - 1) if entry.namespace == PUBLIC else 0
            n = min(shared_prefix(entry.cache.tokens, ids), reach)
            if n > length:
                best, length = key, n
        if best is None:
            return None
        entry = self.entries[best]
        cache = None
        if length < len(entry.cache.tokens) or entry.namespace == PUBLIC or self.model.capabilities.shared_forks:
            cache = fork_or_none(entry.cache)  # it may serve others (the same conversation sent again before this
            # one ends: N copies of one client): a fork, cut, where a fork copies nothing or the entry is not all used
        if cache is None:  # (the whole entry, or no sequence left on the backend to fork into: hand it over)
            cache = self._remove(best)
        else:
            self.entries.move_to_end(best)
        cache.crop(length)
        self.hits += length
        return cache

    def give(self, cache: Cache, namespace: str | None = None, public: int = 0) -> None:
        """Keep a finished generation's cache for `namespace` (`NOBODY`: nothing but its public part) and its first
        `public` tokens under `PUBLIC` unless a public entry holds them already (dropping the least recently used
        entries past the bounds)."""
        public = min(public, len(cache))
        part = None  # the cache that will hold the public tokens' rows
        if public and not any(entry.namespace == PUBLIC and shared_prefix(cache.tokens[:public], entry.cache.tokens)
                              == public for entry in self.entries.values()):  # (not when one holds these already)
            part = cache if namespace == NOBODY else fork_or_none(cache)
        if namespace != NOBODY:
            self._keep(cache, namespace)
        elif part is not cache:
            cache.crop(0)
        if part is not None:
            part.crop(public)
            self._keep(part, PUBLIC)

    def _keep(self, cache: Cache, namespace: str | None) -> None:
        nbytes = cache.nbytes()
        if not len(cache) or nbytes > self.capacity:
            cache.crop(0)
            return
        for key, entry in list(self.entries.items()):  # a kept prefix of this one is superseded by it
            if entry.namespace == namespace and shared_prefix(entry.cache.tokens, cache.tokens) == len(entry.cache):
                self._remove(key).crop(0)
        self.entries[self._next] = Entry(cache, namespace, nbytes)
        self.kept_bytes += nbytes
        self._next += 1
        self.make_room(0)

    def make_room(self, nbytes: int, entries: int = 0) -> None:
        """Drop the least recently used entries until `nbytes` more bytes and `entries` more entries fit."""
        while self.entries and (self.kept_bytes + nbytes > self.capacity or (
                self.max_entries is not None and len(self.entries) + entries > self.max_entries)):
            self._remove(next(iter(self.entries))).crop(0)
            self.evictions += 1

    def clear(self) -> None:
        while self.entries:
            self._remove(next(iter(self.entries))).crop(0)

    def _remove(self, key: int) -> Cache:
        entry = self.entries.pop(key)
        self.kept_bytes -= entry.nbytes
        return entry.cache


def fork_or_none(cache: Cache) -> Cache | None:
    """A fork of `cache`, or None where the backend has no sequence left to fork into."""
    try:
        return cache.fork()
    except ValueError:
        return None


def take_for(prefix: PrefixCache | None, ids: list[int], namespace: str | None,
             config: GenerationConfig, public: int = 0) -> Cache | None:
    """The cache a generation of `ids` starts from: the longest prefix `prefix` keeps for `namespace`, or its `public`
    part (None: no prefix cache, nothing kept, or prompt logprobs asked for: they need every prompt row fed)."""
    if prefix is None or config.prompt_logprobs is not None:
        return None
    return prefix.take(ids, namespace, public)


def give_back(prefix: PrefixCache | None, cache: Cache, namespace: str | None, public: int = 0) -> None:
    """A finished generation's cache: kept in `prefix` for its namespace's next generations (and its `public` part
    for everyone's), or (no prefix cache) its rows given back now, not when it is garbage collected (on llama.cpp its
    cells and sequence id go back to the pool)."""
    if prefix is None:
        cache.crop(0)
    else:
        prefix.give(cache, namespace, public)


def default_capacity(model: LanguageModel) -> int:
    """config.DEFAULT_PREFIX_CACHE, or one sequence of the model's full context where that is more."""
    return max(DEFAULT_PREFIX_CACHE, sequence_bytes(model))


def sequence_bytes(model: LanguageModel) -> int:
    """The keys and values of one sequence as long as the model's context."""
    return (model.context_length or 0) * model.kv_bytes_per_token


def check_capacity(model: LanguageModel, capacity: int) -> None:
    """Refuse a prefix cache that cannot hold one sequence of the model's full context."""
    needed = sequence_bytes(model)
    if 0 < capacity < needed:
        raise ConfigError(
            f"A prefix cache of {capacity / 2**20:.0f} MiB cannot hold one sequence of {model.name}'s context "
            f"({model.context_length} tokens x {model.kv_bytes_per_token} bytes of keys and values = "
            f"{needed / 2**20:.0f} MiB): give at least {-(-needed // 2**20)}MB (--prefix-cache), or 0 to keep none.")
