"""Conversations: prefix reuse across requests (`core.prefix`, the engine, `Session`/`Conversation`, the server), and
one request one output: a greedy request's tokens do not depend on what runs beside it or on what the cache kept,
on both backends (llama.cpp: the patched build places a sequence's cells in position order; `LlamaModel._compact`)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
from helpers import assert_exact_or_near_tie, start_serve_command, tiny_llama

from assistgen import ConfigError, Constant, Conversation, PrefixCache, Session, generate, load_model
from assistgen.api import default_schedule, make_drafter
from assistgen.chat.templates import encode_chat, template_prefix
from assistgen.config import GenerationConfig
from assistgen.core.prefix import NOBODY, PUBLIC, check_capacity
from assistgen.serving.batching import BatchEngine, EngineSettings

STORIES = [f"Write a short story about a {a} and a {b}." for a, b in
           [("sun", "lake"), ("red fox", "star"), ("cat", "rock"), ("dog", "bird"), ("tree", "fish"),
            ("moon", "moon"), ("fish", "tree"), ("bird", "dog"), ("rock", "cat"), ("star", "red fox")]]


@pytest.fixture(scope="module")
def smol_llama():
    """As `assistgen serve` loads it: prompts on the row-exact kernels, cells kept beside the context."""
    return load_model("smollm2-135m", backend="llama.cpp", exact_prompts=True, kept_bytes="auto")


@pytest.fixture(scope="module")
def smol_torch():
    return load_model("smollm2-135m", backend="torch")


def chat(model, *turns: str) -> list[int]:
    """The chat template over alternating user / assistant turns, ready for the assistant's next one."""
    roles = ["user", "assistant"]
    return encode_chat(model, [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])


DRAFTING = Constant(k=4)  # drafts verified whatever the measured costs say: passes of several rows in every batch


def run_arrivals(model, prompts: list[list[int]], tokens: int, seed: int) -> tuple[list[list[int]], BatchEngine, int]:
    """Each prompt submitted to one engine at a random moment (seeded), greedy with prompt lookup; the outputs, the
    engine and the draft tokens it accepted."""
    rng = random.Random(seed)
    engine = BatchEngine(model, partial(make_drafter, model, lookup=True), DRAFTING).start()
    try:
        requests = []
        for ids in prompts:
            requests.append(engine.submit(ids, GenerationConfig(max_new_tokens=tokens)))
            time.sleep(rng.random() * 0.3)
        chunks = [list(r) for r in requests]
    finally:
        engine.shutdown(timeout=60)
    accepted = sum(c[-1].stats.accepted_tokens for c in chunks)
    return [[t for chunk in c for t in chunk.tokens] for c in chunks], engine, accepted


# --- one request, one output ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_requests_arriving_at_random_on_llama_cpp_each_give_their_output_alone(smol_llama):
    """Goes red on llama.cpp's own placement (a request's new cells below its earlier ones once others have left:
    3-5 of 12 differed in two rounds with the unpatched library)."""
    prompts = [chat(smol_llama, s) for s in STORIES]
    alone = [generate(smol_llama, ids, lookup=True, max_new_tokens=32, schedule=DRAFTING) for ids in prompts]
    got, engine, accepted = run_arrivals(smol_llama, prompts, 32, seed=1)
    assert got == [g.token_ids for g in alone]
    assert engine.largest_batch >= 4
    assert accepted > 0 and sum(g.stats.accepted_tokens for g in alone) > 0  # drafting happened


@pytest.mark.slow  # (`make test-slow`; the same engine on the default backend above, and torch's batched streams
# in tests/serving/test_server.py, stay in `make test`)
@pytest.mark.integration
def test_requests_arriving_at_random_on_torch_each_give_their_output_alone(smol_torch):
    prompts = [chat(smol_torch, s) for s in STORIES[:8]]
    alone = [generate(smol_torch, ids, lookup=True, max_new_tokens=24, schedule=DRAFTING).token_ids for ids in prompts]
    got, engine, accepted = run_arrivals(smol_torch, prompts, 24, seed=2)
    for ids, reference, ours in zip(prompts, alone, got, strict=True):
        assert_exact_or_near_tie(smol_torch, ids, reference, ours)
    assert engine.largest_batch >= 4 and accepted > 0


