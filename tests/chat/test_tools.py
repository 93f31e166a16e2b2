"""Tool calls: the call syntax read back from text split into steps of any size (`chat.parser`, the server's
`CallStream`), markers held as special tokens looked up in the tokenizer (named by id in the grammar, read as the
stream shows them), calls valid by construction under speculation on the real SmolLM2 and Gemma-3 (given templates
with tools, as `--chat-template` gives one: SmolLM2's own renders none, the shipped Gemma-3 has none), and the
server's `tools`, `tool_choice` and `parallel_tool_calls` spoken to with the official openai client, every choice
with and without parallel calls, streamed or not, errors included. (Qwen2.5's template, whose markers are special
tokens: tests/serving/qwen.)"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers import (
    GEMMA_TOOLS_TEMPLATE,
    TIME_TOOL,
    TOOLS_TEMPLATE,
    assert_400,
    assert_valid_calls,
    fuzz_for_5xx,
    openai_client,
    schemas_of,
    serve,
    serve_smollm2_with_tools,
    steps_of,
    tool_bodies,
    tool_reply,
)

from assistgen import Constant, generate, load_model
from assistgen.chat.grammar import call_structure
from assistgen.chat.parser import parse_calls
from assistgen.chat.syntax import HERMES, CallForm, CallSyntax, call_syntax
from assistgen.chat.templates import encode_chat, use_chat_template
from assistgen.chat.tools import Tool
from assistgen.core.constraint import Constraint
from assistgen.core.state import Chunk
from assistgen.serving.jobs import Job
from assistgen.serving.replies import CallStream, tool_message

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = TIME_TOOL
TOOLS = [WEATHER, TIME]
SCHEMAS = schemas_of(TOOLS)
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
        '"note": "a \\"quoted\\" }\\n</tool_call> inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def smol():
    model = load_model("smollm2-135m", backend="llama.cpp")
    return use_chat_template(model, str(TOOLS_TEMPLATE))


@pytest.fixture(scope="module")
def gemma():
    model = load_model("gemma3-270m", backend="llama.cpp")
    return use_chat_template(model, str(GEMMA_TOOLS_TEMPLATE))


def grammar_accepts(model, structure, tokens: list[int]) -> bool:
    """Whether the grammar lets these tokens through, one by one."""
    constraint = Constraint.begin(model, structure, {model.tokenizer.eos_token_id})
    for token in tokens:
        if constraint.check([token]) != (1, None):
            return False
        constraint.advance([token])
    return True


def read_stream(syntax, chunks: list[Chunk]) -> tuple[str, list[list[str]], list]:
    """The content, calls ([name, arguments]) and finish reasons `CallStream` gives for a stream's chunks."""
    stream = CallStream(Job([], None, 0.0, calls=syntax))
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
    assert len({c[1] for c in calls.values()}) == len(calls)  # (an id per call)
    return content, [[c[0], "".join(c[2:])] for _, c in sorted(calls.items())], finishes


def test_calls_read_from_steps_of_1_to_17_tokens_are_the_whole_texts_calls(smol):
    whole = parse_calls(HERMES, TEXT)
    assert whole.content == "Let me check." and [c[0] for c in whole.calls] == ["get_weather", "get_time"]
    assert json.loads(whole.calls[0][1])["note"] == 'a "quoted" }\n</tool_call> inside'
    for seed in range(40):
        chunks = steps_of(smol.tokenizer, TEXT, seed)
        assert parse_calls(HERMES, [c.text for c in chunks]) == whole
        content, calls, finishes = read_stream(HERMES, chunks)
        assert content == whole.content and calls == whole.calls
        assert finishes[-1] == "tool_calls" and not any(finishes[:-1])


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
    structure = call_structure(HERMES, [Tool.of(t, "t") for t in TOOLS], "auto")

    def accepts(text: str) -> bool:
        return grammar_accepts(smol, structure, smol.tokenizer.encode(text, add_special_tokens=False))

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


