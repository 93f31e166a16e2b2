"""End-to-end agent loops (`make test-agents`): the real `assistgen serve` on Qwen2.5-Coder-1.5B (llama.cpp, prompt
lookup and the n-gram cache) driven by agent frameworks nobody here wrote: openai-agents (its chat-completions model
and its Responses model), pydantic-ai and langchain's `bind_tools`. Each runs tasks of `benchmarks/agent_loops.py` (one
tool; two tools chained; a tool's output quoted back): every loop must end with an answer, every call valid for its
tool's schema, the one-tool task answered right, with drafts accepted by the server along the way (its /metrics)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agent_loops import TASKS, Recorder, run_task  # noqa: E402 (benchmarks/agent_loops.py)
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
