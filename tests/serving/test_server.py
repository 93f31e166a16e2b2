"""`assistgen serve` end to end: the real server (uvicorn on 127.0.0.1, a free port) over SmolLM2-135M, spoken to
with the official `openai` client and httpx; no mocks."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import schemathesis
import torch
from helpers import assert_error, scrape, start, start_serve_command, stop, stop_serve_command
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families

from assistgen import generate
from assistgen.serving.batching import EngineSettings

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
REPEATING = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def live(smollm2, one_thread):
    server = start(smollm2, max_tokens_limit=32)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def small(smollm2, one_thread):
    """One request at a time, one waiting; at most 4 new tokens: for queue-full and fuzzing."""
    server = start(smollm2, EngineSettings(max_batch=1, max_queue=1), max_tokens_limit=4)
    yield server
    stop(server)


def stream_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    parts, finish = [], None
    for event in client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True):
        parts.append(event.choices[0].text)
        finish = event.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_completion_matches_generate_and_stream(live, smollm2):
    client = live.client
    reply = client.completions.create(model=NAME, prompt=REPEATING, max_tokens=12)
    expected = generate(smollm2, REPEATING, max_new_tokens=12)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected.prompt_ids)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == len(expected.prompt_ids) + 12
    spec = reply.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0  # prompt lookup drafted on the repeating prompt
    assert sum(spec["acceptance_histogram"]) >= spec["num_spec_steps"]
    assert stream_text(client, REPEATING, 12) == (expected.text, "length")


def test_chat_stream_with_usage_matches_non_stream(live, smollm2):
    client = live.client
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    expected = generate(smollm2, "Say hello.", chat=True, max_new_tokens=8)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")

    parts, finish, usage = [], None, None
    for event in client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}):
        assert event.object == "chat.completion.chunk"
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == reply.choices[0].message.content
    assert finish == reply.choices[0].finish_reason
    assert usage.prompt_tokens == reply.usage.prompt_tokens == len(expected.prompt_ids)
    assert usage.completion_tokens == reply.usage.completion_tokens == len(expected.token_ids)


def test_eight_concurrent_streams_each_match_their_single_run(live, smollm2):
    client = live.client
    prompts = [f"{w} one, {w} two, {w} one, {w} two, {w} one," for w in
               ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree")]
    singles = [client.completions.create(model=NAME, prompt=p, max_tokens=14) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(lambda p: stream_text(client, p, 14), prompts, timeout=120))
    assert [text for text, _ in streamed] == [s.choices[0].text for s in singles]
    assert [text for text, _ in streamed] == [generate(smollm2, p, lookup=True, max_new_tokens=14).text
                                              for p in prompts]  # the library alone, in this process
    assert any(s.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0 for s in singles)
    assert live.engine.largest_batch >= 4  # the streams were stepped together


def test_metrics_count_what_the_responses_report(live):
    before = scrape(live)
    client = live.client
    replies = [client.completions.create(model=NAME, prompt=REPEATING, max_tokens=10),
               client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count: 1 2 3"}],
                                              max_tokens=6)]
    after = scrape(live)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    spec = [r.model_extra["metrics"]["speculative_decoding"] for r in replies]
    assert delta("assistgen:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in spec)
    assert delta("assistgen:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_draft_tokens"]
                                                                           for s in spec)
    assert delta("assistgen:spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in spec)
    assert delta("assistgen:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert delta("assistgen:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert delta("assistgen:e2e_request_latency_seconds_count") == 2
    assert delta("assistgen:time_to_first_token_seconds_count") == 2
    assert after["assistgen:num_requests_running"] == 0
    assert after["assistgen:exact"] == 1 and all(s["exact"] for s in spec)  # torch: a row's logits are its own


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole-reply"])
def test_client_disconnect_cancels_the_engine_request(live, stream):
    submitted = []
    original = live.engine.submit
    live.engine.submit = lambda *a, **k: submitted.append(original(*a, **k)) or submitted[-1]  # a spy
    try:
        body = {"model": NAME, "prompt": REPEATING, "max_tokens": 32, "stream": stream}
        if stream:
            with httpx.Client(timeout=30) as http, http.stream("POST", f"{live.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
                assert '"text_completion"' in first
        else:  # a client that gives up waiting for the whole reply
            with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
                http.post(f"{live.url}/v1/completions", json=body)
    finally:
        live.engine.submit = original
    (request,) = submitted
    assert request.done.wait(30), "the engine never finished the abandoned request"
    assert request.cancelled.is_set()
    deadline = time.monotonic() + 30
    while live.engine.num_running:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert live.client.completions.create(model=NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_client_mistakes_are_4xx_with_openai_error_bodies(live):
    url = f"{live.url}/v1/completions"
    with httpx.Client(timeout=30) as http:
        assert_error(http.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
        assert_error(http.post(url, json={"model": NAME}), 400, "prompt")
        assert_error(http.post(url, json={"model": NAME, "prompt": "Hi", "n": 0}), 400, "n")
        assert_error(http.post(url, json={"model": NAME, "prompt": "Hi", "temperature": -1}), 400, "temperature")
        assert_error(http.post(url, json={"model": NAME, "prompt": "Hi", "max_tokens": 0}), 400, "max_tokens")
        assert_error(http.post(url, json={"model": NAME, "prompt": []}), 400, "prompt")
        assert_error(http.post(url, json={"model": NAME, "prompt": "Hi", "max_tokens": 1000}), 400, "max_tokens")
        assert_error(http.post(url, json={"model": NAME, "prompt": "word " * 9000, "max_tokens": 1}), 400, "prompt")
        assert_error(http.post(url, json={"model": NAME, "prompt": [10**9]}), 400, "prompt")
        assert_error(http.post(url, json={"model": "gpt-4", "prompt": "Hi"}), 404, "model")
        assert_error(http.post(f"{live.url}/v1/chat/completions", json={"model": NAME, "messages": []}), 400)
        models = http.get(f"{live.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)


def test_max_completion_tokens_bounds_a_chat_reply(live):
    messages = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    reply = live.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=5)
    assert reply.usage.completion_tokens <= 5
    assert reply.usage.completion_tokens == 5 or reply.choices[0].finish_reason == "stop"
    with httpx.Client(timeout=30) as http:
        body = {"model": NAME, "messages": messages, "max_tokens": 4, "max_completion_tokens": 5}
        assert_error(http.post(f"{live.url}/v1/chat/completions", json=body), 400, "max_completion_tokens")


def test_fields_the_server_does_not_do_are_refused_by_name_unless_off(live):
    """Every field of `REFUSED`, on the endpoint that defines it: a value that asks for it is a 400 naming it; its
    "off" values are accepted (clients send defaults)."""
    from assistgen.serving.wire.chat import ChatRequest
    from assistgen.serving.wire.common import REFUSED
    from assistgen.serving.wire.completions import CompletionRequest

    CHAT_ONLY = set(ChatRequest.model_fields) - set(CompletionRequest.model_fields)
    COMPLETION_ONLY = set(CompletionRequest.model_fields) - set(ChatRequest.model_fields)

    asks = {"use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1,
            "functions": [{"name": "f"}], "function_call": "auto", "suffix": "x",
            "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
            "reasoning_effort": "high", "web_search_options": {}, "store": True, "service_tier": "flex"}
    assert set(asks) == set(REFUSED)
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    text = {"model": NAME, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(timeout=30) as http:
        for name, value in asks.items():
            for path, body, only in (("chat/completions", chat, COMPLETION_ONLY), ("completions", text, CHAT_ONLY)):
                if name in only:
                    continue
                assert_error(http.post(f"{live.url}/v1/{path}", json={**body, name: value}), 400, name)
                off = REFUSED[name][0][-1]
                if off is not None:
                    assert http.post(f"{live.url}/v1/{path}", json={**body, name: off}).status_code == 200, name
        with pytest.raises(openai.BadRequestError, match="renders no tools"):  # (SmolLM2's own template)
            live.client.chat.completions.create(model=NAME, messages=chat["messages"], max_tokens=1,
                                                tools=[{"type": "function", "function": {"name": "f"}}])


def test_roles_are_checked(live):
    url = f"{live.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        wizard = {"model": NAME, "max_tokens": 2, "messages": [{"role": "wizard", "content": "Hi"}]}
        assert_error(http.post(url, json=wizard), 400, "messages.0.role")
        tool = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"},
                                                              {"role": "tool", "content": "42"}]}
        assert_error(http.post(url, json=tool), 400, "messages.1.tool_call_id")
        developer = {"model": NAME, "max_tokens": 2, "messages": [{"role": "developer", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}]}
        system = {**developer, "messages": [{"role": "system", "content": "Be brief."}, developer["messages"][1]]}
        a, b = http.post(url, json=developer).json(), http.post(url, json=system).json()
    assert a["usage"] == b["usage"] and a["choices"][0]["message"] == b["choices"][0]["message"]


def test_models_retrieve_and_the_context_bound(live):
    card = live.client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == live.app.state.assistgen.context
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("gpt-4")
    unlimited = start(live.engine.target)  # no max_tokens limit of its own: only the context bounds a request
    try:
        with httpx.Client(timeout=30) as http:
            body = {"model": NAME, "prompt": "Hi", "max_tokens": 1_000_000_000}
            assert_error(http.post(f"{unlimited.url}/v1/completions", json=body), 400, "max_tokens")
            chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**9}
            assert_error(http.post(f"{unlimited.url}/v1/chat/completions", json=chat), 400, "max_completion_tokens")
    finally:
        stop(unlimited)


def test_several_prompts_give_one_choice_each_and_echo(live, smollm2):
    client = live.client
    prompts = [REPEATING, "red one, red two, red one, red two, red one,"]
    singles = [client.completions.create(model=NAME, prompt=p, max_tokens=10) for p in prompts]
    both = client.completions.create(model=NAME, prompt=prompts, max_tokens=10)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    ids = list(smollm2.tokenizer(prompts[1])["input_ids"])
    by_ids = client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=10)
    assert [c.text for c in by_ids.choices] == [singles[1].choices[0].text] * 2

    parts = {0: [], 1: []}
    for event in client.completions.create(model=NAME, prompt=prompts, max_tokens=10, stream=True, echo=True):
        for choice in event.choices:
            parts[choice.index].append(choice.text)
    assert ["".join(parts[i]) for i in (0, 1)] == [p + s.choices[0].text for p, s in zip(prompts, singles, strict=True)]
    echoed = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=10, echo=True)
    assert echoed.choices[0].text == prompts[0] + singles[0].choices[0].text


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
EXTRACT = "Reply in JSON with the person's name and age. Text: Anna Berg is 41. Anna Berg lives in Oslo."


def close(a: float, b: float) -> bool:
    return abs(a - b) < 2e-4


def test_logprobs_are_the_engines_streamed_or_not(live, smollm2):
    """Chat and completions logprobs (and their alternatives) are the library's, which test_logprobs.py checks
    against plain decoding's; a stream carries the same per chunk."""
    want = generate(smollm2, REPEATING, lookup=True, max_new_tokens=12, logprobs=2)
    client = live.client
    text = client.completions.create(model=NAME, prompt=REPEATING, max_tokens=12, logprobs=2).choices[0]
    assert text.text == want.text
    lp = text.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    assert all(close(a, b.logprob) for a, b in zip(lp.token_logprobs, want.logprobs, strict=True))
    assert "".join(lp.tokens) == want.text and lp.text_offset[0] == 0
    streamed = [c for e in client.completions.create(model=NAME, prompt=REPEATING, max_tokens=12, logprobs=2,
                                                    stream=True) for c in e.choices if c.logprobs]
    assert sum((c.logprobs.token_logprobs for c in streamed), []) == lp.token_logprobs
    assert len(streamed) > 1  # (per chunk, not all at the end)
    messages = [{"role": "user", "content": REPEATING}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, logprobs=True,
                                          top_logprobs=3).choices[0]
    want = generate(smollm2, REPEATING, chat=True, lookup=True, max_new_tokens=12, logprobs=3)
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content == want.text
    for got, ref in zip(content, want.logprobs, strict=True):
        assert close(got.logprob, ref.logprob) and len(got.top_logprobs) == 3
        assert all(close(a.logprob, b) for a, (_, b) in zip(got.top_logprobs, ref.top, strict=True))
        assert bytes(got.bytes).decode() == got.token
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, logprobs=True,
                                            top_logprobs=3, stream=True)
    chunks = [c.logprobs.content for e in stream for c in e.choices if c.logprobs and c.logprobs.content]
    assert [c.logprob for part in chunks for c in part] == [c.logprob for c in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3).choices[0]
    assert plain.logprobs is None
    with httpx.Client(timeout=30) as http:
        body = {"model": NAME, "messages": messages, "max_tokens": 2, "top_logprobs": 2}
        assert_error(http.post(f"{live.url}/v1/chat/completions", json=body), 400, "top_logprobs")
        body = {"model": NAME, "messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
        assert_error(http.post(f"{live.url}/v1/chat/completions", json=body), 400, "top_logprobs")


def test_echo_with_logprobs_lists_the_prompt_first(live, smollm2):
    reply = live.client.completions.create(model=NAME, prompt=REPEATING, max_tokens=4, logprobs=1, echo=True)
    choice = reply.choices[0]
    lp = choice.logprobs
    n = reply.usage.prompt_tokens
    assert choice.text.startswith(REPEATING) and len(lp.tokens) == n + reply.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = smollm2.tokenizer(REPEATING)["input_ids"]
    with torch.inference_mode():
        want = torch.log_softmax(smollm2.hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert all(close(lp.token_logprobs[i + 1], float(want[i, ids[i + 1]])) for i in range(n - 1))
    streamed = [c.logprobs for e in live.client.completions.create(
        model=NAME, prompt=REPEATING, max_tokens=4, logprobs=1, echo=True, stream=True) for c in e.choices
        if c.logprobs]
    assert sum((p.token_logprobs for p in streamed), []) == lp.token_logprobs


def test_structured_outputs_give_valid_json_with_speculation_on(live, smollm2):
    """json_schema / json_object / a regex through the openai client: valid, the library's constrained output
    (greedy: the same with and without drafting, which the server's lookup drafter did), and bad specs a 400."""
    import json as jsonlib

    client = live.client
    messages = [{"role": "user", "content": EXTRACT}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, response_format=fmt)
    value = jsonlib.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert reply.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0
    plain = generate(smollm2, EXTRACT, chat=True, max_new_tokens=32, json_schema=PERSON)
    assert reply.choices[0].message.content == plain.text and plain.stats.drafted_tokens == 0
    any_object = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32,
                                                response_format={"type": "json_object"})
    assert isinstance(jsonlib.loads(any_object.choices[0].message.content), dict)
    digits = client.completions.create(model=NAME, prompt="Anna Berg is", max_tokens=6,
                                       extra_body={"structured_outputs": {"regex": " [0-9]{2} years"}})
    assert digits.choices[0].text[:3].strip().isdigit() and digits.choices[0].text.endswith("years")
    with httpx.Client(timeout=30) as http:
        for bad, param in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
                            None), ({"type": "json_schema"}, "response_format.json_schema.schema"),
                           ({"type": "xml"}, "response_format")):
            body = {"model": NAME, "messages": messages, "max_tokens": 4, "response_format": bad}
            response = http.post(f"{live.url}/v1/chat/completions", json=body)
            assert_error(response, 400, param)
        body = {"model": NAME, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-"}}
        assert "does not compile" in http.post(f"{live.url}/v1/completions", json=body).json()["error"]["message"]


def test_a_structured_request_compiles_its_grammar_once(live, monkeypatch):
    """Admission compiles a request's grammar (for the target's tokenizer and its EOS tokens) on the handler's thread;
    the engine thread starts the generation from it without compiling again."""
    from assistgen.core import constraint

    compiled = []
    original = constraint.compile_structure
    monkeypatch.setattr(constraint, "compile_structure", lambda *a, **k: compiled.append(a[2]) or original(*a, **k))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = live.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": EXTRACT}],
                                                max_tokens=8, response_format=fmt)
    assert reply.usage.completion_tokens > 0
    assert [s.kind for s in compiled] == ["json_schema"]