def test_where_the_output_is_calls_only_a_marker_cut_short_is_no_content():
    """With "required" or a function, text after the last call is the next call's marker cut by the token limit or a
    stop string: no content, and the reply ended inside a call (elsewhere it may be text: a reply may end in "```")."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n<tool_'
    parsed = parse_calls(HERMES.for_tools(["get_time"], calls_only=True), text)
    assert parsed.calls == [["get_time", '{"tz": "UTC"}']] and parsed.content == "" and parsed.unfinished
    assert parse_calls(HERMES.for_tools(["get_time"]), text).content.strip() == "<tool_"


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
    bare = load_model("gemma3-270m", backend="llama.cpp")  # (the shipped Gemma-3-270M has no chat template)
    assert call_syntax(bare.tokenizer) is None
    with pytest.raises(Exception, match="no chat template"):
        encode_chat(bare, ASK, TOOLS)


# A template that writes its calls between two special tokens that decoding drops (Gemma's unused tokens, as
# fine-tunes repurpose them): what Qwen2.5's markers would be if its tokenizer skipped them.
UNUSED = CallSyntax("unused", (CallForm("<unused0>", '\n{"name": "', close="}\n<unused1>"),),
                    markers=("<unused0>", "<unused1>"))


def test_markers_are_special_tokens_where_the_tokenizer_holds_them(smol, gemma):
    assert call_syntax(smol.tokenizer).specials == () == call_syntax(gemma.tokenizer).specials  # (text to both)
    ids = gemma.tokenizer.convert_tokens_to_ids(["<unused0>", "<unused1>"])
    found = UNUSED.for_tokenizer(gemma.tokenizer).specials
    assert [(s.text, s.token, s.shown) for s in found] == [("<unused0>", ids[0], ""), ("<unused1>", ids[1], "")]
    assert UNUSED.for_tokenizer(smol.tokenizer).specials == ()  # (SmolLM2 spells them in text tokens)
    structure = call_structure(UNUSED.for_tokenizer(gemma.tokenizer), [Tool.of(TIME, "t")], "required")
    assert f"<[{ids[0]}]>" in structure.spec and f"<[{ids[1]}]>" in structure.spec and "unused" not in structure.spec


@pytest.mark.integration
def test_a_call_between_special_tokens_the_stream_drops_is_constrained_exact_and_read(gemma):
    """The grammar names the markers' tokens, in "auto" too; the model writes them, drafting stays exact; the parser
    reads the call from the text the stream shows (without the markers), in steps of any size."""
    syntax = UNUSED.for_tokenizer(gemma.tokenizer).for_tools(["get_weather", "get_time"])
    tools = [Tool.of(t, "t") for t in TOOLS]
    call = '<unused0>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n<unused1>'
    encoded = [gemma.tokenizer.encode(text, add_special_tokens=False) for text in (call, "Sure." + call + " Done.")]
    required, auto = (call_structure(syntax, tools, choice) for choice in ("required", "auto"))
    assert grammar_accepts(gemma, required, encoded[0]) and grammar_accepts(gemma, auto, encoded[1])
    wrong = 'Sure.<unused0>\n{"name": "get_time", "arguments": {"zone"'
    assert not grammar_accepts(gemma, auto, gemma.tokenizer.encode(wrong, add_special_tokens=False))
    for seed in range(10):
        content, calls, finishes = read_stream(syntax, steps_of(gemma.tokenizer, "Sure." + call, seed))
        assert content == "Sure." and calls == [["get_time", '{"tz": "UTC"}']] and finishes[-1] == "tool_calls"
    ids = encode_chat(gemma, ASK, TOOLS)
    structure = call_structure(syntax, tools, "get_time", parallel=False)
    plain = generate(gemma, ids, max_new_tokens=40, structure=structure)
    drafted = generate(gemma, ids, max_new_tokens=40, structure=structure, lookup=True, schedule=Constant(k=4))
    assert drafted.token_ids == plain.token_ids and plain.token_ids[0] == syntax.specials[0].token
    assert drafted.stats.accepted_tokens > 0 and "unused" not in plain.text
    parsed = parse_calls(syntax, plain.text)
    assert [c[0] for c in parsed.calls] == ["get_time"] and parsed.content == "" and not parsed.unfinished
    jsonschema.validate(json.loads(parsed.calls[0][1]), SCHEMAS["get_time"])


# Each choice with parallel calls on SmolLM2 and without on Gemma-3 here; the other six in `make test-slow`.
CALL_CASES = [pytest.param(name, choice, parallel, marks=() if (name == "smol") == parallel else pytest.mark.slow)
              for name in ("smol", "gemma") for choice in ("auto", "required", "get_time")
              for parallel in (True, False)]


@pytest.mark.integration
@pytest.mark.parametrize("name, choice, parallel", CALL_CASES)
def test_calls_are_valid_for_their_schema_and_exact_with_speculation(request, name, choice, parallel):
    """Under the call structure every call parses and validates against its tool's schema; drafting (prompt lookup
    and the grammar's forced text) is on and its greedy tokens are those of plain constrained decoding."""
    model = request.getfixturevalue(name)
    syntax = call_syntax(model.tokenizer).for_tools([t["function"]["name"] for t in TOOLS])
    ids = encode_chat(model, ASK, TOOLS)
    structure = call_structure(syntax, [Tool.of(t, "t") for t in TOOLS], choice, parallel)
    plain = generate(model, ids, max_new_tokens=48, structure=structure)
    drafted = generate(model, ids, max_new_tokens=48, structure=structure, lookup=True, schedule=Constant(k=4))
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted_tokens > 0
    parsed = parse_calls(syntax, drafted.text)
    if choice != "auto":  # (whether a small model calls is its own choice in "auto"; its calls are checked alike)
        assert parsed.calls and parsed.content == ""
    assert len(parsed.calls) <= 1 or parallel
    for tool, arguments in parsed.calls[:-1] if parsed.unfinished else parsed.calls:
        assert choice in ("auto", "required", tool)
        jsonschema.validate(json.loads(arguments), SCHEMAS[tool])


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


