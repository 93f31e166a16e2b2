"""Predicted Outputs on edit requests: assistgen with the file as `prediction` against plain decoding and against
llama-server's n-gram modes on the same requests, the same client.

Contract: for each configuration it starts a fresh server on a free 127.0.0.1 port (assistgen: `plain`, no
drafting, and `prediction`, the same server sent each request with its `prediction`, and `prediction-lookup`, a
`--lookup` server with the prediction; llama.cpp's `llama-server` (`--llama-server BIN`): `llama`,
`llama-ngram` (`--spec-type ngram-simple`), `llama-ngram-mod` (`--spec-type ngram-mod`)), sends every case of
`--cases` (benchmarks/predicted_edits.json: rename a symbol, add a parameter, fix a bug, each in a 140-213 line
Python module given in the prompt and predicted whole; and a rewrite whose prediction is not in the prompt: the
server's own answer to a variant of the request, asked first and not timed) as one greedy streamed chat completion
through the official `openai` client, one at a time, and measures each answer's wall time, completion tokens and
tok/s, and (assistgen) the accepted and rejected prediction tokens the server reports. Every assistgen answer must
equal `plain`'s (exit 1 otherwise). Prints the machine, a table per case, the totals with each configuration's
speed-up over the first one's, then one JSON line.

    python benchmarks/predicted_edits.py --model qwen2.5-coder-1.5b --llama-server BIN \
        --configs plain prediction llama llama-ngram llama-ngram-mod
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import openai
from serve_load import free_port, gguf_of, start_server, stop_server

from assistgen.backends.machine import cpu_summary

HERE = Path(__file__).parent
ASSISTGEN = {"plain": [], "prediction": [], "prediction-lookup": ["--lookup"]}
PREDICTING = {"prediction", "prediction-lookup"}
LLAMA_SERVER = {"llama": [], "llama-ngram": ["--spec-type", "ngram-simple"],
                "llama-ngram-mod": ["--spec-type", "ngram-mod"]}


def server_command(args, config: str, port: int) -> list[str]:
    if config in LLAMA_SERVER:
        if not args.llama_server:
            raise SystemExit(f"{config} needs --llama-server BIN")
        return [args.llama_server, "-m", str(gguf_of(args.model)), "--port", str(port), "--host", "127.0.0.1",
                "-t", str(args.threads), "-c", str(args.context), "-np", "1", "--jinja", "--temp", "0",
                *LLAMA_SERVER[config]]
    return [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--port", str(port),
            "--backend", args.backend, "--context", str(args.context), *ASSISTGEN[config]]


def ask(client: openai.OpenAI, model: str, text: str, max_tokens: int, prediction: str | None) -> dict:
    """One greedy streamed chat completion: its text, completion tokens, wall time and usage details."""
    extra = {} if prediction is None else {"prediction": {"type": "content", "content": prediction}}
    start = time.perf_counter()
    events = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **extra)
    parts, usage = [], None
    for event in events:
        if event.choices:
            parts.append(event.choices[0].delta.content or "")
        usage = event.usage or usage
    seconds = time.perf_counter() - start
    details = getattr(usage, "completion_tokens_details", None) if usage is not None else None
    return {"text": "".join(parts), "tokens": usage.completion_tokens if usage else 0, "seconds": seconds,
            "accepted": getattr(details, "accepted_prediction_tokens", None),
            "rejected": getattr(details, "rejected_prediction_tokens", None)}


def prompt_of(case: dict) -> str:
    return case["instruction"] if case["file"] is None else f"{case['instruction']}\n\n```python\n{case['file']}```"


def run_config(args, config: str, cases: list[dict]) -> list[dict]:
    port = free_port()
    process = start_server(server_command(args, config, port), port, timeout=900)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", timeout=3600, max_retries=0)
    rows = []
    try:
        for case in cases:
            prediction = None
            if config in PREDICTING:
                prediction = case["file"]
                if prediction is None:  # (the client's expected text: the answer to the variant, asked untimed)
                    prediction = ask(client, args.model, case["prediction_from"], args.max_tokens, None)["text"]
            answer = ask(client, args.model, prompt_of(case), args.max_tokens, prediction)
            rows.append({"config": config, "case": case["name"], **answer})
            print(f"  {config:18s} {case['name']:40s} {answer['tokens']:5d} tokens {answer['seconds']:7.1f} s "
                  f"{answer['tokens'] / answer['seconds']:6.1f} tok/s"
                  + ("" if answer["accepted"] is None else
                     f"  prediction accepted {answer['accepted']}, rejected {answer['rejected']}"), flush=True)
    finally:
        stop_server(process)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--cases", default=str(HERE / "predicted_edits.json"))
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--configs", nargs="+", choices=[*ASSISTGEN, *LLAMA_SERVER],
                        default=["plain", "prediction", "prediction-lookup"])
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (the llama* configs)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    parser.add_argument("--context", type=int, default=8192, help="the context of each server (llama-server's -c)")
    parser.add_argument("--max-tokens", type=int, default=3072)
    args = parser.parse_args(argv)
    cases = [c for c in json.loads(Path(args.cases).read_text())["cases"] if not args.only or c["name"] in args.only]
    machine = cpu_summary()
    print(f"predicted edits: {args.model}, {len(cases)} cases, on {machine}", flush=True)
    rows = [row for config in args.configs for row in run_config(args, config, cases)]
    first = args.configs[0]
    totals = {}
    for config in args.configs:
        mine = [r for r in rows if r["config"] == config]
        seconds, tokens = sum(r["seconds"] for r in mine), sum(r["tokens"] for r in mine)
        totals[config] = {"seconds": round(seconds, 1), "tokens": tokens, "tok_s": round(tokens / seconds, 2)}
    print(f"\n| case | {' | '.join(args.configs)} |\n|---|{'---:|' * len(args.configs)}")
    for case in cases:
        cells = []
        for config in args.configs:
            r = next(r for r in rows if r["config"] == config and r["case"] == case["name"])
            base = next(b for b in rows if b["config"] == first and b["case"] == case["name"])
            cells.append(f"{r['seconds']:.1f} s, {r['tokens'] / r['seconds']:.1f} tok/s, "
                         f"{base['seconds'] / r['seconds']:.2f}x")
        print(f"| {case['name']} | {' | '.join(cells)} |")
    overall = [f"{t['seconds']} s, {totals[first]['seconds'] / t['seconds']:.2f}x" for t in totals.values()]
    print(f"| all | {' | '.join(overall)} |")
    plain = {r["case"]: r["text"] for r in rows if r["config"] == "plain"}
    differing = [f"{r['config']}: {r['case']}" for r in rows
                 if r["config"] in ASSISTGEN and r["case"] in plain and r["text"] != plain[r["case"]]]
    print(f"assistgen answers differing from plain's: {differing or 'none'}")
    print(json.dumps({"benchmark": "predicted_edits", "model": args.model, "machine": machine, "totals": totals,
                      "differing": differing, "rows": [{k: v for k, v in r.items() if k != "text"} for r in rows]}))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