def test_the_readme_lists_every_request_field():
    """The README's request-field table names each field the two endpoints declare, and says what happens."""
    import re
    from pathlib import Path

    from assistgen.serving.wire.chat import ChatRequest, Message
    from assistgen.serving.wire.common import NO_EFFECT, REFUSED
    from assistgen.serving.wire.completions import CompletionRequest

    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    table = readme[readme.index("### Request fields"):]
    rows = dict(re.findall(r"^\| `([a-z_.\[\]]+)` \| ([^|]+) \|", table, re.M))
    declared = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    declared |= {f"messages[].{f}" for f in Message.model_fields}
    assert declared <= set(rows), declared - set(rows)
    for name in REFUSED:
        assert rows[name].strip().startswith("refused"), name
    for name in NO_EFFECT:
        assert rows[name].strip().startswith("accepted, no effect"), name


# A value that asks for each declared field's feature (the refused ones: see REFUSED's test for every one).
ASKING = {
    "model": NAME, "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": ["\n\n"],
    "n": 2, "best_of": 3, "stream": False, "stream_options": {"include_usage": True}, "user": "u-1",
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[0-9]+"}, "prompt": "Hi",
    "echo": True, "logprobs": 2, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
    "metadata": {"k": "v"}, "top_logprobs": 2, "guided_json": {"type": "object"}, "guided_regex": "[0-9]+",
    "guided_grammar": 'root ::= "ok"', "guided_choice": ["yes", "no"],
    "prediction": {"type": "content", "content": "Hi"},
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"50": 5}, "repetition_penalty": 1.2,
    "min_p": 0.1, "min_tokens": 2, "ignore_eos": True, "bad_words": ["x"],
}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # sent to a server whose template renders tools:
# tests/chat/test_tools.py (SmolLM2's own template renders none)
EFFECT = {  # what a reply shows for a field that is honoured (choice -> bool)
    "response_format": lambda c: c["message"]["content"].startswith("{"),
    "structured_outputs": lambda c: (c.get("text") or c.get("message", {}).get("content", "")).isdigit(),
    "echo": lambda c: c["text"].startswith("Hi"),
    "logprobs": lambda c: c["logprobs"] is not None,
    "top_logprobs": lambda c: len(c["logprobs"]["content"][0]["top_logprobs"]) == 2,
    "guided_regex": lambda c: (c.get("text") or c.get("message", {}).get("content", "")).isdigit(),
    "guided_grammar": lambda c: (c.get("text") or c.get("message", {}).get("content", "")) == "ok",
    "guided_choice": lambda c: (c.get("text") or c.get("message", {}).get("content", "")) in ("yes", "no"),
}


