"""Universal assisted generation, side by side with transformers' own (UAG), on Gemma-3-270M <- SmolLM2-135M.

For each prompt the methods run interleaved after one warm-up: transformers plain `generate()`,
transformers UAG (`generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)`), both on
the unmodified models; assistgen plain and assistgen universal (small-row linear transform on).
Assistant forward passes are counted for both implementations. Prints a table, then one JSON line.

    python benchmarks/universal.py [--tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.devices import model_device
from assistgen.backends.torch.reference import ForwardCounter, hf_generate
from assistgen.backends.torch.timing import clock

PROMPTS = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "italian": "La città di Roma è famosa per",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--assistant", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    target = load_model(args.target, fast_linear="on")
    assistant = load_model(args.assistant, fast_linear="on")
    counter = ForwardCounter(assistant)
    n = args.tokens
    device = model_device(target)

    def hf(ids, uag: bool, n=n):
        counter.count = 0
        tokens, seconds = hf_generate(target, ids, n, assistant=assistant if uag else None, universal=uag)
        return tokens, seconds, counter.count

    def ours(ids, universal: bool, n=n):
        counter.count = 0
        t = clock(device)
        out = generate(target, ids, assistant=assistant if universal else None, max_new_tokens=n)
        return out.token_ids, clock(device) - t, counter.count, out.stats

    rows = []
    for name, text in PROMPTS.items():
        ids = encode_prompt(target, text)
        methods = {
            "hf plain": lambda ids=ids, **kw: hf(ids, False, **kw),
            "hf UAG": lambda ids=ids, **kw: hf(ids, True, **kw),
            "assistgen plain": lambda ids=ids, **kw: ours(ids, False, **kw),
            "assistgen universal": lambda ids=ids, **kw: ours(ids, True, **kw),
        }
        for fn in methods.values():
            fn(n=8)  # warm-up (short: transformers' UAG runs at a few tokens per second here)
        times = {m: [] for m in methods}
        results = {}
        for _ in range(args.repeats):
            for m, fn in methods.items():
                results[m] = fn()
                times[m].append(results[m][1])
        for m in methods:
            tokens, _, passes = results[m][:3]
            stats = results[m][3] if len(results[m]) > 3 else None
            t = statistics.median(times[m])
            rows.append({
                "prompt": name, "method": m, "new_tokens": len(tokens), "tok_s": len(tokens) / t,
                "assistant_forward_passes": passes,
                "identical_to_hf_plain": tokens == results["hf plain"][0],
                "vs_hf_plain": (len(tokens) / t) / (len(results["hf plain"][0]) / statistics.median(times["hf plain"])),
                "acceptance_rate": stats.acceptance_rate if stats else None,
                "notes": stats.notes if stats else {},
            })
    by = {(r["prompt"], r["method"]): r for r in rows}
    print(f"{'prompt':<10}{'method':<22}{'tok/s':>7}{'vs hf plain':>13}{'vs hf UAG':>11}{'asst fwd':>10}"
          f"{'same as hf plain':>18}{'accept':>8}")
    for r in rows:
        uag = by[(r["prompt"], "hf UAG")]["tok_s"]
        acc = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        print(f"{r['prompt']:<10}{r['method']:<22}{r['tok_s']:>7.1f}{r['vs_hf_plain']:>12.2f}x"
              f"{r['tok_s'] / uag:>10.2f}x{r['assistant_forward_passes']:>10}"
              f"{str(r['identical_to_hf_plain']):>18}{acc:>8}")
    print(json.dumps({"benchmark": "universal", "target": args.target, "assistant": args.assistant,
                      "tokens": n, "repeats": args.repeats, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
