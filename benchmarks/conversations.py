"""Multi-turn conversations against OpenAI-compatible servers: `assistgen serve` and `llama-server`, the same client.

Contract: for each configuration (assistgen: plain, lookup, ngram, lookup-ngram, suffix (with lookup and ngram),
assistant (`--assistant` `--draft`, with lookup), each optionally with `--assistgen-flags`; llama.cpp's `llama-server`
(`--llama-server BIN`): llama, llama-ngram (`--spec-type ngram-simple`), llama-ngram-mod, llama-draft (`-md` `--draft`,
`--spec-type draft-simple`, one round for each `--draft-n-max`)) it starts a fresh server on a free 127.0.0.1 port
for each round and replays the conversations of
`--conversations` (benchmarks/conversations.json: code edits, config edits, text rewrites, follow-up questions; 3
turns each) as a chat client does: each turn sends the whole conversation so far, the server's own earlier replies
included, as one streamed greedy chat completion through the official `openai` client (AsyncOpenAI), each
conversation under its own API key. It runs them one at a time (`--clients 1`) and then `--clients N` at once (each
client its own conversations, in order; with `--same`, every client all of them: N copies of one client), and
measures per round the wall time, aggregate completion tokens per second, time to first token (first turns and
later turns apart; for later turns p50, p95 and the worst), decode tok/s (tokens after the first over the time from
the first to the last chunk), the prompt tokens the server reported cached
(`usage.prompt_tokens_details.cached_tokens`, when it reports them), and the server's peak RSS (/proc VmHWM). Prints
the machine (processor, widest vector extension, cores), a table, the ratio of each configuration's wall time to the
first one's, then one JSON line.

    python benchmarks/conversations.py --model qwen2.5-coder-1.5b --llama-server build/stock/cmake/bin/llama-server \
        --configs llama-ngram lookup-ngram --clients 1 4 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
from serve_load import free_port, gguf_of, peak_rss_mb, percentile, start_server, stop_server

from assistgen.backends.machine import cpu_summary
from assistgen.bench.report import columns_table

ASSISTGEN = {"plain": [], "lookup": ["--lookup"], "ngram": ["--ngram-cache"],
             "lookup-ngram": ["--lookup", "--ngram-cache"], "suffix": ["--suffix", "--lookup", "--ngram-cache"],
             "assistant": ["--assistant", "{draft}", "--lookup"]}
LLAMA_SERVER = {"llama": [], "llama-ngram": ["--spec-type", "ngram-simple"],
                "llama-ngram-mod": ["--spec-type", "ngram-mod"],
                "llama-draft": ["-md", "{draft_gguf}", "--spec-type", "draft-simple", "--spec-draft-n-max", "{n_max}"]}
HERE = Path(__file__).resolve().parent


@dataclass
class Round:
    config: str
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    ttft_first: list[float] = field(default_factory=list)  # first turns
    ttft_later: list[float] = field(default_factory=list)  # turns 2..
    later_decode: list[float] = field(default_factory=list)  # [tokens, seconds] of turns 2..
    first_decode: list[float] = field(default_factory=lambda: [0, 0.0])
    rss_mb: float = 0.0
    replies: dict = field(default_factory=dict)  # {conversation: [reply texts]}

    def __post_init__(self):
        self.later_decode = [0, 0.0]

    def row(self) -> dict:
        return {"config": self.config, "clients": self.clients, "wall_s": self.seconds, "tokens": self.tokens,
                "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "decode_tok_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "decode_first_tok_s": rate(self.first_decode), "decode_later_tok_s": rate(self.later_decode),
                "ttft_first_p50": percentile(self.ttft_first, 50), "ttft_later_p50": percentile(self.ttft_later, 50),
                "ttft_later_p95": percentile(self.ttft_later, 95),
                "ttft_later_max": max(self.ttft_later, default=0.0), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "peak_rss_mb": self.rss_mb}


def rate(pair: list) -> float:
    return pair[0] / pair[1] if pair[1] else 0.0


def server_command(args, config: str, port: int, n_max: int = 3) -> list[str]:
    fill = {"draft": args.draft, "draft_gguf": str(gguf_of(args.draft)), "n_max": str(n_max)}
    if config in LLAMA_SERVER:
        if not args.llama_server:
            raise SystemExit(f"{config} needs --llama-server BIN")
        return [args.llama_server, "-m", str(gguf_of(args.model)), "--port", str(port), "--host", "127.0.0.1",
                "-t", str(args.threads), "-c", str(args.context * args.parallel), "-np", str(args.parallel),
                "--jinja", "--temp", "0", *(f.format(**fill) for f in LLAMA_SERVER[config])]
    return [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--port", str(port),
            "--backend", args.backend, *(f.format(**fill) for f in ASSISTGEN[config]), *args.assistgen_flags]


def rounds_of(args) -> list[tuple[str, str, int]]:
    """(label, configuration, llama-draft's --spec-draft-n-max) for each server to start: llama-draft once for each
    of `--draft-n-max`."""
    return [(f"{config}-n{n}" if config == "llama-draft" else config, config, n) for config in args.configs
            for n in (args.draft_n_max if config == "llama-draft" else [3])]


async def one_turn(client: openai.AsyncOpenAI, args, messages: list[dict], later: bool, result: Round) -> str:
    started = time.perf_counter()
    first = last = None
    tokens, texts = 0, []
    events = await client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for event in events:
        if event.usage:
            tokens = event.usage.completion_tokens
            result.prompt_tokens += event.usage.prompt_tokens
            details = event.usage.prompt_tokens_details
            result.cached_tokens += (details.cached_tokens or 0) if details is not None else 0
        content = "".join(c.delta.content or "" for c in event.choices if c.delta)
        if not content:
            continue
        texts.append(content)
        now = time.perf_counter()
        if first is None:
            first = now
            (result.ttft_later if later else result.ttft_first).append(now - started)
        last = now
    result.tokens += tokens
    if first is not None and last > first and tokens > 1:
        result.decode_tokens += tokens - 1
        result.decode_seconds += last - first
        pair = result.later_decode if later else result.first_decode
        pair[0] += tokens - 1
        pair[1] += last - first
    return "".join(texts)


async def run_round(url: str, args, config: str, clients: int, conversations: list[dict]) -> Round:
    """Each of `clients` clients replays its share of the conversations (conversation i goes to client i % clients;
    with `args.same` every client replays all of them), one turn after the other, each conversation under its own
    API key."""
    result = Round(config, clients)

    async def one_client(i: int):
        for conversation in (conversations if args.same else conversations[i::clients]):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=f"conv-{conversation['name']}",
                                        timeout=args.request_timeout, max_retries=2)  # (a keep-alive
            # connection the server closed is retried: llama-server's cpp-httplib closes idle ones)
            messages, replies = [], []
            for turn, text in enumerate(conversation["turns"]):
                messages.append({"role": "user", "content": text})
                reply = await one_turn(client, args, messages, turn > 0, result)
                messages.append({"role": "assistant", "content": reply})
                replies.append(reply)
            result.replies[conversation["name"]] = replies
            await client.close()

    started = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(clients)))
    result.seconds = time.perf_counter() - started
    return result


TABLE = [("config", "config", "<16"), ("clients", "clients", ">8"), ("wall s", "wall_s", ">8.1f"),
         ("tok/s", "tok_s", ">7.1f"), ("decode", "decode_tok_s", ">8.1f"), ("dec 1st", "decode_first_tok_s", ">8.1f"),
         ("dec later", "decode_later_tok_s", ">10.1f"), ("ttft 1st", "ttft_first_p50", ">9.2f"),
         ("ttft later", "ttft_later_p50", ">11.2f"), ("p95", "ttft_later_p95", ">7.2f"),
         ("max", "ttft_later_max", ">7.2f"),
         ("prompt", "prompt_tokens", ">8"), ("cached", "cached_tokens", ">8"), ("RSS MiB", "peak_rss_mb", ">9.0f")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", nargs="+", choices=[*ASSISTGEN, *LLAMA_SERVER], default=["plain", "lookup-ngram"])
    parser.add_argument("--backend", default="auto", help="assistgen serve --backend")
    parser.add_argument("--assistgen-flags", nargs=argparse.REMAINDER, default=[],
                        help="more flags for every assistgen server (last on the line)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (the llama* configs)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b",
                        help="the assistant: assistgen's --assistant, llama-server's -md (embedded name or GGUF)")
    parser.add_argument("--draft-n-max", nargs="+", type=int, default=[3],
                        help="llama-draft: one round for each --spec-draft-n-max")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    parser.add_argument("--parallel", type=int, default=4, help="llama-server -np (slots)")
    parser.add_argument("--context", type=int, default=4096, help="llama-server context per slot")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--conversations", type=Path, default=HERE / "conversations.json")
    parser.add_argument("--first", type=int, help="only the first N conversations")
    parser.add_argument("--same", action="store_true",
                        help="every client replays every conversation (the same turns under the same keys: N copies "
                             "of one client), not its share of them")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--replies", type=Path, help="write every configuration's replies here (JSON)")
    args = parser.parse_args(argv)

    conversations = json.loads(args.conversations.read_text())[: args.first]
    rows, replies = [], {}
    for label, config, n_max in rounds_of(args):
        for clients in args.clients:  # (a fresh server per round: nothing cached from the round before)
            port = free_port()
            process = start_server(server_command(args, config, port, n_max), port, args.start_timeout)
            try:
                result = asyncio.run(run_round(f"http://127.0.0.1:{port}", args, label, clients, conversations))
                result.rss_mb = peak_rss_mb(process)
            finally:
                stop_server(process)
            rows.append(result.row())
            replies[f"{label} x{clients}"] = result.replies
            print(f"{label} x{clients}: {result.seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"{args.model}, {len(conversations)} conversations, {args.max_tokens} tokens a turn, on {cpu_summary()}")
    print(columns_table(rows, TABLE))
    base = {r["clients"]: r for r in rows if r["config"] == rows[0]["config"]}
    for r in rows:
        if r["config"] != rows[0]["config"] and r["clients"] in base:
            b = base[r["clients"]]
            print(f"{r['config']} x{r['clients']} vs {b['config']}: wall time {b['wall_s'] / r['wall_s']:.2f}x faster, "
                  f"tok/s {r['tok_s'] / b['tok_s']:.2f}x, later-turn ttft {r['ttft_later_p50']:.2f} s vs "
                  f"{b['ttft_later_p50']:.2f} s")
    if args.replies:
        args.replies.write_text(json.dumps(replies, indent=1))
    print(json.dumps({"model": args.model, "machine": cpu_summary(), "max_tokens": args.max_tokens,
                      "conversations": len(conversations), "rows": rows}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
