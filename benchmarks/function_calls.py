"""Function calling scored like a public leaderboard: `assistgen serve` and `llama-server --jinja`, the same client.

Contract: `benchmarks/function_calls.json` holds OpenAI function tools and cases in four categories, in the style of
the Berkeley Function-Calling Leaderboard: `simple` (one tool, one call), `multiple` (several tools, one right call),
`parallel` (several calls in one turn, of one tool or several) and `irrelevance` (tools that do not help: the right
answer is no call). Each case is one user message sent with its tools (`tool_choice="auto"`, greedy, non-streamed)
through the official `openai` client to each configuration's server, started fresh on a free 127.0.0.1 port. A case
is right when the calls match the expected ones as a multiset, order free: the same function names, every expected
argument present with one of its accepted values (strings compared case- and space-insensitively, numbers as
numbers), no argument the tool does not declare, no extra call; for `irrelevance`, no call at all. A reply whose
arguments are not a JSON object counts as wrong (`invalid`); a 5xx is counted apart (`errors`). Prints a table per
category and configuration and one JSON line; `--out` keeps every reply.

    python benchmarks/function_calls.py --model qwen2.5-coder-1.5b --llama-server build/stock/cmake/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import openai
from serve_load import free_port, gguf_of, start_server, stop_server

from assistgen.bench.report import columns_table

HERE = Path(__file__).resolve().parent
CATEGORIES = ("simple", "multiple", "parallel", "irrelevance")


def server_command(args, config: str, port: int) -> list[str]:
    if config == "llama-server":
        if not args.llama_server:
            raise SystemExit("llama-server needs --llama-server BIN")
        return [args.llama_server, "-m", str(gguf_of(args.model)), "--port", str(port), "--host", "127.0.0.1",
                "-t", str(args.threads), "-c", str(args.context), "--jinja", "--temp", "0"]
    flags = {"assistgen": [], "assistgen-lookup": ["--lookup"]}[config]
    return [sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model, "--port", str(port),
            "--backend", args.backend, *flags]


def normal(value):
    """A value as compared: strings case- and space-insensitive, numbers as floats (True/False stay booleans)."""
    if isinstance(value, str):
        return " ".join(value.lower().split()).rstrip(".")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def call_matches(call: dict, expected: dict, tool: dict) -> bool:
    """One call against one expected call: the name, every expected argument with an accepted value, nothing the
    tool does not declare."""
    if call["name"] != expected["name"] or not isinstance(call["arguments"], dict):
        return False
    declared = tool["function"]["parameters"]["properties"]
    if any(name not in declared for name in call["arguments"]):
        return False
    return all(name in call["arguments"] and normal(call["arguments"][name]) in {normal(v) for v in accepted}
               for name, accepted in expected["arguments"].items())


def score(calls: list[dict], expected: list[dict], tools: dict) -> bool:
    """Whether the calls are the expected ones as a multiset (each expected call matched to a call of its own)."""
    if len(calls) != len(expected):
        return False
    left = list(calls)
    for want in expected:
        found = next((c for c in left if c["name"] in tools and call_matches(c, want, tools[c["name"]])), None)
        if found is None:
            return False
        left.remove(found)
    return True


def parsed_calls(message) -> tuple[list[dict], bool]:
    """(the reply's calls with their arguments parsed, whether every arguments string was a JSON object)."""
    calls, valid = [], True
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments)
        except (TypeError, ValueError):
            arguments, valid = None, False
        valid = valid and isinstance(arguments, dict)
        calls.append({"name": call.function.name, "arguments": arguments})
    return calls, valid


def run_config(args, config: str, data: dict) -> dict:
    port = free_port()
    process = start_server(server_command(args, config, port), port, args.start_timeout)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", timeout=args.request_timeout,
                           max_retries=0)
    out = {"config": config, "cases": []}
    try:
        for case in data["cases"]:
            tools = [data["tools"][name] for name in case["tools"]]
            started = time.perf_counter()
            record = {"id": case["id"], "category": case["category"]}
            try:
                reply = client.chat.completions.create(
                    model=args.model, messages=[{"role": "user", "content": case["question"]}], tools=tools,
                    tool_choice="auto", temperature=0, max_tokens=args.max_tokens)
                calls, valid = parsed_calls(reply.choices[0].message)
                record.update(calls=calls, valid=valid, text=reply.choices[0].message.content,
                              right=valid and score(calls, case["calls"], data["tools"]))
            except openai.APIStatusError as e:
                record.update(calls=[], valid=False, right=False, status=e.status_code, error=str(e)[:300])
            record["seconds"] = time.perf_counter() - started
            out["cases"].append(record)
            print(f"{config} {case['id']}: {'right' if record['right'] else 'wrong'} {record.get('calls')}",
                  file=sys.stderr, flush=True)
    finally:
        stop_server(process)
    return out


def summary(result: dict) -> list[dict]:
    rows = []
    by = defaultdict(list)
    for record in result["cases"]:
        by[record["category"]].append(record)
    for category in (*CATEGORIES, "all"):
        records = result["cases"] if category == "all" else by[category]
        rows.append({"config": result["config"], "category": category, "cases": len(records),
                     "right": sum(r["right"] for r in records),
                     "accuracy": sum(r["right"] for r in records) / max(1, len(records)),
                     "invalid": sum(not r["valid"] and "status" not in r for r in records),
                     "errors": sum(r.get("status", 0) >= 500 for r in records),
                     "client_errors": sum(400 <= r.get("status", 0) < 500 for r in records),
                     "seconds": sum(r["seconds"] for r in records)})
    return rows


TABLE = [("config", "config", "<18"), ("category", "category", "<12"), ("cases", "cases", ">6"),
         ("right", "right", ">6"), ("accuracy", "accuracy", ">9.2f"), ("invalid", "invalid", ">8"),
         ("5xx", "errors", ">5"), ("4xx", "client_errors", ">5"), ("seconds", "seconds", ">8.1f")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--configs", nargs="+", default=["assistgen-lookup", "llama-server"],
                        choices=["assistgen", "assistgen-lookup", "llama-server"])
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--cases", type=Path, default=HERE / "function_calls.json")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, help="every reply, as JSON")
    args = parser.parse_args(argv)
    data = json.loads(args.cases.read_text())
    results = [run_config(args, config, data) for config in args.configs]
    rows = [row for result in results for row in summary(result)]
    print(columns_table(rows, TABLE))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
