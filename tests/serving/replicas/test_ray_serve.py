"""`assistgen serve --replicas 2` on a local Ray cluster (127.0.0.1 only, started here): two SmolLM2-135M
replicas behind Ray Serve's HTTP proxy, spoken to with the official openai client and httpx; no mocks.
`make test-ray` runs it (Ray's start-up and two replicas take longer than `make test` can give)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import free_port

from assistgen import generate, load_model
from assistgen.backends.settings import LoadSettings
from assistgen.serving.app_state import ServerSettings
from assistgen.serving.assembly import ServerSpec
from assistgen.serving.ray import ReplicaOptions, route_key, start, stop

NAME = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "The three primary colors are", "To make a cup of tea, first", "Water boils at",
           "The quick brown fox", "import numpy as np\n"]
STORY = ("Repeat this text exactly: The lighthouse keeper climbed the spiral stairs every evening, "
         "lit the great lamp, and watched the ships pass the rocks until dawn.")


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    spec = ServerSpec(NAME, LoadSettings(backend="torch"),
                      settings=ServerSettings(NAME, ngram_cache=True, max_tokens_limit=256))
    start(spec, ReplicaOptions(replicas=2, cpus_per_replica=1), "127.0.0.1", port, num_cpus=2)
    url = f"http://127.0.0.1:{port}"
    yield url
    import ray

    if ray.is_initialized():  # (the shutdown test stops it itself)
        stop()


@pytest.fixture(scope="module")
def reference():
    return load_model(NAME, backend="torch")


def client(url: str, key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


def test_streamed_and_whole_replies_equal_the_single_process_output(cluster, reference):
    want = generate(reference, PROMPTS[0], max_new_tokens=16).text
    whole = client(cluster).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16)
    assert whole.choices[0].text == want
    parts = [e.choices[0].text for e in client(cluster).completions.create(model=NAME, prompt=PROMPTS[0],
                                                                          max_tokens=16, stream=True)]
    assert "".join(parts) == want and len(parts) > 1


def test_eight_concurrent_requests_each_equal_their_single_process_output(cluster, reference):
    wants = [generate(reference, p, max_new_tokens=24).text for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: client(cluster, key=f"user-{PROMPTS.index(p)}").completions.create(
            model=NAME, prompt=p, max_tokens=24).choices[0].text, PROMPTS))
    assert got == wants
    with httpx.Client(timeout=60) as http:
        replicas = {http.post(f"{cluster}/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 2})
                    .headers["x-assistgen-replica"] for p in PROMPTS}
    assert len(replicas) == 2  # (requests without a key go to the least loaded replica: both serve)


def test_errors_are_the_single_process_servers(cluster):
    with httpx.Client(timeout=60) as http:
        bad = http.post(f"{cluster}/v1/completions", json={"model": NAME, "prompt": "Hi", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        assert http.post(f"{cluster}/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}).status_code == 404
        assert http.get(f"{cluster}/v1/models").json()["data"][0]["id"] == NAME


def test_one_keys_requests_stay_on_one_replica_and_draft_from_its_earlier_requests(cluster):
    def ask(key: str) -> httpx.Response:
        body = {"model": NAME, "prompt": STORY, "max_tokens": 40}
        return httpx.post(f"{cluster}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                          timeout=120)

    first = ask("alice")
    again = [ask("alice") for _ in range(3)]
    assert {r.headers["x-assistgen-replica"] for r in [first, *again]} == {first.headers["x-assistgen-replica"]}
    fresh = ask("bob-" + str(time.time()))  # the same text, no history: only its own prompt to draft from
    accepted = lambda r: r.json()["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]  # noqa: E731
    assert accepted(again[0]) > accepted(fresh)
    assert route_key("Bearer alice") == route_key("bearer  alice ") != route_key("Bearer bob")


def test_metrics_are_the_replicas_added_up(cluster):
    time.sleep(5)  # (replicas push theirs every 2 s)
    text = httpx.get(f"{cluster}/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("assistgen:generation_tokens_total")]
    assert lines and float(lines[0].split()[-1]) > 0


def streamed_text(lines) -> tuple[str, list[str]]:
    """The text of an SSE completions stream's remaining events, and those events."""
    import json

    events = [line for line in lines if line.startswith("data:")]
    text = "".join(json.loads(e[5:])["choices"][0]["text"] for e in events
                   if e != "data: [DONE]" and json.loads(e[5:]).get("choices"))
    return text, events


def test_a_killed_replica_ends_its_stream_with_an_error_and_is_replaced(cluster, reference):
    from contextlib import ExitStack

    from ray import serve

    victim_body = {"model": NAME, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 256,  # (no early end)
                   "stream": True}
    other_body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 48, "stream": True}
    with httpx.Client(timeout=120) as http, ExitStack() as streams:
        victim = streams.enter_context(http.stream("POST", f"{cluster}/v1/completions", json=victim_body,
                                                   headers={"authorization": "Bearer victim"}))
        pid = int(victim.headers["x-assistgen-replica"])
        for _ in range(8):  # a stream in flight on the other replica when the victim's dies (no key: least loaded)
            other = streams.enter_context(http.stream("POST", f"{cluster}/v1/completions", json=other_body))
            if int(other.headers["x-assistgen-replica"]) != pid:
                break
        assert int(other.headers["x-assistgen-replica"]) != pid
        lines = victim.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        os.kill(pid, signal.SIGKILL)
        _, rest = streamed_text(lines)  # (ends: no hang)
        assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest), (len(rest), rest[-3:])
        text, events = streamed_text(other.iter_lines())
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        assert text == generate(reference, PROMPTS[1], max_new_tokens=48).text  # the other replica's: unchanged
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replicas = serve.status().applications["assistgen"].deployments["Replica"].replica_states
        if replicas.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    assert replicas.get("RUNNING", 0) == 2, replicas


def test_shutdown_stops_serving_and_ray(cluster):
    """Last in this module: `stop()` (what SIGINT/SIGTERM on `assistgen serve --replicas` runs) ends Serve and Ray."""
    import ray

    assert httpx.get(f"{cluster}/v1/models", timeout=30).status_code == 200
    stop()
    assert not ray.is_initialized()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{cluster}/v1/models", timeout=5)
