"""POST /v1/responses (`wire/responses.py`): the events of a reply read from steps of 1 to 17 accepted tokens add
up to its whole items; the real server (SmolLM2 on llama.cpp, prompt lookup, a Hermes-style template with tools)
spoken to with the official openai client: text, instructions, max_output_tokens, streamed events in OpenAI's order,
the same greedy text as chat completions, function tools with calls valid for their schema, a tool's output continuing
from the kept prefix, structured output through `responses.parse`, and unsupported fields refused by name."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from helpers import TOOLS_TEMPLATE, assert_400, fuzz_for_5xx, openai_client, serve
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from assistgen import load_model
from assistgen.chat.syntax import HERMES
from assistgen.serving.wire.responses import Reply, ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = "What is the weather in Paris, in celsius?"
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
NAME = "smollm2-135m"


def pieces(tokenizer, text: str, seed: int) -> list[str]:
    """The text as a stream emits it: 1 to 17 tokens a step, each piece what became decodable with it."""
    ids, rng, out, shown, at = tokenizer.encode(text, add_special_tokens=False), random.Random(seed), [], "", 0
    while at < len(ids):
        at += rng.randint(1, 17)
        decoded = tokenizer.decode(ids[:at])
        out.append(decoded[len(shown):])
        shown = decoded
    return out


def replayed(events: list[dict]) -> list[dict]:
    """The output items a client rebuilds from the events alone (as the openai SDK's stream helper does)."""
    items: list[dict] = []
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items)
            items.append(json.loads(json.dumps(e["item"])))
            assert items[-1].get("content", []) == []  # (as OpenAI: a message's part comes next, on its own)
        elif kind == "response.content_part.added":
            items[e["output_index"]]["content"].append(dict(e["part"]))
        elif kind == "response.output_text.delta":
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert items[e["output_index"]]["arguments"] == e["arguments"]
        elif kind == "response.output_text.done":
            assert items[e["output_index"]]["content"][0]["text"] == e["text"]
        elif kind == "response.output_item.done":
            items[e["output_index"]]["status"] = e["item"]["status"]
            assert items[e["output_index"]] == e["item"]
    return items