@pytest.fixture(scope="module")
def gemma_server():
    yield from serve("gemma3-270m", "--lookup", "--chat-template", str(GEMMA_TOOLS_TEMPLATE))


CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.integration
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=["none", "auto", "required", "named"])
@pytest.mark.parametrize("model,url", [("smollm2-135m", "server"), ("gemma3-270m", "gemma_server")])
def test_every_tool_choice_with_or_without_parallel_calls_streamed_or_not(request, model, url, choice, parallel):
    """SmolLM2 (the Hermes template) and Gemma-3 (its turns, Hermes calls) under prompt lookup: a 200 for every
    `tool_choice` and `parallel_tool_calls`, its calls valid and as asked, the stream's deltas adding up to the
    whole reply."""
    asked = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                 max_tokens=40)
    whole = tool_reply(client(request.getfixturevalue(url)), stream=False, **asked)
    assert_valid_calls(whole, choice, parallel, SCHEMAS)
    assert tool_reply(client(request.getfixturevalue(url)), stream=True, **asked) == whole


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


@pytest.mark.integration
def test_fuzzed_tools_tool_choice_and_messages_never_get_a_5xx(server):
    """A bounded fuzz (127.0.0.1, 300 requests of 2 tokens at most): every answer is a 200 or a 4xx with OpenAI's
    error body naming the problem."""
    seen = fuzz_for_5xx(f"{server}/v1/chat/completions", tool_bodies(TOOLS, ASK),
                        {"model": "smollm2-135m", "max_tokens": 2}, 300)
    assert seen["ok"] > 5 and seen["refused"] > 5  # (the fuzz reached the engine and the checks both)
