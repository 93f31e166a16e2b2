"""Tool calls on Qwen2.5-Coder's own template, whose markers `<tool_call>` and `</tool_call>` its tokenizer holds as
special tokens: the real `assistgen serve` (llama.cpp, the 0.5B: the 1.5B's template and tokenizer) with prompt
lookup and without a drafter, spoken to with the official openai client. Every `tool_choice` (none, auto, required,
a function) with `parallel_tool_calls` true and false, streamed and not, is a 200 with valid calls, and drafting's
tokens are plain constrained decoding's; a bounded fuzz of tool requests gets no 5xx. Needs the `qwen` extra: `make
test-agents` (CI), not `make test`."""

from __future__ import annotations

import pytest
from helpers import (
    TIME_TOOL,
    assert_valid_calls,
    fuzz_for_5xx,
    openai_client,
    schemas_of,
    serve,
    steps_of,
    tool_bodies,
    tool_reply,
)

from assistgen import load_model
from assistgen.chat.grammar import call_structure
from assistgen.chat.parser import parse_calls
from assistgen.chat.syntax import call_syntax
from assistgen.chat.tools import Tool
from assistgen.core.constraint import Constraint
from assistgen.serving.jobs import Job
from assistgen.serving.replies import CallStream

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = TIME_TOOL
TOOLS = [WEATHER, TIME]
SCHEMAS = schemas_of(TOOLS)
ASK = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture(scope="module")
def qwen():
    return load_model(MODEL, backend="llama.cpp")


@pytest.fixture(scope="module")
def drafting():
    # (a constant schedule: drafts are verified whatever this machine's measured costs say, so that the drafts this
    # file asserts accepted depend on the mechanism, not on one CPU's timing)
    yield from serve(MODEL, "--lookup", "--schedule", "constant:4", timeout=600)


@pytest.fixture(scope="module")
def plain():
    yield from serve(MODEL, timeout=600)


def accepts(model, structure, *texts: str) -> bool:
    """Whether the grammar lets the texts' tokens (as the tokenizer encodes each: markers as their tokens) through."""
    constraint = Constraint.begin(model, structure, {model.tokenizer.eos_token_id})
    for token in [t for text in texts for t in model.tokenizer.encode(text, add_special_tokens=False)]:
        if constraint.check([token]) != (1, None):
            return False
        constraint.advance([token])
    return True


def test_the_markers_are_found_as_special_tokens_named_in_the_grammar_and_read_back(qwen):
    tokenizer = qwen.tokenizer
    syntax = call_syntax(tokenizer).for_tools(["get_weather", "get_time"])
    ids = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert [(s.text, s.token, s.shown) for s in syntax.specials] == [("<tool_call>", ids[0], "<tool_call>"),
                                                                       ("</tool_call>", ids[1], "</tool_call>")]
    assert tokenizer.encode(CALL, add_special_tokens=False)[0] == ids[0]  # (the model writes the token)
    tools = [Tool.of(t, "t") for t in TOOLS]
    for choice in ("required", "get_weather", "auto"):
        structure = call_structure(syntax, tools, choice)
        assert f"<[{ids[0]}]>" in structure.spec and f"<[{ids[1]}]>" in structure.spec
        assert '"<tool_call>' not in structure.spec or choice == "auto"  # (a due call opens with the token)
        assert accepts(qwen, structure, CALL + "\n")
        assert not accepts(qwen, structure, CALL.replace('"city"', '"town"'))
    auto = call_structure(syntax, tools, "auto")
    assert accepts(qwen, auto, "Let me check." + CALL + " Done.")  # (the trigger fires on the token)
    assert not accepts(qwen, auto, 'Let me check.<tool_call>\n{"name": "delete_all"')
    spelled = ["Let me check.<tool", "_call>", CALL[len("<tool_call>"):]]  # (the marker in text tokens: a call too)
    assert accepts(qwen, auto, *spelled) and not accepts(qwen, auto, *spelled[:2], '\n{"name": "delete_all"')
    for seed in range(10):  # (the stream's text shows the token as its marker: the parser reads it)
        chunks = steps_of(tokenizer, "Let me check." + CALL, seed)
        assert parse_calls(syntax, [c.text for c in chunks]).calls == [["get_weather", '{"city": "Paris"}']]
        stream = CallStream(Job([], None, 0.0, calls=syntax))
        finishes = [finish for chunk in chunks for _, finish in stream.read(chunk)]
        assert finishes[-1] == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=["none", "auto", "required", "named"])
def test_every_tool_choice_is_valid_and_drafting_gives_plain_decodings_tokens(drafting, plain, choice, parallel):
    """Streamed and not, with prompt lookup (the grammar's forced text drafted too) and without a drafter: the same
    tokens (read from the logprobs), the same content and calls, valid for their schemas and as asked."""
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                 max_tokens=48, logprobs=True)
    whole = tool_reply(openai_client(drafting, "qwen"), stream=False, **asked)
    streamed = tool_reply(openai_client(drafting, "qwen"), stream=True, **asked)
    undrafted = tool_reply(openai_client(plain, "qwen"), stream=False, **asked)
    assert whole.tokens and whole == streamed == undrafted
    assert_valid_calls(whole, choice, parallel, SCHEMAS)
    if choice not in ("none", "auto"):
        assert whole.tokens[0] == "<tool_call>" and whole.accepted > 0  # (the special token; drafts accepted)


def test_fuzzed_tool_requests_on_qwens_template_never_get_a_5xx(drafting):
    """A bounded fuzz (127.0.0.1; 150 requests of 4 tokens at most, 4 minutes at most): every answer is a 200 or a
    4xx whose error names the field at fault."""
    seen = fuzz_for_5xx(f"{drafting}/v1/chat/completions", tool_bodies(TOOLS, ASK),
                        {"model": MODEL, "max_tokens": 4}, 150, seconds=240, named=True)
    assert seen["ok"] > 5 and seen["refused"] > 5  # (the fuzz reached the engine and the checks both)
