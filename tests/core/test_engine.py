"""The loop's parts: cache rollback, stop conditions, schedules, statistics, streaming."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import TOKENIZER, encode, hf_greedy, tiny_gemma3, tiny_gpt2, tiny_llama

from assistgen import Constant, Draft, Heuristic, confidence, generate, stream
from assistgen.backends.torch.cache import KVCache
from assistgen.core.text import TextStream
from assistgen.spec.steps import StepOutcome


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, tiny_gemma3])
def test_cache_feed_and_crop_reproduce_a_full_forward(make):
    """Random feeds with junk tokens rolled back must give the logits of one uncached forward pass."""
    model = make(seed=0)
    ids = encode("A sequence longer than the sliding window of sixteen tokens, fed in pieces.")
    with torch.inference_mode():
        full = model.hf(torch.tensor([ids])).logits[0]  # [len, vocab]
    cache, rng, pos = KVCache(model), random.Random(0), 0
    while pos < len(ids):
        n = rng.randint(1, 7)
        chunk, junk = ids[pos : pos + n], [rng.randrange(3, 70) for _ in range(rng.randint(0, 4))]
        logits = cache.feed(chunk + junk, len(chunk) + len(junk))
        torch.testing.assert_close(logits[: len(chunk)], full[pos : pos + len(chunk)], atol=1e-4, rtol=1e-4)
        pos += len(chunk)
        cache.crop(pos)
        assert len(cache) == pos and cache.tokens == ids[:pos]


def test_cache_sync_keeps_the_shared_prefix_and_one_token_to_feed():
    cache = KVCache(tiny_llama())
    cache.feed([5, 6, 7, 8])
    assert cache.sync([5, 6, 9, 10]) == [9, 10] and cache.tokens == [5, 6]
    cache.feed([9, 10])
    assert cache.sync([5, 6, 9, 10]) == [10] and len(cache) == 3


def test_max_new_tokens_is_respected_even_inside_an_accepted_run():
    target = tiny_llama()
    for n in (1, 2, 7):
        out = generate(target, encode("abc abc abc"), assistant=target, max_new_tokens=n, eos_token_ids=(),
                       schedule=Constant(5))
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_eos_stops_and_is_the_last_token():
    target = tiny_llama()
    ids = encode("hello there")
    free = generate(target, ids, max_new_tokens=30, eos_token_ids=()).token_ids
    eos = free[10]
    out = generate(target, ids, assistant=target, max_new_tokens=30, eos_token_ids=(eos,), schedule=Constant(6))
    first = free.index(eos)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "eos"
    # several EOS ids: the first one met stops
    out = generate(target, ids, max_new_tokens=30, eos_token_ids=(free[20], free[5]))
    assert out.token_ids == free[: min(free.index(free[20]), free.index(free[5])) + 1]


def test_eos_from_the_model_generation_config():
    target = tiny_llama()
    ids = encode("hello there")
    free = generate(target, ids, max_new_tokens=30, eos_token_ids=()).token_ids
    target.hf.generation_config.eos_token_id = [free[8]]
    try:
        out = generate(target, ids, max_new_tokens=30)
        reference = hf_greedy(target, ids, 30, stop_at_eos=True)
    finally:
        target.hf.generation_config.eos_token_id = None
    assert out.token_ids == free[: free.index(free[8]) + 1] == reference


def test_stop_string_is_not_emitted_and_stops_generation():
    target = tiny_llama()
    ids = encode("hello there")
    free_text = TOKENIZER.decode(generate(target, ids, max_new_tokens=40, eos_token_ids=()).token_ids)
    stop = free_text[12:15]
    out = generate(target, ids, lookup=True, max_new_tokens=40, eos_token_ids=(), stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == free_text[: free_text.index(stop)]
    assert stop not in out.text
    # a single stop string may be given as a plain string
    assert generate(target, ids, max_new_tokens=40, eos_token_ids=(), stop=stop).text == out.text
    # streamed text never shows the stop string either
    streamed = "".join(c.text for c in stream(target, ids, max_new_tokens=40, eos_token_ids=(), stop=[stop]))
    assert streamed == out.text


def test_text_stream_holds_back_a_possible_stop_prefix():
    ts = TextStream(TOKENIZER, stop=("XYZ",))
    ts.add(encode("abcXY"))
    assert ts.delta() == "abc"  # "XY" could still become "XYZ"
    ts.add(encode("q"))
    assert ts.delta() == "XYq"
    keep = ts.add(encode("rXYZtail"))
    assert keep == 4 and ts.stopped and ts.delta() == "r"


def test_context_length_stops_generation():
    target = tiny_llama()
    target.hf.config.max_position_embeddings = 20
    try:
        out = generate(target, encode("0123456789"), assistant=target, max_new_tokens=50, eos_token_ids=())
    finally:
        target.hf.config.max_position_embeddings = 512
    assert out.finish_reason == "context" and len(out.prompt_ids) + len(out.token_ids) == 20


def test_heuristic_schedule_sequence():
    h = Heuristic().prepare(None, [])
    seq = []
    for drafted_all in [True, True, False, False, False, False, False, False, False, True]:
        k = h.next_k()
        seq.append(k)
        h.update(outcome(k, k if drafted_all else 0))
    assert seq == [5, 7, 9, 8, 7, 6, 5, 4, 3, 2]
    for _ in range(10):
        h.update(outcome(h.next_k(), 0))
    assert h.next_k() == 1  # never below 1


def outcome(verified: int, accepted: int) -> StepOutcome:
    return StepOutcome(Draft(list(range(verified))), "assistant", verified, accepted, token=0)


def test_confidence_schedule_stops_the_assistant_early():
    target, assistant = tiny_llama(seed=0), tiny_llama(seed=1)
    ids = encode("hello there")
    eager = generate(target, ids, assistant=assistant, max_new_tokens=30, eos_token_ids=(), schedule=Constant(8))
    careful = generate(target, ids, assistant=assistant, max_new_tokens=30, eos_token_ids=(),
                       schedule=confidence(8, 0.9))
    assert careful.token_ids == eager.token_ids
    assert careful.stats.drafted_tokens < eager.stats.drafted_tokens


@pytest.mark.parametrize("kind", ["assistant", "self", "lookup", "plain"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_statistics_are_consistent(kind, temperature):
    target, other = tiny_llama(seed=0), tiny_llama(seed=1)
    kwargs = {"assistant": {"assistant": other}, "self": {"assistant": target}, "lookup": {"lookup": True},
              "plain": {}}[kind]
    out = generate(target, encode("abc abc abc abc"), max_new_tokens=200, eos_token_ids=(), temperature=temperature,
                   seed=0, schedule=Heuristic(), **kwargs)
    s = out.stats
    assert s.new_tokens == len(out.token_ids)
    # emitted = the prefill's one + accepted + one per verification step, except for the cut at max_new_tokens
    assert 1 + s.accepted_tokens + s.steps - s.new_tokens in range(0, s.drafted_tokens + 1)
    assert sum(s.accept_histogram) == s.steps
    assert sum(i * c for i, c in enumerate(s.accept_histogram)) == s.accepted_tokens
    assert s.target_forward_passes == s.steps + 1
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.steps)
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert s.draft_s + s.verify_s + s.prefill_s <= s.total_s + 1e-6
    if kind in ("assistant", "self"):
        assert s.draft_forward_passes >= s.drafted_tokens
    if kind == "plain":
        assert s.drafted_tokens == 0 and s.steps == 199


def test_the_first_token_comes_from_the_prefill_with_no_draft_beside_it():
    """The time to the first token is the prefill's: the pass that ends the prompt emits the first token alone,
    however much a drafter could propose there; the drafts come after it, and the output is plain decoding's."""
    target, assistant = tiny_llama(seed=0), tiny_llama(seed=0)  # the assistant is the target: drafts always right
    ids = encode("abc abc abc abc abc abc")
    chunks = list(stream(target, ids, assistant=assistant, schedule=Constant(8), max_new_tokens=30,
                         eos_token_ids=()))
    assert len(chunks[0].tokens) == 1
    assert [len(c.tokens) for c in chunks[1:3]] == [9, 9]  # then every step verifies 8 and keeps them all
    assert chunks[-1].stats.target_forward_passes == 1 + chunks[-1].stats.steps
    assert [t for c in chunks for t in c.tokens] == hf_greedy(target, ids, 30)
    one = generate(target, ids, assistant=assistant, max_new_tokens=1, eos_token_ids=()).stats  # the prefill's only
    assert (one.steps, one.target_forward_passes, one.new_tokens, one.mean_accepted_length) == (0, 1, 1, 1.0)


def test_stream_yields_tokens_then_final_stats():
    target = tiny_llama()
    chunks = list(stream(target, encode("abc abc"), lookup=True, max_new_tokens=25, eos_token_ids=()))
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    assert sum(len(c.tokens) for c in chunks) == 25 == chunks[-1].stats.new_tokens
