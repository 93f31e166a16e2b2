"""Agent loops against an OpenAI-compatible server, through agent frameworks nobody here wrote.

Contract: `TASKS` are ten tool-use tasks (one tool; two tools chained, the second fed the first's output; a tool's
output that must be quoted back), each with plain Python tools (typed arguments, a docstring: what frameworks read
to build a tool's schema), a question and what a right final answer contains. `RUNNERS` runs one task through one
framework against a server's /v1 URL: openai-agents with its chat-completions model (`agents-chat`) and its
Responses model (`agents-responses`), pydantic-ai (`pydantic-ai`), langchain's `bind_tools` with the loop written
out (`langchain`). A task passes when the answer contains what it must and every tool it needs was called; every
call's arguments are checked against the tool's schema (`Outcome.invalid`). Every request a framework sends is
recorded (`Recorder`): `--replay` sends the tool-call turns again, non-streamed, to one server per `--configs`
(assistgen plain and with drafting) and compares their decode speed and acceptance, the same requests for each.
`python benchmarks/agent_loops.py --model qwen2.5-coder-1.5b [--frameworks ...] [--replay]` starts the server
(`assistgen serve --backend llama.cpp`, the drafting flags of `--serve-flags`), prints a table per framework and
one JSON line. Needs `pip install openai-agents pydantic-ai-slim[openai] langchain-openai` (`make test-agents`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_load import free_port, start_server, stop_server  # noqa: E402

# --- the tools ----------------------------------------------------------------------------------------------


def get_weather(city: str) -> str:
    """The current weather in a city: temperature in degrees celsius and the sky."""
    return {"paris": "18 degrees celsius, sunny", "lyon": "12 degrees celsius, light rain",
            "oslo": "-3 degrees celsius, snow"}.get(city.split(",")[0].strip().lower(), "21 degrees celsius, clear")


def convert_currency(amount: float, source: str, target: str) -> str:
    """Convert an amount of money from the source currency to the target currency (ISO codes such as USD)."""
    rates = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0}
    value = amount / rates.get(source.upper(), 1.0) * rates.get(target.upper(), 1.0)
    return f"{amount:g} {source.upper()} = {value:.2f} {target.upper()}"


def lookup_order(order_id: str) -> str:
    """The shipping status of an order, by its id (for example A-1234)."""
    return f"Order {order_id}: shipped on 2026-11-30 with DHL, tracking number ZX-4471-QP."


def get_user_city(username: str) -> str:
    """The city a user of the service lives in, by username."""
    return {"alice": "Lyon", "bob": "Oslo"}.get(username.strip().lower(), "Paris")


def search_docs(query: str) -> str:
    """Search the internal documentation; returns the id of the best matching document."""
    return "Best match: document DOC-77 (Deployment guide)."


def read_doc(doc_id: str) -> str:
    """The full text of an internal document, by its id (for example DOC-12)."""
    return f"{doc_id}: To deploy, run `make release`. The deploy key is K9-PLUM-2231."


def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


def get_stock_price(ticker: str) -> float:
    """The latest price of one share of a stock, in US dollars, by its ticker symbol."""
    return {"ACME": 187.5, "INITECH": 42.25}.get(ticker.strip().upper(), 10.0)


def multiply(a: float, b: float) -> float:
    """The product of two numbers."""
    return a * b


def read_file(path: str) -> str:
    """The contents of a file in the user's project."""
    return "def greet(name):\n    return f'Hello, {name}!'\n"


def get_time(timezone: str) -> str:
    """The current local time in a time zone (an IANA name such as Europe/Paris)."""
    return f"It is 14:05 in {timezone}."


@dataclass(frozen=True)
class Task:
    name: str
    question: str
    tools: tuple[Callable, ...]
    needs: tuple[str, ...]  # tools that must be called
    expect: tuple[str, ...]  # what the final answer must contain (any of the spellings in each group, "|")


TASKS = [
    Task("weather", "What is the weather in Paris right now?", (get_weather, get_time), ("get_weather",), ("18",)),
    Task("currency", "How much is 100 USD in EUR?", (convert_currency,), ("convert_currency",), ("92",)),
    Task("order", "Where is my order A-1234? Give me the tracking number.", (lookup_order,), ("lookup_order",),
         ("ZX-4471-QP",)),
    Task("time", "What time is it in Tokyo (Asia/Tokyo)?", (get_time, get_weather), ("get_time",), ("14:05",)),
    Task("add", "Use the add tool: what is 1234 + 5678?", (add,), ("add",), ("6912|6,912",)),
    Task("user-weather", "What is the weather where the user alice lives? First find her city, then its weather.",
         (get_user_city, get_weather), ("get_user_city", "get_weather"), ("12",)),
    Task("docs", "Find the deployment guide in the docs and tell me the deploy key written in it.",
         (search_docs, read_doc), ("search_docs", "read_doc"), ("K9-PLUM-2231",)),
    Task("shares", "What are 10 shares of ACME worth? Get the price, then multiply it by 10 with the tool.",
         (get_stock_price, multiply), ("get_stock_price", "multiply"), ("1875|1,875",)),
    Task("quote-file", "Show me the exact contents of greet.py, quoted in full.", (read_file,), ("read_file",),
         ("return f'Hello, {name}!'",)),
    Task("convert-twice", "Convert 50 GBP to JPY for me.", (convert_currency, get_time), ("convert_currency",),
         ("9556|9,556",)),
]
INSTRUCTIONS = ("You are a helpful assistant. Use the tools to get facts. When a tool has answered, reply to the user "
                "in plain words.")


