"""The work one request costs the server, counted: its grammar compiled once (llguidance matchers built: one per
request with tools, one per request with a schema, one for n choices), its chat template rendered once (the
template's opening, which prefix sharing needs, rendered once per template and first role, then kept). The real app
over SmolLM2 on llama.cpp with a template that renders tools, spoken to with the official `openai` client."""

from __future__ import annotations

import llguidance
import openai
import pytest
from helpers import TIME_TOOL, TOOLS_TEMPLATE, start, stop

from assistgen import load_model
from assistgen.chat.templates import use_chat_template

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Counting:
    """llguidance's LLMatcher, counting the matchers built (each one a grammar compiled for a tokenizer)."""

    def __init__(self, real):
        self.real, self.built = real, 0

    def __call__(self, *args, **kwargs):
        self.built += 1
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def served():
    model = use_chat_template(load_model(NAME, backend="llama.cpp"), str(TOOLS_TEMPLATE))
    live = start(model, max_tokens_limit=24)
    yield live, model
    stop(live)


def counted(served, monkeypatch, **request) -> tuple[int, int]:
    """(matchers built, template renders) for one chat completion."""
    live, model = served
    matchers = Counting(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", matchers)
    renders = []
    real = model.tokenizer.apply_chat_template
    monkeypatch.setattr(model.tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or real(*a, **k))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="k", timeout=120, max_retries=0)
    reply = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=16, **request)
    assert reply.usage.completion_tokens > 0
    monkeypatch.undo()
    return matchers.built, len(renders)


def test_a_request_compiles_its_grammar_once_and_renders_its_template_once(served, monkeypatch):
    counted(served, monkeypatch)  # (the template's opening for a first "user" message, rendered once and kept)
    assert counted(served, monkeypatch) == (0, 1)
    assert counted(served, monkeypatch, tools=[TIME_TOOL], tool_choice="required") == (1, 1)
    assert counted(served, monkeypatch, tools=[TIME_TOOL, TIME_TOOL | {"function": {
        **TIME_TOOL["function"], "name": "get_time_too"}}]) == (1, 1)
    assert counted(served, monkeypatch, response_format=SCHEMA) == (1, 1)
    assert counted(served, monkeypatch, response_format=SCHEMA, n=3) == (1, 1)  # (each choice a copy of it)