def test_each_documented_field_is_sent_and_does_what_the_readme_says(live):
    """Every field the README's table calls honoured or accepted, sent on each endpoint that declares it with a
    value that asks for it: a 200, and where the reply can show it, its effect."""
    import re
    from pathlib import Path

    from assistgen.serving.wire.chat import ChatRequest
    from assistgen.serving.wire.common import REFUSED
    from assistgen.serving.wire.completions import CompletionRequest

    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", readme[readme.index("### Request fields"):], re.M))
    sent = 0
    for path, model, base in (("completions", CompletionRequest, {"prompt": "Hi"}),
                              ("chat/completions", ChatRequest, {"messages": ASKING["messages"]})):
        for name in model.model_fields:
            if name in REFUSED or name in ("prompt", "messages") or name in TOOL_FIELDS:
                continue
            assert rows[name].startswith(("honoured", "accepted", "refused above")), name
            value = ASKING[name]
            if name == "logprobs" and path == "chat/completions":
                value = True
            body = {"model": NAME, "max_tokens": 3, **base, name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            if name == "max_completion_tokens":
                del body["max_tokens"]
            response = httpx.post(f"{live.url}/v1/{path}", json=body, timeout=60)
            assert response.status_code == 200, (name, response.text)
            choice = response.json()["choices"][0]
            if name in EFFECT and not (name == "response_format" and path == "completions"):
                assert EFFECT[name](choice), (name, choice)
            sent += 1
    assert sent >= 30


def test_queue_full_is_429(small):
    body = {"model": NAME, "prompt": "A long prompt to read. " * 60, "max_tokens": 4}
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: http.post(f"{small.url}/v1/completions", json=body), range(8),
                                  timeout=120))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(200) >= 1, codes
    for r in responses:
        if r.status_code == 429:
            assert_error(r, 429)


