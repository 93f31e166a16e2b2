"""End-to-end agent loops (`make test-agents`): the real `assistgen serve` on Qwen2.5-Coder-1.5B (llama.cpp, prompt
lookup and the n-gram cache) driven by agent frameworks nobody here wrote: openai-agents (its chat-completions model
and its Responses model), pydantic-ai and langchain's `bind_tools`. Each runs tasks of `benchmarks/agent_loops.py` (one
tool; two tools chained; a tool's output quoted back): every loop must end with an answer, every call valid for its
tool's schema, the one-tool task answered right, with drafts accepted by the server along the way (its /metrics).
And every forced-tool mode of those frameworks: openai-agents' `tool_choice` "required" and a named tool,
pydantic-ai's output tool, langchain's `with_structured_output(method="function_calling")`: each request forces the
call, and the call is valid and right."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agent_loops import (  # noqa: E402 (benchmarks/agent_loops.py)
    INSTRUCTIONS,
    TASKS,
    Outcome,
    Recorder,
    lookup_order,
    recorded,
    run_task,
)
from helpers import start_serve_command  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
CHOSEN = ("order", "user-weather", "quote-file")  # one tool, two chained, an output quoted back


@pytest.fixture(scope="module")
def server():
    process, port = start_serve_command("--model", MODEL, "--backend", "llama.cpp", "--lookup", "--ngram-cache",
                                        timeout=300)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def accepted_drafts(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^assistgen:spec_decode_num_accepted_tokens_total\S* (\S+)$", text,
                                            re.MULTILINE))


@pytest.mark.parametrize("framework", ["agents-chat", "agents-responses", "pydantic-ai", "langchain"])
def test_agent_loops_run_end_to_end_with_valid_calls(server, framework):
    """Each loop ends with an answer, its calls valid for their schemas (the framework parsed and ran them), drafts
    accepted on the way; the one-tool task's answer quotes the tool's output. (Whether a 1.5B model chains two tools
    right is the model's: benchmarks/agent_loops.py measures it, docs/benchmarks.md records it.)"""
    before = accepted_drafts(server)
    recorder = Recorder()
    outcomes = {t.name: (t, asyncio.run(run_task(framework, f"{server}/v1", MODEL, t, recorder)))
                for t in TASKS if t.name in CHOSEN}
    for name, (_, outcome) in outcomes.items():
        assert outcome.error is None and outcome.answer.strip(), (name, outcome)
        assert not outcome.invalid, (name, outcome)
    assert sum(len(o.calls) for _, o in outcomes.values()) >= len(CHOSEN) - 1  # (the model called, the loop ran)
    task, outcome = outcomes["order"]
    assert outcome.passed(task), outcome
    assert recorder.bodies or framework == "agents-responses"  # (the chat requests went through this client)
    assert accepted_drafts(server) > before


# --- forced tools: the modes in which a framework makes the model call (tool_choice "required" or a function) ----

class Shipment(BaseModel):
    """Where an order is: its id and the carrier's tracking number."""

    order_id: str
    tracking_number: str


SHIPMENT_TEXT = "Order A-1234 shipped on 2026-11-30 with DHL, tracking number ZX-4471-QP. Fill in the shipment."


def forced_choices(recorder: Recorder) -> list:
    """The tool_choice of every chat request the framework sent that forced a call ("required" or a function)."""
    return [b["tool_choice"] for b in recorder.bodies if b.get("tool_choice") not in (None, "auto", "none")]


async def agents_forced(url: str, choice: str, recorder: Recorder, outcome: Outcome) -> str:
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url, api_key="agents", http_client=recorder.client(), max_retries=0)
    agent = Agent(name="assistant", instructions=INSTRUCTIONS, tools=[function_tool(recorded(lookup_order, outcome))],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice=choice), tool_use_behavior="stop_on_first_tool")
    return str((await Runner.run(agent, "Where is my order A-1234?", max_turns=3)).final_output)


async def pydantic_ai_output_tool(url: str, recorder: Recorder) -> Shipment:
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=url, api_key="pydantic-ai", http_client=recorder.client(), max_retries=0)
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=Shipment)
    return (await agent.run(SHIPMENT_TEXT)).output


async def langchain_structured(url: str, recorder: Recorder) -> Shipment:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=url, api_key="langchain", temperature=0, max_retries=0,
                      http_async_client=recorder.client())
    return await chat.with_structured_output(Shipment, method="function_calling").ainvoke(SHIPMENT_TEXT)


@pytest.mark.parametrize("choice", ["required", "lookup_order"])
def test_openai_agents_forcing_a_tool_gets_a_valid_call(server, choice):
    """openai-agents with `ModelSettings(tool_choice=...)`: the request forces the call, the call is valid and the run
    ends on the tool's output."""
    recorder, outcome = Recorder(), Outcome("forced")
    answer = asyncio.run(agents_forced(f"{server}/v1", choice, recorder, outcome))
    assert forced_choices(recorder)  # (the framework forced the call)
    assert outcome.calls and not outcome.invalid, outcome
    assert outcome.calls[0] == ("lookup_order", {"order_id": "A-1234"}) and "ZX-4471-QP" in answer


def test_pydantic_ai_output_tool_and_langchain_structured_output_force_their_function(server):
    """pydantic-ai's output tool (`output_type=`: tool_choice "required") and langchain's
    `with_structured_output(method="function_calling")` (tool_choice naming the function) get their object."""
    url = f"{server}/v1"
    for run in (pydantic_ai_output_tool, langchain_structured):
        recorder = Recorder()
        shipment = asyncio.run(run(url, recorder))
        assert forced_choices(recorder), run.__name__
        assert isinstance(shipment, Shipment) and shipment.tracking_number == "ZX-4471-QP", (run.__name__, shipment)
        assert "1234" in shipment.order_id
