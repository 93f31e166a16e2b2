"""Load test of OpenAI-compatible servers: `assistgen serve` and `llama-server`, driven by the same client.

(Configurations ray1, ray1-2cpu (both cores for the one replica), ray2, ray1-ngram, ray2-ngram and
ray2-ngram-nokey run `assistgen serve --replicas N` on Ray Serve; with `--keyed-clients` each client has its own
API key and repeats its own prompt, and the table's accepted/accept columns (the draft tokens the server
reported accepting) show what routing by key keeps.
The RSS column is the serving process's own: with Ray, the driver's, not the replicas'.)

Contract: for each configuration (assistgen: plain, lookup, ngram (the n-gram cache), assistant (`--draft`, same
tokenizer), universal (`--universal`, another tokenizer), each with `--backend`; llama.cpp's `llama-server`
(`--llama-server BIN`): llama, llama-ngram (`--spec-type ngram-simple`), llama-ngram-mod (`ngram-mod`),
llama-draft (`--draft` as its draft model, `draft-simple`)) it starts the server
itself on a free 127.0.0.1 port, and for each concurrency c runs c
clients sharing `--round-requests` streamed chat completions (each client takes the next prompt when its
last one is done) over prompts of the suite (first turn of each record, optionally of some
`--categories` only, cycled in a fixed order: every configuration gets the same requests), then stops the
server. It measures aggregate completion tokens per second
(tokens of all requests / wall time of the round), p50/p95 time to first token and inter-token latency
(the gap between successive streamed text chunks as the client sees them: one per verification step,
which may carry several tokens) and decode tok/s (each request's tokens after its first over the time from its
first to its last chunk, summed over requests). Every request goes through the official `openai` client
(AsyncOpenAI, streamed chat completions, greedy), and the peak RSS of each server process is read from
/proc. Prints a table, each configuration's ratio to the first one per concurrency, then one JSON line; writes a
PNG of tok/s vs concurrency.

    python benchmarks/serve_load.py --model smollm2-135m --concurrency 1 2 4 8 16 --round-requests 16 --max-tokens 64
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --universal smollm2-135m \
        --llama-server build/bin/llama-server --configs llama llama-ngram lookup ngram assistant --concurrency 1 8
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
import openai

from assistgen.backends.embedded import EMBEDDED
from assistgen.bench.dataset import default_suite, read_prompts
from assistgen.bench.report import columns_table

ASSISTGEN = {"plain": [], "lookup": ["--lookup"], "ngram": ["--ngram-cache"], "assistant": ["--assistant", "{draft}"],
             "universal": ["--assistant", "{universal}"],
             # replicas on Ray Serve (`serve --replicas`): the overhead, and routing by key for the n-gram cache
             "ray1": ["--replicas", "1"], "ray2": ["--replicas", "2"],
             "ray1-2cpu": ["--replicas", "1", "--cpus-per-replica", "2"],
             "ray1-ngram": ["--replicas", "1", "--ngram-cache"], "ray2-ngram": ["--replicas", "2", "--ngram-cache"],
             "ray2-ngram-nokey": ["--replicas", "2", "--ngram-cache", "--no-route-by-key"]}
LLAMA_SERVER = {"llama": [], "llama-ngram": ["--spec-type", "ngram-simple"],
                "llama-ngram-mod": ["--spec-type", "ngram-mod"],
                "llama-draft": ["-md", "{draft_gguf}", "--spec-type", "draft-simple"]}
CONFIGS = [*ASSISTGEN, *LLAMA_SERVER]


@dataclass
class Round:
    config: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    drafted: int = 0  # draft tokens the server reported verifying (metrics.speculative_decoding)
    accepted: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    rss_mb: float = 0.0
    by_category: dict[str, list[float]] = field(default_factory=dict)  # {category: [decode tokens, seconds]}

    def row(self) -> dict:
        return {"config": self.config, "concurrency": self.concurrency, "tokens": self.tokens,
                "decode_by_category": {c: t / s if s else 0.0 for c, (t, s) in self.by_category.items()},
                "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "decode_tok_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "peak_rss_mb": self.rss_mb, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
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


def server_command(args, config: str, port: int) -> list[str]:
    fill = {"draft": args.draft, "universal": args.universal,
            "draft_gguf": str(gguf_of(args.draft)) if args.draft else ""}
    if config in LLAMA_SERVER:
        if not args.llama_server:
            raise SystemExit(f"{config} needs --llama-server BIN")
        flags = [f.format(**fill) for f in LLAMA_SERVER[config]]
        return [args.llama_server, "-m", str(gguf_of(args.model)), "--port", str(port), "--host", "127.0.0.1",
                "-t", str(args.threads), "-c", str(args.context * args.parallel), "-np", str(args.parallel),
                "--jinja", "--temp", "0", *flags]
    flags = [f.format(**fill) for f in ASSISTGEN[config]]
    command = [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--port", str(port),
               "--backend", args.backend, *flags]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    return command


def gguf_of(spec: str) -> Path:
    return EMBEDDED[spec].gguf_path() if spec in EMBEDDED else Path(spec)


def start_server(command: list[str], port: int, timeout: float) -> subprocess.Popen:
    """Run `command` (a server listening on 127.0.0.1:port) until /health answers 200 (at most `timeout` s)."""
    log = open(os.environ["SERVE_LOAD_LOG"], "a") if os.environ.get("SERVE_LOAD_LOG") else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise RuntimeError("the server did not start in time")


def peak_rss_mb(process: subprocess.Popen) -> float:
    """VmHWM of the server process (and its children, for a wrapper) in MiB."""
    try:
        with open(f"/proc/{process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()  # SIGTERM: uvicorn shuts down, running requests finish
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, result: Round,
                      category: str = ""):
    started = time.perf_counter()
    first = last = None
    tokens = 0
    events = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for event in events:
        if event.usage:
            tokens = event.usage.completion_tokens
        spec = ((event.model_extra or {}).get("metrics") or {}).get("speculative_decoding")
        if spec:
            result.drafted += spec["num_draft_tokens"]
            result.accepted += spec["num_accepted_draft_tokens"]
        content = "".join(c.delta.content or "" for c in event.choices if c.delta)
        if not content:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
            result.ttft.append(now - started)
        else:
            result.itl.append(now - last)
        last = now
    result.tokens += tokens
    if first is not None and last > first and tokens > 1:
        result.decode_tokens += tokens - 1
        result.decode_seconds += last - first
        mine = result.by_category.setdefault(category, [0, 0.0])
        mine[0] += tokens - 1
        mine[1] += last - first


async def run_round(url: str, args, config: str, concurrency: int, prompts: list[tuple[str, str]]) -> Round:
    """prompts: (text, category)."""
    result = Round(config, concurrency)

    queue = list(range(args.round_requests))

    def new_client(key: str) -> openai.AsyncOpenAI:  # (a keep-alive connection the server closed is retried)
        return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, timeout=args.request_timeout, max_retries=2)

    shared = new_client("bench")
    clients = [new_client(f"client-{i}") if args.keyed_clients else shared for i in range(concurrency)]

    async def one_client(i: int):
        while queue:
            n = queue.pop(0)
            # keyed clients: each its own API key, repeating its own prompt (what routing by key is for)
            prompt, category = prompts[(i if args.keyed_clients else n) % len(prompts)]
            await one_request(clients[i], args.model, prompt, args.max_tokens, result, category)

    started = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - started
    for client in {id(c): c for c in clients}.values():
        await client.close()
    return result


TABLE = [("config", "config", "<16"), ("clients", "concurrency", ">8"), ("tokens", "tokens", ">8"),
         ("tok/s", "tok_s", ">8.1f"), ("decode", "decode_tok_s", ">8.1f"), ("ttft p50", "ttft_p50", ">10.3f"),
         ("ttft p95", "ttft_p95", ">10.3f"), ("itl p50", "itl_p50", ">9.3f"), ("itl p95", "itl_p95", ">9.3f"),
         ("RSS MiB", "peak_rss_mb", ">9.0f"), ("accepted", "accepted", ">10"), ("accept", "acceptance", ">8.0%")]


def category_table(rows: list[dict]) -> str:
    """Decode tok/s of each configuration (at each concurrency) per prompt category."""
    categories = sorted({c for r in rows for c in r["decode_by_category"]})
    head = f"{'decode tok/s':<22}" + "".join(f"{c[:10]:>11}" for c in categories)
    lines = [head]
    for r in rows:
        cells = "".join(f"{r['decode_by_category'].get(c, 0.0):>11.1f}" for c in categories)
        lines.append(f"{(r['config'] + ' x' + str(r['concurrency']))[:22]:<22}{cells}")
    return "\n".join(lines)


def ratios_to_first(rows: list[dict]) -> dict[str, dict[int, float]]:
    """{config: {concurrency: its tok/s / the first configuration's tok/s}}."""
    first = rows[0]["config"]
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["config"] == first}
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["config"] != first and base.get(r["concurrency"]):
            out.setdefault(r["config"], {})[r["concurrency"]] = r["tok_s"] / base[r["concurrency"]]
    return out


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
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=["plain", "lookup"])
    parser.add_argument("--backend", default="auto", help="assistgen serve --backend")
    parser.add_argument("--draft", help="the same-tokenizer draft model (assistant, llama-draft)")
    parser.add_argument("--universal", help="an assistant with another tokenizer (universal)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (the llama* configs)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server -np (slots)")
    parser.add_argument("--context", type=int, default=4096, help="llama-server context per slot")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--round-requests", type=int, default=16, help="streamed requests per round, over its clients")
    parser.add_argument("--categories", nargs="+", help="only prompts of these suite categories")
    parser.add_argument("--per-category", type=int, help="only the first N prompts of each category")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--keyed-clients", action="store_true",
                        help="each client its own API key and its own prompt, repeated (the n-gram routing workload)")
    parser.add_argument("--max-batch", type=int, help="passed to the server (default: EngineSettings')")
    parser.add_argument("--prompts", type=Path, default=default_suite())
    parser.add_argument("--plot", type=Path, default=Path("out/serve_load.png"))
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    records = [p for p in read_prompts(args.prompts) if not args.categories or p.category in args.categories]
    if args.per_category:
        kept: dict[str, list] = {}
        for record in records:
            if len(kept.setdefault(record.category, [])) < args.per_category:
                kept[record.category].append(record)
        records = [r for group in kept.values() for r in group]
    prompts = [(p.turns[0], p.category) for p in records]
    if not prompts:
        parser.error(f"no prompts of categories {args.categories} in {args.prompts}")
    rows = []
    for config in args.configs:
        port = free_port()
        process = start_server(server_command(args, config, port), port, args.start_timeout)
        try:
            for concurrency in args.concurrency:
                result = asyncio.run(run_round(f"http://127.0.0.1:{port}", args, config, concurrency, prompts))
                result.rss_mb = peak_rss_mb(process)
                rows.append(result.row())
                print(f"{config} x{concurrency}: {rows[-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            stop_server(process)
    print(columns_table(rows, TABLE))
    print(category_table(rows))
    ratios = ratios_to_first(rows)
    for config, by in ratios.items():
        print(f"{config} / {rows[0]['config']} tok/s: " + ", ".join(f"{c} clients {r:.2f}x" for c, r in by.items()))
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "round_requests": args.round_requests,
                      "categories": args.categories, "rows": rows, "ratios_to_first": ratios}))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.plot)
    print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