def test_fuzz_never_5xx(small):
    """Schemathesis cases for every operation of the app's OpenAPI schema, sent to the live server."""
    schema = schemathesis.openapi.from_dict(small.app.openapi())
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(base_url=small.url, timeout=30)
            assert response.status_code < 500, (case.body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()


def json_schemas():
    """Small JSON schemas, valid and not (unknown types, odd keywords): what a client may send as a schema."""
    from hypothesis import strategies as st

    scalar = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "objekt")]
                             + [{"enum": ["a", "b"]}, {"type": "string", "maxLength": 3}, {"minimum": 2}])
    return st.recursive(scalar, lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]},
                  st.dictionaries(st.sampled_from(["a", "b", "name"]), inner, max_size=3)),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner)), max_leaves=4)


def test_fuzz_of_the_structured_output_and_logprobs_fields_never_5xx(small):
    """The fields this issue honours, fuzzed together with the openai client's shapes: never a 5xx, and every
    refusal has OpenAI's error body."""
    from hypothesis import strategies as st

    as_format = lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}  # noqa: E731
    formats = st.one_of(st.none(), st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"},
                                                    {"type": "json_schema"}, "json", 3]), json_schemas().map(as_format))
    extension = st.one_of(st.none(), json_schemas().map(lambda s: {"json": s}),
                          st.sampled_from([{"regex": "[0-9]+"}, {"regex": "[a-"}, {"grammar": 'root ::= "x"'},
                                           {"grammar": "root ::="}, {"choice": ["a"]}, {}, [], "regex"]))
    numbers = st.one_of(st.none(), st.integers(-3, 25), st.booleans(), st.just(2.5))

    @given(fmt=formats, ext=extension, logprobs=numbers, top=numbers, echo=st.booleans(), chat=st.booleans())
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(fmt, ext, logprobs, top, echo, chat):
        body = {"model": NAME, "max_tokens": 3}
        body.update({k: v for k, v in (("response_format", fmt), ("structured_outputs", ext),
                                       ("logprobs", logprobs)) if v is not None})
        if chat:
            body.update(messages=[{"role": "user", "content": "Hi"}], **({"top_logprobs": top} if top is not None
                                                                        else {}))
        else:
            body.update(prompt="Hi", echo=echo)
        response = httpx.post(f"{small.url}/v1/{'chat/completions' if chat else 'completions'}", json=body,
                              timeout=60)
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