@pytest.mark.integration
def test_cells_packed_when_the_pool_runs_out_above_a_sequence_keep_its_logits():
    """A sequence whose next cells find no room after its last one, with room below (freed by another), is packed
    down (`_compact`) and computes the same bits as alone in a fresh context."""
    model = load_model("smollm2-135m", backend="llama.cpp", context=512, sequences=4, fast_linear=False)
    a, b, c = model.new_cache(), model.new_cache(), model.new_cache()
    a.feed(list(range(100, 300)))  # cells 0..199
    b.feed(list(range(300, 500)))  # 200..399
    c.feed(list(range(500, 600)))  # 400..499
    a.crop(0)  # 0..199 free: b's next 40 cells fit only below it
    logits = b.feed(list(range(600, 640)), 40)
    fresh = load_model("smollm2-135m", backend="llama.cpp", context=512, sequences=4, fast_linear=False)
    alone = fresh.new_cache()
    alone.feed(list(range(300, 500)))
    assert torch.equal(logits, alone.feed(list(range(600, 640)), 40))
    assert torch.equal(c.feed([7], 1), fresh_feed(fresh, list(range(500, 600)) + [7]))


def fresh_feed(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    cache.feed(ids[:-1])
    return cache.feed(ids[-1:], 1)


# --- the prefix cache -------------------------------------------------------------------------------------------


def test_the_prefix_cache_reuses_the_longest_prefix_per_namespace_within_its_bound():
    model = tiny_llama()
    one = model.new_cache()
    one.feed(list(range(1, 41)))
    per_cache = one.nbytes()
    prefix = PrefixCache(model, capacity=3 * per_cache)
    prefix.give(one, "alice")
    assert prefix.take(list(range(1, 60)), "bob") is None  # another key's entry serves nobody else
    got = prefix.take(list(range(1, 60)), "alice")
    assert got is one and len(got) == 40 and not prefix.entries  # extended whole: handed over
    prefix.give(got, "alice")
    partial_share = prefix.take(list(range(1, 21)) + [58, 59], "alice")
    assert partial_share is not one and partial_share.tokens == list(range(1, 21))  # a fork: the entry stays
    assert len(prefix.entries) == 1 and len(one) == 40
    for start in range(5):  # more than the bound holds: least recently used dropped, bytes within it
        cache = model.new_cache()
        cache.feed([start + 1] * 40)
        prefix.give(cache, "carol")
        assert prefix.kept_bytes <= prefix.capacity
    assert prefix.evictions >= 2 and len(prefix.entries) == 3
    assert prefix.take(list(range(1, 60)), "alice") is None  # alice's entry was the least recently used
    assert prefix.queries > prefix.hits == 40 + 20
    prefix.give(model.new_cache(), "alice")  # an empty cache is not kept
    assert len(prefix.entries) == 3


def test_a_templates_opening_serves_every_namespace_and_nothing_a_request_sent_does():
    """`public` tokens (a chat template's opening) are kept once under PUBLIC and reused by any namespace, NOBODY's
    (a request without a key) included, never further than the asking request's own public length."""
    model = tiny_llama()
    opening, said = list(range(1, 11)), list(range(20, 50))
    alice = model.new_cache()
    alice.feed(opening + said)
    prefix = PrefixCache(model, capacity=10 * alice.nbytes())
    prefix.give(alice, "alice", public=len(opening))
    assert sorted((e.namespace, len(e.cache)) for e in prefix.entries.values()) == [(PUBLIC, 10), ("alice", 40)]
    bob = prefix.take(opening + said + [7], "bob", public=len(opening))  # bob sends what alice said: the opening only
    assert bob.tokens == opening and len(alice) == 40 and len(prefix.entries) == 2
    bob.feed(said)
    prefix.give(bob, "bob", public=len(opening))  # the opening is kept once
    assert sorted(e.namespace for e in prefix.entries.values()) == [PUBLIC, "alice", "bob"]
    assert prefix.take(opening + said, "carol", public=0) is None  # no public length: nothing another sent
    assert len(prefix.take(opening + said + [7], "alice", public=len(opening))) == 40  # its own, whole
    shorter = prefix.take(opening[:4] + [58, 59], NOBODY, public=4)  # up to the asking request's public length
    assert shorter.tokens == opening[:4]
    shorter.feed([58, 59])
    prefix.give(shorter, NOBODY, public=4)  # NOBODY keeps nothing of its own; a public entry holds these already
    assert sorted(e.namespace for e in prefix.entries.values()) == [PUBLIC, "bob"]
    other = model.new_cache()
    other.feed([5, 6, 7, 8])
    prefix.give(other, NOBODY, public=3)  # another opening: NOBODY's cache becomes its public entry
    assert sorted(e.cache.tokens for e in prefix.entries.values() if e.namespace == PUBLIC) == [opening, [5, 6, 7]]
    assert prefix.take([5, 6, 7, 8, 9], "dave", public=3).tokens == [5, 6, 7]


def test_the_templates_opening_holds_no_content_of_the_request(smol_llama):
    """`template_prefix`: the leading tokens the chat template renders from nothing the request holds (SmolLM2: its
    default system prompt and the user's header); with a system message, no word of it."""
    model = smol_llama
    for content in ["Write a haiku.", "\nYou are", "<|im_end|>", " ", "user"]:
        messages = [{"role": "user", "content": content}]
        ids = encode_chat(model, messages)
        n = template_prefix(model, messages, ids)
        opening = model.tokenizer.decode(ids[:n])
        assert "You are a helpful AI assistant" in opening
        assert opening.endswith("user\n" if content[0].isalnum() else ("user", "user\n"))  # ("\n" + " ": one token)
        assert ids[:n] == encode_chat(model, [{"role": "user", "content": "something else"}])[:n]
    messages = [{"role": "system", "content": "Secret plans."}, {"role": "user", "content": "Hi"}]
    ids = encode_chat(model, messages)
    n = template_prefix(model, messages, ids)
    assert 0 < n < len(ids) - 3 and "Secret" not in model.tokenizer.decode(ids[:n])


def test_a_prefix_cache_that_cannot_hold_one_sequence_is_refused():
    model = tiny_llama()
    needed = model.context_length * model.kv_bytes_per_token
    with pytest.raises(ConfigError, match=r"cannot hold one sequence.*--prefix-cache.*0 to keep none"):
        check_capacity(model, needed - 1)
    check_capacity(model, needed)
    check_capacity(model, 0)
    with pytest.raises(ConfigError, match="prefix_cache"):
        EngineSettings(prefix_cache=-1)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_a_conversation_continued_from_kept_prefixes_equals_fresh_requests(backend, smol_llama, smol_torch):
    """Three turns through an engine that keeps prefixes: turns 2 and 3 feed only the new turn (cached tokens
    asserted) and give the tokens an engine that keeps nothing gives for the same prompt."""
    model = smol_llama if backend == "llama.cpp" else smol_torch
    kept = BatchEngine(model, partial(make_drafter, model, lookup=True), default_schedule(),
                       EngineSettings(prefix_cache=None)).start()
    fresh = BatchEngine(model, partial(make_drafter, model, lookup=True), default_schedule()).start()
    config = GenerationConfig(max_new_tokens=40)
    try:
        turns = ["Write a Python function that checks whether a number is prime."]
        for ask in ("Now add a docstring to it.", "Rename the function to is_prime_number."):
            ids = chat(model, *turns)
            chunks = list(kept.submit(ids, config, namespace="me"))
            tokens = [t for chunk in chunks for t in chunk.tokens]
            alone = [t for chunk in fresh.submit(ids, config) for t in chunk.tokens]
            if backend == "llama.cpp":
                assert tokens == alone
            else:
                assert_exact_or_near_tie(model, ids, alone, tokens)
            cached = chunks[-1].stats.cached_tokens
            assert (cached == 0) if len(turns) == 1 else cached >= len(chat(model, *turns[:-2])) + 20
            turns += [model.tokenizer.decode(tokens, skip_special_tokens=True), ask]
        assert kept.prefix.hits > 0 and fresh.prefix is None
    finally:
        kept.shutdown(timeout=60)
        fresh.shutdown(timeout=60)


@pytest.mark.integration
def test_copies_of_one_conversation_sent_at_once_all_reuse_its_kept_prefix(smol_llama):
    """Several clients replaying one conversation under one key (N copies of a client, a load generator): every copy
    of a later turn continues from the kept turn, the first to start does not take it from the others (llama.cpp's
    forks share rows: `Capabilities.shared_forks`), and each gives what a fresh request gives."""
    model = smol_llama
    assert model.capabilities.shared_forks
    engine = BatchEngine(model, partial(make_drafter, model, lookup=True), default_schedule(),
                         EngineSettings(prefix_cache=None)).start()
    config = GenerationConfig(max_new_tokens=24)
    try:
        turns = ["Write a Python function that checks whether a number is prime."]
        first = [t for chunk in engine.submit(chat(model, *turns), config, namespace="me") for t in chunk.tokens]
        turns += [model.tokenizer.decode(first, skip_special_tokens=True), "Now add a docstring to it."]
        ids = chat(model, *turns)
        copies = [engine.submit(ids, config, namespace="me") for _ in range(3)]
        chunks = [list(r) for r in copies]
        alone = generate(model, ids, max_new_tokens=24).token_ids
    finally:
        engine.shutdown(timeout=60)
    kept = len(chat(model, turns[0])) + len(first) - 2  # (the template may end the reply with its own tokens)
    assert all(c[-1].stats.cached_tokens >= kept for c in chunks), [c[-1].stats.cached_tokens for c in chunks]
    assert all([t for chunk in c for t in chunk.tokens] == alone for c in chunks)


@pytest.mark.integration
def test_a_session_and_a_conversation_keep_their_cache_between_calls(smol_llama, smol_torch):
    first = "Write a haiku about the sea."
    conversation = Conversation(smol_llama, system="You are brief.", max_new_tokens=24)
    one = conversation.say(first)
    two = conversation.say("Another one, about mountains.")
    assert one.stats.cached_tokens == 0 and two.stats.cached_tokens > len(one.prompt_ids)
    again = generate(smol_llama, two.prompt_ids, max_new_tokens=24)
    assert two.token_ids == again.token_ids
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "user", "assistant"]
    session = Session(smol_llama, lookup=True, max_new_tokens=8)
    a = session.generate(two.prompt_ids)
    b = session.generate(two.prompt_ids + a.token_ids)
    assert b.stats.cached_tokens == len(two.prompt_ids) + len(a.token_ids) - 1
    with pytest.raises(ConfigError, match="another model"):
        generate(smol_torch, "Hi", prefix=session.prefix)