def schema_of(fn: Callable) -> dict:
    """The JSON schema of a tool's arguments, from its signature (what a call's arguments are checked against)."""
    import inspect

    kinds = {str: "string", int: "integer", float: "number"}
    hints = {k: eval(v) if isinstance(v, str) else v for k, v in fn.__annotations__.items() if k != "return"}
    params = inspect.signature(fn).parameters
    return {"type": "object", "properties": {n: {"type": kinds[hints[n]]} for n in params},
            "required": list(params)}


@dataclass
class Outcome:
    task: str
    answer: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # calls whose arguments broke the tool's schema
    error: str | None = None
    seconds: float = 0.0

    def passed(self, task: Task) -> bool:
        called = {name for name, _ in self.calls}
        said = self.answer.replace("**", "")
        return (self.error is None and not self.invalid and all(n in called for n in task.needs)
                and all(any(s in said for s in group.split("|")) for group in task.expect))


def recorded(fn: Callable, outcome: Outcome) -> Callable:
    """The tool, recording each call and checking its arguments against the tool's schema."""
    import functools
    import inspect

    import jsonschema

    @functools.wraps(fn)
    def tool(*args, **kwargs):
        given = dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
        outcome.calls.append((fn.__name__, given))
        try:
            jsonschema.validate(given, schema_of(fn))
        except jsonschema.ValidationError as e:
            outcome.invalid.append(f"{fn.__name__}: {e.message}")
        return fn(**given)

    return tool


