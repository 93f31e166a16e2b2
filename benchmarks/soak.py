"""A soak of the real server: N clients for M minutes of mixed traffic on 127.0.0.1, bounded in count and time.

Contract: starts `assistgen serve` (`--model`, `--backend`, lookup drafting, an API key, `--chat-template`,
`--max-tokens-limit`, and any `--server-flags`) on a free 127.0.0.1 port; takes each greedy prompt's single-request
answer first (one request at a time: the reference); then runs `--clients` clients at once until `--minutes` pass
or `--max-requests` are sent, each picking at random (seeded) one of:
    chat        a greedy chat completion (official `openai` client), its text compared with its single run
    stream      a greedy streamed completion, read to its end, compared with its single run
    abort       a streamed completion closed after its second chunk
    timeout     a completion given a client timeout far shorter than it takes (abandoned)
    json        a chat completion under a JSON schema (its text must parse, with the schema's keys)
    tools       a chat completion offered a tool, the choice "required" (a call must come back: the server runs a
                chat template that renders tools, `--chat-template`, tests/data/hermes_tools.jinja by default)
    logprobs    a completion with logprobs (one per token)
    bad         a malformed body, an unknown key, a 5 MiB body past --max-body, a field out of range, 4 MiB of empty
                lists (too many JSON items), or 17 stop strings
Counts every answer by status (a transport error that is not the client's own abort or timeout is a dropped
connection), the latency of every answered request, and samples the server's RSS (VmRSS) every second: after the
reference runs, its peak, its end, and at the end of each minute (growth shows as a rising series); the end is
judged against the first minute's (the warm-up: the allocator's high-water mark of every client at once).
Prints a table and one JSON line; exits 1 when any answer was 5xx, any connection dropped, or any greedy answer
differed from its single run.

    python benchmarks/soak.py --clients 16 --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from serve_load import free_port, peak_rss_mb, percentile, start_server  # noqa: E402

from assistgen.backends.machine import cpu_summary  # noqa: E402

KEY = "soak-key"
PROMPTS = [
    "Write a Python function that reverses a string.",
    "List three facts about the Moon.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Explain what a hash map is in two sentences.",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Name four primary colours of light and pigment.",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOL_TOKENS = 64  # room for a whole call
TEMPLATE = HERE.parent / "tests" / "data" / "hermes_tools.jinja"
KINDS = ("chat", "stream", "abort", "timeout", "json", "tools", "logprobs", "bad")
WEIGHTS = (4, 4, 1, 1, 1, 1, 1, 2)


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


class Tally:
    def __init__(self):
        self.status: Counter = Counter()
        self.kinds: Counter = Counter()
        self.latency: list[float] = []
        self.dropped: list[str] = []
        self.differed: list[str] = []
        self.invalid: list[str] = []
        self.sent = 0


async def chat(client, model: str, prompt: str, max_tokens: int) -> str:
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


async def stream(client, model: str, prompt: str, max_tokens: int, stop_after: int | None = None) -> str:
    parts = []
    events = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    async for event in events:
        parts.append(event.choices[0].text)
        if stop_after is not None and len(parts) >= stop_after:
            await events.close()
            break
    return "".join(parts)


async def bad(http: httpx.AsyncClient, url: str, model: str, rng: random.Random) -> int:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    which = rng.randrange(6)
    if which == 0:
        r = await http.post(f"{url}/chat/completions", content=b'{"model": "x", "messages": [', headers=auth)
    elif which == 1:
        r = await http.post(f"{url}/completions", json={"model": model, "prompt": "Hi"},
                            headers={"Authorization": "Bearer not-a-key"})
    elif which == 2:
        r = await http.post(f"{url}/completions", content=b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', headers=auth)
    elif which == 3:
        r = await http.post(f"{url}/completions", json={"model": model, "prompt": "Hi", "temperature": -3},
                            headers=auth)
    elif which == 4:
        r = await http.post(f"{url}/completions", content=b'{"prompt": "Hi", "stop": [' + b"[]," * 1_390_000 + b"[]]}",
                            headers=auth)
    else:
        r = await http.post(f"{url}/completions", json={"model": model, "prompt": "Hi", "stop": ["x"] * 17},
                            headers=auth)
    return r.status_code


async def one(kind: str, rng: random.Random, clients: tuple, url: str, args, reference: dict, tally: Tally) -> None:
    client, quick, http = clients
    prompt = rng.choice(PROMPTS)
    start = time.perf_counter()
    try:
        if kind == "chat":
            text = await chat(client, args.model, prompt, args.max_tokens)
            if text != reference[("chat", prompt)]:
                tally.differed.append(f"chat: {prompt[:30]}")
        elif kind == "stream":
            text = await stream(client, args.model, prompt, args.max_tokens)
            if text != reference[("stream", prompt)]:
                tally.differed.append(f"stream: {prompt[:30]}")
        elif kind == "abort":
            await stream(client, args.model, prompt, args.max_tokens, stop_after=2)
        elif kind == "timeout":
            try:
                await quick.completions.create(model=args.model, prompt=prompt, max_tokens=args.max_tokens)
            except (openai.APITimeoutError, httpx.TimeoutException):
                tally.status["client timeout"] += 1
                return
        elif kind == "json":
            reply = await client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": "Anna is 41. Her name and age as JSON."}],
                max_tokens=args.max_tokens, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
            if reply.choices[0].finish_reason == "stop" and set(json.loads(reply.choices[0].message.content)) != {
                    "name", "age"}:
                tally.invalid.append("json")
        elif kind == "tools":
            reply = await client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                tools=[TOOL], tool_choice="required", max_tokens=TOOL_TOKENS, temperature=0)
            calls = reply.choices[0].message.tool_calls or []
            if reply.choices[0].finish_reason != "tool_calls" or not calls or calls[0].function.name != "weather":
                tally.invalid.append("tools")
            else:
                json.loads(calls[0].function.arguments)  # (raises, counted invalid below, unless it parses)
        elif kind == "logprobs":
            reply = await client.completions.create(model=args.model, prompt=prompt, max_tokens=args.max_tokens,
                                                    temperature=0, logprobs=1)
            if len(reply.choices[0].logprobs.tokens) != reply.usage.completion_tokens:
                tally.invalid.append("logprobs")
        else:
            tally.status[await bad(http, url, args.model, rng)] += 1
            tally.latency.append(time.perf_counter() - start)
            return
        tally.status[200] += 1
        tally.latency.append(time.perf_counter() - start)
    except openai.APIStatusError as e:
        tally.status[e.status_code] += 1
    except (openai.APIConnectionError, httpx.TransportError) as e:
        tally.dropped.append(f"{kind}: {type(e).__name__}: {e}")
    except json.JSONDecodeError:
        tally.invalid.append(kind)


async def client_loop(i: int, url: str, args, reference: dict, tally: Tally, end: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY, timeout=300, max_retries=0)
    quick = openai.AsyncOpenAI(base_url=url, api_key=KEY, timeout=0.05, max_retries=0)
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < end and tally.sent < args.max_requests:
            tally.sent += 1
            kind = rng.choices(KINDS, WEIGHTS)[0]
            tally.kinds[kind] += 1
            await one(kind, rng, (client, quick, http), url, args, reference, tally)
    await client.close()
    await quick.close()


async def references(url: str, args) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY, timeout=300, max_retries=0)
    out = {}
    for prompt in PROMPTS:
        out[("chat", prompt)] = await chat(client, args.model, prompt, args.max_tokens)
        out[("stream", prompt)] = await stream(client, args.model, prompt, args.max_tokens)
    await client.close()
    return out


async def sample_rss(pid: int, series: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        series.append(rss_mb(pid))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def soak(url: str, args, pid: int) -> dict:
    reference = await references(url, args)
    warm = rss_mb(pid)
    tally, series, stop = Tally(), [], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, series, stop))
    started = time.monotonic()
    end = started + args.minutes * 60
    await asyncio.gather(*(client_loop(i, url, args, reference, tally, end) for i in range(args.clients)))
    stop.set()
    await sampler
    seconds = time.monotonic() - started
    minutes = [series[min(len(series) - 1, 60 * (m + 1) - 1)] for m in range(int(len(series) // 60))]
    return {"clients": args.clients, "seconds": round(seconds, 1), "requests": tally.sent,
            "kinds": dict(tally.kinds), "status": {str(k): v for k, v in sorted(tally.status.items(), key=str)},
            "5xx": sum(v for k, v in tally.status.items() if isinstance(k, int) and k >= 500),
            "dropped": tally.dropped[:10], "dropped_count": len(tally.dropped),
            "differed": tally.differed[:10], "differed_count": len(tally.differed), "invalid": tally.invalid[:10],
            "latency_p50_s": round(percentile(tally.latency, 50), 3),
            "latency_p99_s": round(percentile(tally.latency, 99), 3),
            "rss_warm_mb": round(warm, 1), "rss_peak_mb": round(max(series, default=warm), 1),
            "rss_end_mb": round(rss_mb(pid), 1), "rss_each_minute_mb": [round(x, 1) for x in minutes],
            "rss_growth_after_first_minute": round(rss_mb(pid) / minutes[0] - 1, 4) if minutes else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-requests", type=int, default=20_000, help="the most requests sent in all")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template", default=str(TEMPLATE), help="a template that renders tools")
    parser.add_argument("--server-flags", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    port = free_port()
    command = [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--backend", args.backend,
               "--lookup", "--api-key", KEY, "--chat-template", args.chat_template,
               "--max-tokens-limit", str(max(args.max_tokens, TOOL_TOKENS)), "--port", str(port),
               *args.server_flags]
    process = start_server(command, port, timeout=600)
    try:
        result = asyncio.run(soak(f"http://127.0.0.1:{port}/v1", args, process.pid))
        result["peak_rss_hwm_mb"] = round(peak_rss_mb(process), 1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            result_exit = process.wait(120)
        except Exception:  # noqa: BLE001
            process.kill()
            result_exit = None
    result.update(model=args.model, machine=cpu_summary(), exit_status=result_exit)
    print(f"soak: {args.model}, {args.clients} clients, {result['seconds']} s, on {result['machine']}")
    print(f"requests {result['requests']}  by kind {result['kinds']}")
    print(f"status {result['status']}  5xx {result['5xx']}  dropped {result['dropped_count']}  "
          f"greedy answers differing from their single run {result['differed_count']}  invalid {result['invalid']}")
    print(f"latency p50 {result['latency_p50_s']} s  p99 {result['latency_p99_s']} s")
    print(f"RSS MiB: after warm-up {result['rss_warm_mb']}, peak {result['rss_peak_mb']}, end {result['rss_end_mb']}; "
          f"each minute {result['rss_each_minute_mb']} (end against the first minute: "
          f"{result['rss_growth_after_first_minute']}); server exit status {result_exit}")
    print(json.dumps({"benchmark": "soak", **result}))
    failed = result["5xx"] or result["dropped_count"] or result["differed_count"] or result["invalid"] or result_exit
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