def test_a_server_prices_drafts_on_this_cpus_measured_costs_from_its_first_request(tmp_path):
    """Where this machine has no record of the model's pass costs, `assistgen serve` measures them before it listens
    (a server that starts under traffic may never be idle to measure): its first request is priced on the measured
    curve, not a provisional one."""
    import os

    from assistgen.paths import cache_root

    fresh = tmp_path / "cache"  # this process's cache, but no cost records
    fresh.mkdir()
    for entry in cache_root().iterdir():
        if entry.name != "costs":
            (fresh / entry.name).symlink_to(entry)
    env = {**os.environ, "ASSISTGEN_CACHE": str(fresh)}
    process, port = start_serve_command("--model", NAME, "--lookup", env=env)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["costs"] == "measured"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert f"Measuring {NAME}" in process.stdout.read()


def test_the_command_serves_and_exits_0_on_sigterm(tmp_path):
    """`assistgen serve` as a user starts it: it answers (within its --max-tokens-limit), and SIGTERM stops it cleanly
    (exit status 0)."""
    from assistgen.cli.main import main

    assert main(["serve", "--model", NAME, "--max-tokens-limit", "0"]) == 2  # refused before anything loads
    process, port = start_serve_command("--model", NAME, "--lookup", "--max-tokens-limit", "6")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", timeout=60, max_retries=0)
        assert client.completions.create(model=NAME, prompt=REPEATING, max_tokens=4).usage.completion_tokens == 4
        unbounded = client.completions.create(model=NAME, prompt=REPEATING)  # none asked: up to the server's 6
        assert unbounded.usage.completion_tokens == 6 and unbounded.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="above this server's limit 6") as refused:
            client.completions.create(model=NAME, prompt=REPEATING, max_tokens=7)
        assert refused.value.body["param"] == "max_tokens"
        assert f"serving {NAME} at http://127.0.0.1:{port}/v1" in stop_serve_command(process)
    finally:
        if process.poll() is None:
            process.kill()


