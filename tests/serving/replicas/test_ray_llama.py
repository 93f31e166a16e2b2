"""`assistgen serve --replicas 2` on the llama.cpp backend (a local Ray cluster on 127.0.0.1): requests arriving at
random, each the text a single process gives it alone, and a key's conversation continued from the keys and values
its replica kept. `make test-ray` runs it."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import free_port

from assistgen import Constant, generate, load_model
from assistgen.backends.settings import LoadSettings
from assistgen.chat.templates import encode_chat
from assistgen.serving.app_state import ServerSettings
from assistgen.serving.assembly import ServerSpec
from assistgen.serving.batching import EngineSettings
from assistgen.serving.ray import ReplicaOptions, start, stop

NAME = "smollm2-135m"
LOADING = {"backend": "llama.cpp", "exact_prompts": True, "kept_bytes": "auto"}  # as `assistgen serve` loads it
STORIES = [f"Write a short story about a {a} and a {b}." for a, b in
           [("sun", "lake"), ("red fox", "star"), ("cat", "rock"), ("dog", "bird"), ("tree", "fish"),
            ("moon", "owl"), ("fish", "tree"), ("bird", "dog"), ("rock", "cat"), ("star", "red fox")]]


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    spec = ServerSpec(NAME, LoadSettings.parse(**LOADING), lookup=True, schedule=Constant(k=4),
                      engine=EngineSettings(prefix_cache=None), settings=ServerSettings(NAME, max_tokens_limit=256))
    # (a constant schedule: drafts verified whatever the costs measured)
    start(spec, ReplicaOptions(replicas=2, cpus_per_replica=1), "127.0.0.1", port, num_cpus=2)
    yield f"http://127.0.0.1:{port}"
    stop()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=180, max_retries=0)


def test_requests_arriving_at_random_each_give_the_single_process_output(cluster):
    reference = load_model(NAME, **LOADING)
    wants = [generate(reference, encode_chat(reference, [{"role": "user", "content": s}]), lookup=True,
                      max_new_tokens=32, schedule=Constant(k=4)).text for s in STORIES]
    delays = [random.Random(7).random() * 0.4 * i for i in range(len(STORIES))]

    def ask(i: int):
        time.sleep(delays[i])
        return client(cluster, f"user-{i % 4}").chat.completions.with_raw_response.create(
            model=NAME, messages=[{"role": "user", "content": STORIES[i]}], max_tokens=32)

    with ThreadPoolExecutor(len(STORIES)) as pool:
        raw = list(pool.map(ask, range(len(STORIES))))
    replies = [r.parse() for r in raw]
    assert [r.choices[0].message.content for r in replies] == wants
    assert len({r.headers["x-assistgen-replica"] for r in raw}) == 2  # both replicas served
    assert sum(r.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] for r in replies) > 0


def test_a_keys_conversation_continues_from_its_replicas_kept_prefix(cluster):
    alice = client(cluster, "alice")
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    first = alice.chat.completions.create(model=NAME, messages=messages, max_tokens=40)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now add type hints."}]
    second = alice.chat.completions.create(model=NAME, messages=messages, max_tokens=40)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
