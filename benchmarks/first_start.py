"""A server's first start on a new machine, and the policy on its provisional costs against its measured ones.

Part 1 starts `assistgen serve --model M` with an empty cache folder (a new machine: the model's conversion, its
tokenizer and its pass costs all to do), times `/health` and one chat request through the openai client, waits
until `/health` says the costs are measured (the engine measures them while idle), then starts it again on the
now filled cache. Part 2 loads the model once and generates the same prompts greedily with prompt lookup under
the measured costs and under the provisional ones (`policy.measurement.quick_costs`): tokens per second and tokens
per step of each, and whether the output is the same (it must be: costs move speed, not text).

    python benchmarks/first_start.py [--model qwen2.5-coder-1.5b] [--tokens 64] [--skip-server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

PORT = 8191
PROMPTS = [
    "Write a Python function that reverses a string, with a docstring and two doctests.",
    "Rewrite this loop as a list comprehension: result = []\nfor x in items:\n    if x > 0:\n"
    "        result.append(x * 2)",
    "Explain what this does and fix its bug: def mean(xs): return sum(xs) / len(xs) - 1",
]


def health() -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def one_start(model: str, cache: str, wait_measured: bool) -> dict:
    import openai

    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "assistgen.cli.main", "serve", "--model", model, "--port",
                               str(PORT)], env={**os.environ, "ASSISTGEN_CACHE": cache},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while (state := health()) is None:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        ready = time.perf_counter() - start
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none")
        t = time.perf_counter()
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=32, temperature=0)
        first = time.perf_counter() - t
        out = {"health_s": ready, "costs_at_health": state["costs"], "first_request_s": first}
        if wait_measured:
            t = time.perf_counter()
            while health()["costs"] == "measuring":
                time.sleep(0.2)
            out["measured_after_s"] = time.perf_counter() - t
        return out
    finally:
        server.terminate()
        server.wait(30)


def policy_on(model, costs, tokens: int) -> dict:
    from assistgen import generate
    from assistgen.policy.costs import enter

    enter(model, costs)
    rate, steps, texts = [], [], []
    for prompt in PROMPTS:
        out = generate(model, prompt, lookup=True, chat=True, max_new_tokens=tokens)
        rate.append(out.stats.decoded_tokens / (out.stats.total_s - out.stats.prefill_s))
        steps.append(out.stats.decoded_tokens / out.stats.steps)
        texts.append(out.token_ids)
    return {"tok_s": sum(rate) / len(rate), "tokens_per_step": sum(steps) / len(steps), "ids": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-server", action="store_true")
    args = parser.parse_args()
    if not args.skip_server:
        with tempfile.TemporaryDirectory() as cache:
            first = one_start(args.model, cache, wait_measured=True)
            again = one_start(args.model, cache, wait_measured=False)
        print("| start | /health (s) | costs then | first request (s) | costs measured after (s) |")
        print("|---|---|---|---|---|")
        for name, r in (("new machine", first), ("cached", again)):
            print(f"| {name} | {r['health_s']:.1f} | {r['costs_at_health']} | {r['first_request_s']:.2f} | "
                  f"{r.get('measured_after_s', float('nan')):.1f} |")
    from assistgen import load_model
    from assistgen.policy.costs import measured_costs
    from assistgen.policy.measurement import quick_costs

    model = load_model(args.model)
    measured = measured_costs(model)
    provisional = quick_costs(model)
    rows = {"measured": policy_on(model, measured, args.tokens), "provisional": policy_on(model, provisional,
                                                                                          args.tokens)}
    print("\n| costs | curve v(1), v(4), v(16) | tok/s | tokens per step |")
    print("|---|---|---|---|")
    for name, costs in (("measured", measured), ("provisional", provisional)):
        v = costs.curve
        print(f"| {name} | {v[1]:.2f}, {v[4]:.2f}, {v[16]:.2f} | {rows[name]['tok_s']:.1f} | "
              f"{rows[name]['tokens_per_step']:.2f} |")
    print(f"same output: {rows['measured']['ids'] == rows['provisional']['ids']}")


if __name__ == "__main__":
    main()