def test_replica_metrics_merge_by_adding_up_and_dropping_stale_gauges():
    """What `serve --replicas` serves at /metrics (serving/ray.py): the replicas' registries added up."""

    from assistgen.serving.ray import STALE_S, merged_metrics, route_key

    def text(tokens: float, running: float) -> str:
        return ("# HELP assistgen:generation_tokens Tokens.\n# TYPE assistgen:generation_tokens counter\n"
                f"assistgen:generation_tokens_total {tokens}\n"
                "# HELP assistgen:num_requests_running Running.\n# TYPE assistgen:num_requests_running gauge\n"
                f"assistgen:num_requests_running {running}\n")

    merged = merged_metrics({"a": (100.0, text(5, 2)), "b": (100.0 - STALE_S - 1, text(7, 3))}, now=100.0)
    samples = {s.name: s.value for f in text_string_to_metric_families(merged) for s in f.samples}
    assert samples == {"assistgen:generation_tokens_total": 12.0, "assistgen:num_requests_running": 2.0}
    assert route_key("Bearer alice") == route_key("bearer  alice ") != route_key("Bearer bob")
    assert route_key(None) == route_key("Basic xyz") == route_key("Bearer ") == ""
    assert "alice" not in route_key("Bearer alice")


def test_replica_options_without_replicas_are_refused(capsys):
    from assistgen.cli.main import main

    assert main(["serve", "--max-replicas", "4"]) == 2
    assert "--max-replicas" in capsys.readouterr().err
    assert main(["serve", "--replicas", "3", "--max-replicas", "2"]) == 2
    assert "below --replicas" in capsys.readouterr().err
