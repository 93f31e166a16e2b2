"""The cross-request n-gram cache: LRU order, a hard size bound, lookups, incremental recording, drafting."""

from __future__ import annotations

import gc
import random
import threading
import tracemalloc

import pytest
from helpers import encode, hf_greedy, tiny_llama

from assistgen import ConfigError, Constant, generate
from assistgen.drafters.ngram import (
    SHARED_NAMESPACE,
    NGramCache,
    NGramCacheDrafter,
    NGramCacheRegistry,
    cache_for,
    shared_cache,
)


def test_lookup_prefers_the_longest_ngram_and_the_most_recent_continuation():
    cache = NGramCache(min_n=2, max_n=3, continuation=3)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.lookup([9, 2, 3], 5) == ([4, 5, 6], 2)  # only the 2-gram [2, 3] matches
    cache.add([7, 2, 3, 8, 9])
    assert cache.lookup([9, 2, 3], 5) == ([8, 9], 2)  # the most recent continuation of [2, 3] wins
    assert cache.lookup([1, 2, 3], 5) == ([4, 5, 6], 3)  # the 3-gram [1, 2, 3] beats the 2-gram
    assert cache.lookup([1, 2, 3], 2) == ([4, 5], 3)  # at most k tokens
    assert cache.lookup([1, 2, 3], 0) == ([], 0)
    assert cache.lookup([42, 43], 3) == ([], 0)
    assert cache.lookup([3], 3) == ([], 0)  # shorter than min_n


def test_the_last_ngram_of_a_sequence_has_no_continuation_yet():
    cache = NGramCache(min_n=2, max_n=2, continuation=4)
    cache.add([1, 2, 3])
    assert cache.items() == [((1, 2), (3,))]


def test_lru_evicts_the_least_recently_used_entry():
    cache = NGramCache(max_entries=3, min_n=2, max_n=2, continuation=1)
    cache.add([1, 2, 10])  # (1, 2)
    cache.add([3, 4, 10])  # (3, 4)
    cache.add([5, 6, 10])  # (5, 6)
    assert cache.lookup([1, 2], 1) == ([10], 2)  # a hit makes (1, 2) the most recent
    cache.add([7, 8, 10])  # evicts (3, 4), the least recent
    assert [key for key, _ in cache.items()] == [(5, 6), (1, 2), (7, 8)]
    cache.add([5, 6, 11])  # rewriting moves (5, 6) to the end with its new continuation
    cache.add([9, 9, 10])  # evicts (1, 2)
    assert cache.items() == [((7, 8), (10,)), ((5, 6), (11,)), ((9, 9), (10,))]
    assert len(cache) == 3


def test_size_and_memory_stay_bounded():
    rng = random.Random(0)
    cache = NGramCache(max_entries=1000)
    ids: list[int] = []
    while len(ids) < 100_000:
        start = len(ids)
        ids.extend(rng.randrange(262_144) for _ in range(rng.randint(1, 200)))
        cache.add(ids, start)
        assert len(cache) <= 1000
    assert len(cache) == 1000
    bounds = [NGramCache(max_entries=m).memory_bound_bytes() for m in (1000, 2000, 3000)]
    assert bounds[0] == cache.memory_bound_bytes()
    assert bounds[2] - bounds[1] == bounds[1] - bounds[0] > 0  # linear in max_entries
    assert bounds[0] < 1000 * 4096  # a few hundred bytes per entry

    # what a full cache really holds (tokens created inside the measurement) stays under the bound
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        measured = NGramCache(max_entries=1000)
        tokens = [rng.randrange(262_144) for _ in range(20_000)]
        measured.add(tokens)
        del tokens
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(measured) == 1000
    assert used <= measured.memory_bound_bytes()


def test_incremental_add_equals_adding_the_whole_sequence():
    rng = random.Random(1)
    for max_entries in (10_000, 40):  # without and with evictions
        whole = NGramCache(max_entries=max_entries, min_n=1, max_n=3, continuation=4)
        pieces = NGramCache(max_entries=max_entries, min_n=1, max_n=3, continuation=4)
        ids = [rng.randrange(6) for _ in range(500)]  # a small alphabet: n-grams repeat
        whole.add(ids)
        done = 0
        while done < len(ids):
            end = min(len(ids), done + rng.randint(0, 7))
            pieces.add(ids[:end], start=done)
            done = end
        assert pieces.items() == whole.items()


def test_copy_is_independent_and_clear_empties():
    cache = NGramCache(min_n=2, max_n=2)
    cache.add([1, 2, 3, 4])
    other = cache.copy()
    other.add([1, 2, 9])
    cache.add([5, 6, 7])
    assert cache.lookup([1, 2], 4) == ([3, 4], 2) and other.lookup([1, 2], 4) == ([9], 2)
    assert cache.lookup([5, 6], 1) == ([7], 2) and other.lookup([5, 6], 1) == ([], 0)
    other.clear()
    assert len(other) == 0 and len(cache) == 3
    assert other  # empty but truthy: `if ngram_cache:` in the API means "a cache was given"


