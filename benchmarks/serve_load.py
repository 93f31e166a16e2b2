"""Load test of `assistgen serve`: aggregate tok/s and latency under 1..16 concurrent streaming clients.

Contract: for each configuration (plain: no drafter; lookup: `--lookup` speculation) it starts the server
itself (`python -m assistgen.cli.main serve` on a free 127.0.0.1 port), and for each concurrency c runs c
clients sharing `--round-requests` streamed chat completions (each client takes the next prompt when its
last one is done) over prompts of the suite (first turn of each record, optionally of some
`--categories` only, cycled in a fixed order: every configuration gets the same requests), then stops the
server. It measures aggregate completion tokens per second
(tokens of all requests / wall time of the round), p50/p95 time to first token and inter-token latency
(the gap between successive streamed text chunks as the client sees them: one per verification step,
which may carry several tokens). Prints a table, the speculation / plain ratio per concurrency, then one
JSON line; writes a PNG of tok/s vs concurrency.

    python benchmarks/serve_load.py --model smollm2-135m --concurrency 1 2 4 8 16 --round-requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from assistgen.bench.dataset import default_suite, read_prompts

CONFIGS = {"plain": [], "lookup": ["--lookup"]}


@dataclass
class Round:
    config: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def row(self) -> dict:
        return {"config": self.config, "concurrency": self.concurrency, "tokens": self.tokens,
                "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "ttft_p50": percentile(self.ttft, 50), "ttft_p95": percentile(self.ttft, 95),
                "itl_p50": percentile(self.itl, 50), "itl_p95": percentile(self.itl, 95)}


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, flags: list[str], port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--port", str(port), *flags]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError("the server did not start in time")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()  # SIGTERM: uvicorn shuts down, running requests finish
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, result: Round):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    last = None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                result.tokens += event["usage"]["completion_tokens"]
            content = "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
            if not content:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft.append(now - started)
            else:
                result.itl.append(now - last)
            last = now


async def run_round(url: str, args, config: str, concurrency: int, prompts: list[str]) -> Round:
    result = Round(config, concurrency)

    queue = list(range(args.round_requests))

    async def client(http: httpx.AsyncClient):
        while queue:
            prompt = prompts[queue.pop(0) % len(prompts)]
            await one_request(http, url, args.model, prompt, args.max_tokens, result)

    async with httpx.AsyncClient(timeout=args.request_timeout) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        result.seconds = time.perf_counter() - started
    return result


def table(rows: list[dict]) -> str:
    lines = [f"{'config':<8}{'clients':>8}{'tokens':>8}{'tok/s':>8}{'ttft p50':>10}{'ttft p95':>10}"
             f"{'itl p50':>9}{'itl p95':>9}"]
    for r in rows:
        lines.append(f"{r['config']:<8}{r['concurrency']:>8}{r['tokens']:>8}{r['tok_s']:>8.1f}{r['ttft_p50']:>10.3f}"
                     f"{r['ttft_p95']:>10.3f}{r['itl_p50']:>9.3f}{r['itl_p95']:>9.3f}")
    return "\n".join(lines)


def speculation_ratios(rows: list[dict]) -> dict[int, float]:
    """{concurrency: lookup tok/s / plain tok/s} where both ran."""
    by = {(r["config"], r["concurrency"]): r["tok_s"] for r in rows}
    return {c: by[("lookup", c)] / by[("plain", c)] for (config, c) in by
            if config == "lookup" and by.get(("plain", c))}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        ax.plot([r["concurrency"] for r in mine], [r["tok_s"] for r in mine], marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title("assistgen serve: throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--round-requests", type=int, default=16, help="streamed requests per round, over its clients")
    parser.add_argument("--categories", nargs="+", help="only prompts of these suite categories")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, help="passed to the server (default: EngineSettings')")
    parser.add_argument("--prompts", type=Path, default=default_suite())
    parser.add_argument("--plot", type=Path, default=Path("out/serve_load.png"))
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    prompts = [p.turns[0] for p in read_prompts(args.prompts) if not args.categories or p.category in args.categories]
    if not prompts:
        parser.error(f"no prompts of categories {args.categories} in {args.prompts}")
    rows = []
    for config in args.configs:
        port = free_port()
        process = start_server(args, CONFIGS[config], port)
        try:
            for concurrency in args.concurrency:
                result = asyncio.run(run_round(f"http://127.0.0.1:{port}", args, config, concurrency, prompts))
                rows.append(result.row())
                print(f"{config} x{concurrency}: {rows[-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            stop_server(process)
    print(table(rows))
    ratios = speculation_ratios(rows)
    for concurrency, ratio in ratios.items():
        print(f"clients {concurrency}: lookup / plain tok/s = {ratio:.2f}x")
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "round_requests": args.round_requests,
                      "categories": args.categories, "rows": rows, "lookup_over_plain": ratios}))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.plot)
    print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
