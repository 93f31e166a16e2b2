"""Tool calls: the call syntax read back from text split into steps of any size (`chat.parser`, the server's
`CallStream`), calls valid by construction under speculation on the real SmolLM2 (given a Hermes-style template
with tools, as `--chat-template` gives one), and the server's `tools`, `tool_choice` and `parallel_tool_calls`
spoken to with the official openai client, errors included."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from helpers import TOOLS_TEMPLATE, assert_400, fuzz_for_5xx, openai_client, serve_smollm2_with_tools
from hypothesis import strategies as st

from assistgen import Constant, generate, load_model
from assistgen.chat.grammar import call_structure
from assistgen.chat.parser import parse_calls
from assistgen.chat.syntax import HERMES, call_syntax
from assistgen.chat.templates import encode_chat, use_chat_template
from assistgen.chat.tools import Tool
from assistgen.core.state import Chunk
from assistgen.serving.jobs import Job
from assistgen.serving.replies import CallStream, tool_message

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
        '"note": "a \\"quoted\\" }\\n</tool_call> inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def smol():
    model = load_model("smollm2-135m", backend="llama.cpp")
    return use_chat_template(model, str(TOOLS_TEMPLATE))


def steps_of(tokenizer, text: str, seed: int) -> list[Chunk]:
    """The text's tokens as a stream would emit them, 1 to 17 accepted tokens a step, each chunk's text what
    became decodable with it; the last chunk finishes."""
    ids, rng, chunks, shown, at = tokenizer.encode(text, add_special_tokens=False), random.Random(seed), [], "", 0
    while at < len(ids):
        n = rng.randint(1, 17)
        decoded = tokenizer.decode(ids[: at + n])
        chunks.append(Chunk(ids[at: at + n], decoded[len(shown):]))
        shown, at = decoded, at + n
    chunks[-1].finish_reason = "eos"
    return chunks


def test_calls_read_from_steps_of_1_to_17_tokens_are_the_whole_texts_calls(smol):
    whole = parse_calls(HERMES, TEXT)
    assert whole.content == "Let me check." and [c[0] for c in whole.calls] == ["get_weather", "get_time"]
    assert json.loads(whole.calls[0][1])["note"] == 'a "quoted" }\n</tool_call> inside'
    for seed in range(40):
        chunks = steps_of(smol.tokenizer, TEXT, seed)
        assert parse_calls(HERMES, [c.text for c in chunks]) == whole
        stream = CallStream(Job([], None, 0.0, calls=HERMES))
        content, calls, finishes = "", {}, []
        for chunk in chunks:
            for delta, finish in stream.read(chunk):
                content += delta.get("content") or ""
                for call in delta.get("tool_calls", []):
                    if "id" in call:  # a call starts: index, id, type, name (once), then argument fragments
                        assert call["index"] not in calls and call["type"] == "function"
                        calls[call["index"]] = [call["function"]["name"], call["id"]]
                    calls[call["index"]].append(call["function"]["arguments"])
                finishes.append(finish)
        assert content == whole.content
        assert [[c[0], "".join(c[2:])] for _, c in sorted(calls.items())] == whole.calls
        assert len({c[1] for c in calls.values()}) == 2 and finishes[-1] == "tool_calls" and not any(finishes[:-1])


FENCED_TEXT = ('Sure.\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "celsius"}\n}\n'
               '```\nAnd a config:\n```json\n{"name": "my-app", "version": "1.0"}\n```')


def test_a_call_written_as_a_markdown_json_block_is_read_as_a_call_other_json_stays_text(smol):
    """Small models asked for <tool_call> tags often write a call as a JSON block: one whose "name" is a tool's is a
    call; a JSON block naming anything else (a package.json) stays text, however the text is split."""
    syntax = HERMES.for_tools(["get_weather", "get_time"])
    whole = parse_calls(syntax, FENCED_TEXT)
    assert whole.calls == [["get_weather", '{"city": "Paris", "unit": "celsius"}']]
    assert whole.content == 'Sure.\nAnd a config:\n```json\n{"name": "my-app", "version": "1.0"}\n```'
    for seed in range(20):
        assert parse_calls(syntax, [c.text for c in steps_of(smol.tokenizer, FENCED_TEXT, seed)]) == whole
    assert parse_calls(HERMES, FENCED_TEXT).calls == []  # (no tools named: no fenced calls)
    bare = parse_calls(syntax, '{"name": "get_time", "arguments": {"tz": "a } \\" {"}}')
    assert bare.calls == [["get_time", '{"tz": "a } \\" {"}']] and bare.content == ""
    doubled = parse_calls(syntax, '{{"name": "get_time", "arguments": {"tz": "UTC"}}}')  # (Qwen2.5's example's braces)
    assert doubled.calls == [["get_time", '{"tz": "UTC"}']] and doubled.content == ""


def test_in_auto_a_call_opened_in_any_form_follows_the_schema_and_text_stays_free(smol):
    from assistgen.core.constraint import Constraint

    structure = call_structure(HERMES, [Tool.of(t, "t") for t in TOOLS], "auto")

    def accepts(text: str) -> bool:
        """Whether the grammar lets the text's tokens through, whichever way the text is split into tokens."""
        constraint = Constraint.begin(smol, structure, {smol.tokenizer.eos_token_id})
        for token in smol.tokenizer.encode(text, add_special_tokens=False):
            if constraint.check([token]) != (1, None):
                return False
            constraint.advance([token])
        return True

    assert accepts(FENCED_TEXT.split("And")[0]) and accepts('```json\n{"name": "my-app", "version": "1.0"}\n```')
    assert accepts('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    assert not accepts('```json\n{\n  "name": "get_weather",\n  "arguments": {"town": "Paris"}')  # (not its schema)
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}')
    assert not accepts('<tool_call>\n{"name": "delete_all"')  # (not a tool)


def test_a_call_cut_by_a_stop_string_does_not_finish_as_tool_calls(smol):
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eur'
    stream = CallStream(Job([], None, 0.0, calls=HERMES))
    assert stream.read(Chunk([1], cut, finish_reason="stop"))[-1] == ({}, "stop")
    whole = Job([], None, 0.0, texts=[cut], calls=HERMES)
    assert tool_message(whole, "stop")[1] == "stop"
    done = Job([], None, 0.0, texts=[cut + 'ope/Paris"}}\n</tool_call>'], calls=HERMES)
    assert tool_message(done, "stop")[1] == "tool_calls"


def test_a_tool_without_parameters_takes_an_empty_object():
    for parameters in (None, {}, {"properties": {}}):
        tool = Tool.of({"type": "function", "function": {"name": "now", "parameters": parameters}}, "t")
        assert tool.parameters["type"] == "object"
        structure = call_structure(HERMES, [tool], "required")
        assert "now" in structure.spec


def test_a_template_without_tools_has_no_call_syntax_and_refuses_tools():
    plain = load_model("smollm2-135m", backend="llama.cpp")
    assert call_syntax(plain.tokenizer) is None
    with pytest.raises(Exception, match="renders no tools"):
        encode_chat(plain, ASK, TOOLS)


@pytest.mark.integration
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("get_time", True),
                                             ("auto", True)])
def test_calls_are_valid_for_their_schema_and_exact_with_speculation(smol, choice, parallel):
    """Under the call structure every call parses and validates against its tool's schema; drafting (prompt lookup
    and the grammar's forced text) is on and its greedy tokens are those of plain constrained decoding."""
    ids = encode_chat(smol, ASK, TOOLS)
    structure = call_structure(HERMES, [Tool.of(t, "t") for t in TOOLS], choice, parallel)
    plain = generate(smol, ids, max_new_tokens=80, structure=structure)
    drafted = generate(smol, ids, max_new_tokens=80, structure=structure, lookup=True, schedule=Constant(k=4))
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted_tokens > 0
    parsed = parse_calls(HERMES, drafted.text)
    if choice == "auto":
        return  # (whether a 135M model calls is its own choice; its calls, if any, were checked the same way)
    assert parsed.calls and parsed.content == ""
    assert len(parsed.calls) == 1 or parallel
    for name, arguments in parsed.calls:
        assert choice in ("required", name)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# --- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    yield from serve_smollm2_with_tools()


def client(url: str, key: str = "agent") -> openai.OpenAI:
    return openai_client(url, key)


@pytest.mark.integration
def test_the_server_answers_with_tool_calls_streamed_or_not(server):
    asked = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80)
    whole = client(server).chat.completions.create(**asked)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert whole.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0
    calls: dict[int, list[str]] = {}
    finish = None
    for event in client(server).chat.completions.create(**asked, stream=True):
        for delta in event.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
        finish = event.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments]
                                                  for c in choice.message.tool_calls]


@pytest.mark.integration
def test_tool_choice_and_parallel_tool_calls_are_honoured(server):
    one = client(server).chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=80,
                                                 tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                 parallel_tool_calls=False)
    calls = one.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    none = client(server).chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=8,
                                                  tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("length", "stop")


@pytest.mark.integration
def test_a_tool_result_continues_the_conversation_from_the_kept_prefix(server):
    agent = client(server, "loop")
    first = agent.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = agent.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=24)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # (the generation prompt's last token, "\n", may merge with the call's first when the turn is rendered again)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


@pytest.mark.integration
def test_bad_tool_fields_are_400s_naming_the_field(server):
    url = f"{server}/v1/chat/completions"
    base = {"model": "smollm2-135m", "messages": ASK, "max_tokens": 4}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    with httpx.Client(timeout=60) as http:
        assert_400(http.post(url, json={**base, "tools": [WEATHER, bad_schema]}), "tools.1.function.parameters",
                   "does not compile")
        assert_400(http.post(url, json={**base, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}),
                   "tools.0", "function name")
        assert_400(http.post(url, json={**base, "tools": [{"type": "code_interpreter"}]}), "tools.0", "function tool")
        assert_400(http.post(url, json={**base, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "nope"}}}), "tool_choice", "not among the tools")
        assert_400(http.post(url, json={**base, "tool_choice": "required"}), "tool_choice", "needs tools")
        assert_400(http.post(url, json={**base, "tools": TOOLS, "parallel_tool_calls": "yes"}),
                   "parallel_tool_calls", "true or false")
        assert_400(http.post(url, json={**base, "tools": TOOLS, "response_format": {"type": "json_object"}}),
                   "tool_choice", "give one")
        call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}
        messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}]
        assert_400(http.post(url, json={**base, "messages": messages}), "messages.1.tool_calls.0.function.arguments",
                   "not JSON")
        assert_400(http.post(url, json={**base, "messages": ASK + [{"role": "tool", "content": "42"}]}),
                   "messages.1.tool_call_id", "names the call")


# --- fuzz: whatever a client sends in tools, tool_choice and messages, never a 5xx ------------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=8), st.lists(st.integers(), max_size=2))
SCHEMA = st.recursive(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["string", "integer", "number", "boolean", "null",
                                                                  "array", "object", "nope"]),
                                        "enum": st.lists(st.one_of(st.text(max_size=4), st.integers()), max_size=3),
                                        "pattern": st.sampled_from(["[a-z]+", "(unclosed", "^x$"]),
                                        "minLength": st.integers(-1, 3), "$ref": st.sampled_from(["#/nowhere", "#"])}),
    lambda inner: st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "array"]), "properties": st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3),
        "items": inner, "required": st.lists(st.text(max_size=4), max_size=2), "anyOf": st.lists(inner, max_size=2),
        "additionalProperties": st.one_of(st.booleans(), inner)}),
    max_leaves=6)
NAMES = st.one_of(st.sampled_from(["get_weather", "get_time", "f"]), st.text(max_size=10))
TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "web_search"]),
                           "function": st.fixed_dictionaries({"name": NAMES},
                                                             optional={"parameters": st.one_of(SCHEMA, JUNK),
                                                                       "description": st.one_of(st.text(max_size=8),
                                                                                                JUNK)})}),
    st.sampled_from(TOOLS), JUNK)
CALL = st.one_of(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function":
                                        st.fixed_dictionaries({"name": NAMES, "arguments": st.one_of(
                                            st.sampled_from(['{"city": "Oslo"}', "{}", "{bad", "[1]", '"x"']),
                                            JUNK)})}), JUNK)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "assistant", "tool", "system", "developer", "function", "wizard"])},
    optional={"content": st.one_of(st.text(max_size=12), st.none(), st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=6)}),
        max_size=2)), "tool_calls": st.one_of(
        st.lists(CALL, max_size=2), st.integers(), st.booleans(), st.text(max_size=4),
        st.dictionaries(st.text(max_size=3), JUNK, max_size=2)), "tool_call_id": st.one_of(
            st.text(min_size=1, max_size=4), st.text(min_size=1, max_size=4), JUNK)})
BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=4),
                           st.lists(MESSAGE, max_size=3).map(lambda more: ASK + more))},
    optional={"tools": st.one_of(st.lists(TOOL, max_size=3), JUNK),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), st.fixed_dictionaries(
                  {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}), JUNK),
              "parallel_tool_calls": JUNK, "stream": st.booleans()})


@pytest.mark.integration
def test_fuzzed_tools_tool_choice_and_messages_never_get_a_5xx(server):
    """A bounded fuzz (127.0.0.1, 300 requests of 2 tokens at most): every answer is a 200 or a 4xx with OpenAI's
    error body naming the problem."""
    seen = fuzz_for_5xx(f"{server}/v1/chat/completions", BODY, {"model": "smollm2-135m", "max_tokens": 2}, 300)
    assert seen["ok"] > 5 and seen["refused"] > 5  # (the fuzz reached the engine and the checks both)
