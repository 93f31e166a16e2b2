"""End-to-end agent loops (`make test-agents`): the real `assistgen serve` on Qwen2.5-Coder-1.5B (llama.cpp, prompt
lookup and the n-gram cache) driven by agent frameworks nobody here wrote: openai-agents (its chat-completions model
and its Responses model), pydantic-ai and langchain's `bind_tools`. Each runs tasks of `benchmarks/agent_loops.py` (one
tool; two tools chained; a tool's output quoted back) and must answer right, every call valid for its tool's schema,
with drafts accepted by the server along the way (its /metrics)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent_loops import TASKS, Recorder, run_task  # noqa: E402 (benchmarks/agent_loops.py)
from helpers import start_serve_command  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
CHOSEN = ("weather", "user-weather", "quote-file")  # one tool, two chained, an output quoted back


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
def test_agent_loops_answer_right_with_valid_calls(server, framework):
    before = accepted_drafts(server)
    recorder = Recorder()
    for task in (t for t in TASKS if t.name in CHOSEN):
        outcome = asyncio.run(run_task(framework, f"{server}/v1", MODEL, task, recorder))
        assert outcome.passed(task), (task.name, outcome)
        assert outcome.calls and not outcome.invalid
    assert recorder.bodies or framework == "agents-responses"  # (the requests went to this server)
    assert accepted_drafts(server) > before