class Recorder:
    """httpx event hooks that keep every request body a framework sends to /chat/completions (for --replay)."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=600, event_hooks={"request": [self]})


# --- the frameworks -----------------------------------------------------------------------------------------


async def run_openai_agents(url: str, model: str, task: Task, outcome: Outcome, recorder: Recorder,
                            responses: bool = False) -> None:
    import openai
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url, api_key="agents", http_client=recorder.client(), max_retries=2)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="assistant", instructions=INSTRUCTIONS, model=kind(model=model, openai_client=client),
                  tools=[function_tool(recorded(t, outcome)) for t in task.tools])
    result = await Runner.run(agent, task.question, max_turns=6)
    outcome.answer = str(result.final_output)


async def run_pydantic_ai(url: str, model: str, task: Task, outcome: Outcome, recorder: Recorder) -> None:
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=url, api_key="pydantic-ai", http_client=recorder.client(), max_retries=2)
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client)), instructions=INSTRUCTIONS,
                  tools=[recorded(t, outcome) for t in task.tools])
    result = await agent.run(task.question)
    outcome.answer = str(result.output)


async def run_langchain(url: str, model: str, task: Task, outcome: Outcome, recorder: Recorder) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool as as_tool
    from langchain_openai import ChatOpenAI

    tools = {t.__name__: as_tool(recorded(t, outcome)) for t in task.tools}
    chat = ChatOpenAI(model=model, base_url=url, api_key="langchain", temperature=0, max_retries=2,
                      http_async_client=recorder.client()).bind_tools(list(tools.values()))
    messages = ([SystemMessage(INSTRUCTIONS)] if INSTRUCTIONS else []) + [HumanMessage(task.question)]
    for _ in range(6):
        reply = await chat.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            outcome.answer = str(reply.content)
            return
        for call in reply.tool_calls:
            messages.append(ToolMessage(str(tools[call["name"]].invoke(call["args"])), tool_call_id=call["id"]))
    outcome.error = "no answer after 6 turns"


RUNNERS = {"agents-chat": run_openai_agents,
           "agents-responses": lambda *a: run_openai_agents(*a, responses=True),
           "pydantic-ai": run_pydantic_ai, "langchain": run_langchain}


async def run_task(framework: str, url: str, model: str, task: Task, recorder: Recorder) -> Outcome:
    outcome = Outcome(task.name)
    started = time.perf_counter()
    try:
        await RUNNERS[framework](url, model, task, outcome, recorder)
    except Exception as e:  # (a framework's own failure is the task's failure: reported, the run goes on)
        outcome.error = f"{type(e).__name__}: {str(e)[:200]}"
    outcome.seconds = time.perf_counter() - started
    return outcome


# --- replaying the tool-call turns --------------------------------------------------------------------------


async def replay(url: str, bodies: list[dict]) -> dict:
    """The recorded requests sent again, streamed, one at a time: totals over the turns that called tools (decode
    time: from the first token's chunk to the last; acceptance from the server's `metrics.speculative_decoding`)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="replay", max_retries=2, timeout=600)
    out = {"turns": 0, "tokens": 0, "seconds": 0.0, "decode_seconds": 0.0, "drafted": 0, "accepted": 0,
           "replies": []}
    for body in bodies:
        body = {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": True,
                "stream_options": {"include_usage": True}}
        started, first, text, calls, spec, tokens = time.perf_counter(), None, "", {}, {}, 0
        async for event in await client.chat.completions.create(**body):
            if event.usage is not None:
                tokens = event.usage.completion_tokens
            for choice in event.choices:
                if choice.delta.content or choice.delta.tool_calls:  # (not the opening role chunk)
                    first = first or time.perf_counter()
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    calls.setdefault(call.index, ["", ""])
                    calls[call.index][0] += call.function.name or ""
                    calls[call.index][1] += call.function.arguments or ""
                spec = ((event.model_extra or {}).get("metrics") or {}).get("speculative_decoding") or spec
        ended = time.perf_counter()
        out["replies"].append([text, [calls[i] for i in sorted(calls)]])
        if not calls:
            continue
        out["turns"] += 1
        out["tokens"] += tokens
        out["seconds"] += ended - started
        out["decode_seconds"] += ended - (first or started)
        out["drafted"] += spec.get("num_draft_tokens", 0)
        out["accepted"] += spec.get("num_accepted_draft_tokens", 0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--frameworks", nargs="+", choices=list(RUNNERS), default=list(RUNNERS))
    parser.add_argument("--tasks", nargs="+", choices=[t.name for t in TASKS], help="default: all ten")
    parser.add_argument("--serve-flags", default="--lookup --ngram-cache", help="assistgen serve's drafting flags")
    parser.add_argument("--replay", action="store_true", help="replay the tool-call turns: plain vs --serve-flags")
    parser.add_argument("--requests", type=Path, help="with --replay: write the recorded requests here (JSON)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    tasks = [t for t in TASKS if args.tasks is None or t.name in args.tasks]

    def serve(flags: str):
        port = free_port()
        command = [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--backend",
                   "llama.cpp", "--port", str(port), *flags.split()]
        return start_server(command, port, args.start_timeout), f"http://127.0.0.1:{port}/v1"

    recorder, rows = Recorder(), []
    process, url = serve(args.serve_flags)
    try:
        for framework in args.frameworks:
            outcomes = [asyncio.run(run_task(framework, url, args.model, t, recorder)) for t in tasks]
            passed = sum(o.passed(t) for o, t in zip(outcomes, tasks, strict=True))
            for o, t in zip(outcomes, tasks, strict=True):
                print(f"  {framework:17s} {t.name:14s} {'pass' if o.passed(t) else 'FAIL'} {o.seconds:6.1f} s "
                      f"calls={[n for n, _ in o.calls]} {o.error or ''} answer={o.answer[:100]!r}", flush=True)
            rows.append({"framework": framework, "passed": passed, "tasks": len(tasks),
                         "calls": sum(len(o.calls) for o in outcomes),
                         "invalid_calls": sum(len(o.invalid) for o in outcomes),
                         "errors": sum(o.error is not None for o in outcomes),
                         "seconds": sum(o.seconds for o in outcomes)})
    finally:
        stop_server(process)
    print(f"\n{'framework':17s} {'passed':>8s} {'calls':>6s} {'invalid':>8s} {'errors':>7s} {'wall s':>7s}")
    for r in rows:
        print(f"{r['framework']:17s} {r['passed']:>4d}/{r['tasks']:<3d} {r['calls']:>6d} {r['invalid_calls']:>8d} "
              f"{r['errors']:>7d} {r['seconds']:>7.1f}")
    result = {"model": args.model, "serve_flags": args.serve_flags, "rows": rows}
    if args.replay:
        if args.requests:
            args.requests.write_text(json.dumps(recorder.bodies))
        result["replay"] = {}
        for name, flags in (("plain", ""), ("drafting", args.serve_flags)):
            process, url = serve(flags)
            try:
                result["replay"][name] = asyncio.run(replay(url, recorder.bodies))
            finally:
                stop_server(process)
        plain, drafting = result["replay"]["plain"], result["replay"]["drafting"]
        same = plain.pop("replies") == drafting.pop("replies")
        print(f"\nreplayed {len(recorder.bodies)} requests, {plain['turns']} tool-call turns; "
              f"identical replies: {same}")
        for name, r in result["replay"].items():
            print(f"{name:9s} {r['tokens']:5d} tokens {r['seconds']:7.1f} s (decoding {r['decode_seconds']:6.1f} s, "
                  f"{r['tokens'] / r['decode_seconds']:6.1f} tok/s) accepted {r['accepted']}/{r['drafted']}")
        print(f"drafting vs plain in tool-call turns: {plain['seconds'] / drafting['seconds']:.2f}x end to end, "
              f"{plain['decode_seconds'] / drafting['decode_seconds']:.2f}x decoding")
        result["replay_identical"] = same
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