def test_events_from_steps_of_1_to_17_tokens_add_up_to_the_reply():
    tokenizer = load_model(NAME, backend="llama.cpp").tokenizer
    body = ResponsesRequest(input=ASK, tools=TOOLS)
    whole = Reply(body, NAME, HERMES)
    whole.read(TEXT, "eos", None)
    items = whole.response()["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me check." and items[2]["name"] == "get_time"
    assert json.loads(items[1]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    for seed in range(30):
        reply = Reply(body, NAME, HERMES)
        events = reply.start()
        texts = pieces(tokenizer, TEXT, seed)
        for text in texts[:-1]:
            events += reply.read(text)
        events += reply.read(texts[-1], "eos", None)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        done = events[-1]["response"]["output"]
        assert replayed(events) == done and strip_ids(done) == strip_ids(items)
        assert all(i["status"] == "completed" for i in done)


def test_a_reply_that_ends_inside_a_call_leaves_it_incomplete():
    reply = Reply(ResponsesRequest(input="Hi", tools=TOOLS), NAME, HERMES.for_tools(["get_time"]))
    events = reply.start() + reply.read('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eur', "stop")
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


def strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    reply = Reply(ResponsesRequest(input="Hi", max_output_tokens=3), NAME, None)
    events = reply.start() + reply.read("Hello the")
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,  # (chat's names)
             "prompt_tokens_details": {"cached_tokens": 2}}
    events += reply.read("re", "length", usage)
    response = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"][0]["text"] == "Hello there"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 2 and response["usage"]["output_tokens"] == 3


# --- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    """SmolLM2 with tools; a request that asks for no token limit (the fuzz draws `"max_output_tokens": null`) gets 80
    new tokens at most, not the rest of the context."""
    yield from serve("smollm2-135m", "--lookup", "--chat-template", str(TOOLS_TEMPLATE), "--max-tokens-limit", "80")


def client(url: str, key: str = "responses") -> openai.OpenAI:
    return openai_client(url, key)


@pytest.mark.integration
def test_text_in_text_out_streamed_or_not_as_chat_completions_gives_it(server):
    agent = client(server)
    whole = agent.responses.create(model=NAME, input="Name three colours.", instructions="Be brief.",
                                   max_output_tokens=24)
    chat = agent.chat.completions.create(model=NAME, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}])
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    kinds, deltas, final = [], "", None
    for event in agent.responses.create(model=NAME, input="Name three colours.", instructions="Be brief.",
                                        max_output_tokens=24, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert deltas == final.output_text == whole.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # (the requests before kept this key's prefix)


@pytest.mark.integration
def test_function_tools_give_calls_valid_for_their_schema_streamed_or_not(server):
    agent = client(server)
    whole = agent.responses.create(model=NAME, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=80)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and whole.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert whole.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0
    streamed, arguments = {}, {}
    for event in agent.responses.create(model=NAME, input=ASK, tools=TOOLS, tool_choice="required",
                                        max_output_tokens=80, stream=True):
        if event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] = arguments.get(event.output_index, "") + event.delta
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            streamed[event.output_index] = [event.item.name, event.item.arguments]
    assert [streamed[i] for i in sorted(streamed)] == [[c.name, c.arguments] for c in calls]
    assert {i: a for i, (_, a) in streamed.items()} == arguments
    named = agent.responses.create(model=NAME, input=ASK, tools=TOOLS, max_output_tokens=60,
                                   tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
    assert [(i.type, i.name) for i in named.output] == [("function_call", "get_time")]


@pytest.mark.integration
def test_a_function_call_output_continues_the_conversation_from_the_kept_prefix(server):
    agent = client(server, "loop")
    first = agent.responses.create(model=NAME, input=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=60)
    call = first.output[0]
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    second = agent.responses.create(model=NAME, input=items, tools=TOOLS, max_output_tokens=24)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


class Colour(BaseModel):
    name: str = Field(max_length=24)  # (bounded, so that a 135M model's value ends within the tokens asked)
    hex: str = Field(pattern=r"^#[0-9a-f]{6}$")


@pytest.mark.integration
def test_text_format_json_schema_through_responses_parse(server):
    parsed = client(server).responses.parse(model=NAME, input="Give a colour as JSON.", text_format=Colour,
                                            max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Colour)


@pytest.mark.integration
def test_unsupported_and_malformed_fields_are_400s_naming_the_field(server):
    url = f"{server}/v1/responses"
    base = {"model": NAME, "input": "Hi", "max_output_tokens": 4}
    cases = [({"previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
             ({"store": True}, "store", "nothing is stored"), ({"background": True}, "background", "background"),
             ({"max_tokens": 4}, "max_tokens", "max_output_tokens"),
             ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
             ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
             ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type", "not supported"),
             ({"input": []}, "input", "non-empty"),
             ({"input": [{"role": "wizard", "content": "Hi"}]}, "input.0.role", "not a role"),
             ({"tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among"),
             ({"tools": [{**TIME, "parameters": {"type": "object", "properties": {
                 "tz": {"type": "string", "pattern": "(unclosed"}}}}]}, "tools.0.parameters",
              "does not compile"),
             ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0", "call_id"),
             ({"frequency_penalty": 3}, "frequency_penalty", "from -2 to 2"),
             ({"model": "other"}, "model", "does not exist")]
    with httpx.Client(timeout=60) as http:
        for extra, param, words in cases:
            response = http.post(url, json={**base, **extra})
            if param == "model":
                assert response.status_code == 404 and response.json()["error"]["param"] == "model"
            else:
                assert_400(response, param, words)
        assert http.post(url, json={**base, "store": False, "truncation": "disabled", "include": []}).status_code == 200


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.text(max_size=6), st.lists(st.integers(), max_size=2))
ITEM = st.one_of(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                                 "input_image", "reasoning"]),
                                        "role": st.sampled_from(["user", "assistant", "system", "tool", "wizard"]),
                                        "content": st.one_of(st.text(max_size=8), JUNK, st.lists(
                                            st.fixed_dictionaries({"type": st.sampled_from(["input_text",
                                                                                            "output_text", "image"]),
                                                                   "text": JUNK}), max_size=2)),
                                        "call_id": JUNK, "name": st.one_of(st.sampled_from(["get_time"]), JUNK),
                                        "arguments": st.one_of(st.sampled_from(['{"tz": "UTC"}', "{x"]), JUNK),
                                        "output": st.one_of(st.text(max_size=6), JUNK)}), JUNK)
RESPONSES_BODY = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=10), st.lists(ITEM, max_size=3), JUNK)},
    optional={"tools": st.one_of(st.lists(st.one_of(st.sampled_from(TOOLS), st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]), "name": st.one_of(st.text(max_size=6), JUNK),
         "parameters": st.one_of(JUNK, st.just({"type": "object", "properties": {"a": {"type": "nope"}}}))}), JUNK),
        max_size=2), JUNK),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
                  {"type": st.just("function"), "name": st.one_of(st.sampled_from(["get_time", "x"]), JUNK)}), JUNK),
              "instructions": st.one_of(st.text(max_size=6), JUNK), "text": st.one_of(JUNK, st.fixed_dictionaries(
                  {"format": st.one_of(JUNK, st.fixed_dictionaries({"type": st.sampled_from(
                      ["text", "json_object", "json_schema"])}, optional={"schema": JUNK, "name": JUNK}))})),
              "parallel_tool_calls": JUNK, "max_output_tokens": st.one_of(st.integers(-1, 2), JUNK),
              "stream": st.booleans()})


@pytest.mark.integration
def test_fuzzed_input_tools_and_formats_never_get_a_5xx(server):
    """A bounded fuzz (127.0.0.1, 200 requests of 2 tokens at most, or of the server's 80 where a body asks for no
    limit): a 200 or a 4xx with OpenAI's error body."""
    seen = fuzz_for_5xx(f"{server}/v1/responses", RESPONSES_BODY, {"model": NAME, "max_output_tokens": 2}, 200)
    assert seen["ok"] > 5 and seen["refused"] > 5