@pytest.mark.parametrize(
    "kwargs", [{"max_entries": 0}, {"min_n": 0}, {"min_n": 3, "max_n": 2}, {"continuation": 0}, {"max_n": 2.5}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="NGramCache"):
        NGramCache(**kwargs)


def test_bad_start_is_refused():
    with pytest.raises(ValueError, match="start"):
        NGramCache().add([1, 2, 3], start=4)


def test_concurrent_adds_keep_the_bound():
    cache = NGramCache(max_entries=500)

    def feed(seed: int) -> None:
        rng = random.Random(seed)
        cache.add([rng.randrange(1000) for _ in range(5000)])

    threads = [threading.Thread(target=feed, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 500


def test_drafter_records_prompts_and_outputs_as_the_sequence_grows():
    cache = NGramCache(min_n=2, max_n=2, continuation=2)
    drafter = NGramCacheDrafter(cache)
    assert drafter.name == "ngram-cache" and drafter.context_length is None
    assert drafter.propose([1, 2, 3], 4, sampler=None).tokens == []
    draft = drafter.propose([1, 2, 3, 1, 2], 4, sampler=None)  # [1, 2] was followed by [3, 1]
    assert (draft.tokens, draft.source) == ([3, 1], "ngram:2")
    assert drafter.propose([7, 8, 9], 4, sampler=None).tokens == []  # a new request: recorded from scratch
    assert cache.lookup([7, 8], 4) == ([9], 2) and cache.lookup([3, 1], 4) == ([2], 2)
    assert drafter.report() == {"ngram_cache_entries": len(cache)}
    # process-wide only when asked for: a drafter given no cache has one of its own
    assert NGramCacheDrafter().cache is not NGramCacheDrafter().cache
    assert NGramCacheDrafter().cache is not shared_cache()
    assert shared_cache() is shared_cache() is cache_for(SHARED_NAMESPACE)


def test_drafter_learns_across_requests():
    target = tiny_llama(layers=2)
    ids = encode("Once upon a time, in a land far away, there lived")
    drafter = NGramCacheDrafter(NGramCache())
    reference = hf_greedy(target, ids, 30)
    runs = [generate(target, ids, assistant=drafter, max_new_tokens=30, eos_token_ids=(), schedule=Constant(4))
            for _ in range(2)]
    assert [run.token_ids for run in runs] == [reference, reference]
    first, second = (run.stats for run in runs)
    assert second.acceptance_rate > first.acceptance_rate
    assert second.accepted_tokens >= 20 and second.steps < first.steps


def test_namespaces_do_not_see_each_others_text():
    """A server names one namespace per user: a user's drafts come from that user's text only."""
    target = tiny_llama(layers=2)
    ids = encode("Once upon a time, in a land far away, there lived")
    reference = hf_greedy(target, ids, 30)

    def run(namespace):
        out = generate(target, ids, ngram_cache=namespace, max_new_tokens=30, eos_token_ids=(), schedule=Constant(4))
        assert out.token_ids == reference
        return out.stats

    alice, alice_again, bob = run("test-alice"), run("test-alice"), run("test-bob")
    assert alice_again.accepted_tokens >= 20 and alice_again.steps < alice.steps  # the same namespace learnt
    # bob saw nothing of alice's text: his first request drafts exactly as alice's first did
    assert (bob.drafted_tokens, bob.accepted_tokens, bob.steps) == (alice.drafted_tokens, alice.accepted_tokens,
                                                                     alice.steps)
    tail = (ids + reference)[-3:-1]
    assert cache_for("test-alice").lookup(tail, 4)[0] and cache_for("test-alice") is not cache_for("test-bob")
    assert NGramCacheRegistry().cache_for("test-alice").lookup(tail, 4) == ([], 0)  # another registry: empty


def test_the_registry_keeps_the_most_recently_used_namespaces():
    registry = NGramCacheRegistry(max_namespaces=2, max_entries=10)
    a, b = registry.cache_for("a"), registry.cache_for("b")
    a.add([1, 2, 3])
    assert registry.cache_for("a") is a  # a is now the most recent
    registry.cache_for("c")  # one too many: b, the least recently used, is dropped
    assert registry.namespaces() == ["a", "c"]
    assert registry.cache_for("b") is not b and registry.namespaces() == ["c", "b"]  # a is dropped in turn
    registry.drop("c")
    assert registry.namespaces() == ["b"]
    assert registry.cache_for("b").max_entries == 10  # every namespace's cache has the registry's settings
    assert registry.memory_bound_bytes() == 2 * NGramCache(max_entries=10).memory_bound_bytes()
    with pytest.raises(ValueError, match="max_namespaces"):
        NGramCacheRegistry(max_namespaces=0)
    with pytest.raises(ValueError, match="max_entries"):
        NGramCacheRegistry(max_entries=0)
    with pytest.raises(TypeError, match="namespace is a string"):
        registry.cache_for(3)


def test_concurrent_requests_for_a_namespace_get_one_cache():
    registry = NGramCacheRegistry(max_namespaces=4)
    got = []
    threads = [threading.Thread(target=lambda: got.append(registry.cache_for("user"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(cache is got[0] for cache in got)


@pytest.mark.parametrize("bad", [3, "", ["user"]])
def test_a_bad_ngram_cache_argument_says_what_is_allowed(bad):
    with pytest.raises(ConfigError, match="ngram_cache"):
        generate(tiny_llama(layers=1), encode("hello"), ngram_cache=bad, max_new_tokens=2)