# --- the server ---------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_server_reuses_a_keys_prefix_and_answers_as_a_fresh_request(smol_llama):
    """`assistgen serve --backend llama.cpp --lookup --suffix` with the official client: a key's second turn reports
    cached prompt tokens, drafts, and gives the text another key gets for the same messages with only the chat
    template's opening kept; /metrics counts the hits; a prefix cache too small for one sequence is refused at
    start-up."""
    import httpx
    import openai

    process, port = start_serve_command("--model", "smollm2-135m", "--backend", "llama.cpp", "--lookup", "--suffix")
    try:
        url = f"http://127.0.0.1:{port}/v1"
        alice = openai.OpenAI(base_url=url, api_key="alice", timeout=60, max_retries=0)
        bob = openai.OpenAI(base_url=url, api_key="bob", timeout=60, max_retries=0)
        messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
        first = alice.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now make it reverse in place."}]
        second = alice.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0
        stream = bob.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48, stream=True,
                                             stream_options={"include_usage": True})
        events = list(stream)
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == \
            second.choices[0].message.content
        opening = template_prefix(smol_llama, messages, encode_chat(smol_llama, messages))
        assert 10 < opening < first.usage.prompt_tokens - 5  # SmolLM2's default system prompt and the user's header
        assert events[-1].usage.prompt_tokens_details.cached_tokens == opening  # bob shares only that with alice
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        hits = [line for line in metrics.splitlines() if line.startswith("assistgen:prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) >= first.usage.prompt_tokens
    finally:
        process.kill()
    small = subprocess.run([sys.executable, "-m", "assistgen.cli.main", "serve", "--model", "smollm2-135m",
                            "--backend", "llama.cpp", "--prefix-cache", "1MB"], capture_output=True, text=True,
                           timeout=120)
    assert small.returncode == 2 and "cannot hold one sequence" in small.stderr
