"""Core benchmark: assistgen plain and prompt-lookup decoding vs transformers' generate().

For each model and prompt the methods run interleaved (A B C D, A B C D, ...) after one warm-up,
so drift on a noisy machine hits all alike. transformers runs on the unmodified model (PyTorch's
own F.linear); assistgen runs with its small-row linear transform (its default where it measures
faster). Prints a table, then one JSON line.

    python benchmarks/core.py [--models smollm2-135m gemma3-270m] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.devices import model_device
from assistgen.backends.torch.reference import hf_generate
from assistgen.backends.torch.timing import clock
from assistgen.cli.demo import summary_prompt

PROMPTS = {
    "summary": summary_prompt(),
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def ours(model, ids, n, **kwargs):
    device = model_device(model)
    t = clock(device)
    out = generate(model, ids, max_new_tokens=n, **kwargs)
    return out.token_ids, clock(device) - t, out.stats


def bench(model_name: str, n: int, repeats: int) -> list[dict]:
    model = load_model(model_name, fast_linear="on")
    chat = bool(getattr(model.tokenizer, "chat_template", None))
    rows = []
    for prompt_name, text in PROMPTS.items():
        ids = encode_prompt(model, text, chat=chat)
        methods = {
            "hf plain": lambda ids=ids: hf_generate(model, ids, n),
            "hf lookup(10)": lambda ids=ids: hf_generate(model, ids, n, lookup_tokens=10),
            "assistgen plain": lambda ids=ids: ours(model, ids, n),
            "assistgen lookup": lambda ids=ids: ours(model, ids, n, lookup=True),
        }
        for fn in methods.values():  # warm-up
            fn()
        times = {m: [] for m in methods}
        tokens, stats = {}, {}
        for _ in range(repeats):
            for name, fn in methods.items():
                result = fn()
                tokens[name] = result[0]
                times[name].append(result[1])
                if len(result) > 2:
                    stats[name] = result[2]
        base = statistics.median(times["hf plain"])
        ours_plain = statistics.median(times["assistgen plain"])
        for name in methods:
            t = statistics.median(times[name])
            s = stats.get(name)
            rows.append({
                "model": model_name, "prompt": prompt_name, "prompt_tokens": len(ids), "method": name,
                "new_tokens": len(tokens[name]), "tok_s": len(tokens[name]) / t,
                "vs_hf_plain": base / t * len(tokens[name]) / len(tokens["hf plain"]),
                "vs_assistgen_plain": ours_plain / t * len(tokens[name]) / len(tokens["assistgen plain"]),
                "identical_to_hf_plain": tokens[name] == tokens["hf plain"],
                "acceptance_rate": s.acceptance_rate if s else None,
                "mean_accepted_length": s.mean_accepted_length if s else None,
            })
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<14}{'prompt':<12}{'method':<18}{'tok/s':>7}{'vs hf plain':>13}{'vs ours plain':>15}" \
           f"{'same as hf':>12}{'accept':>8}{'mean len':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        mlen = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        print(f"{r['model']:<14}{r['prompt']:<12}{r['method']:<18}{r['tok_s']:>7.1f}{r['vs_hf_plain']:>12.2f}x"
              f"{r['vs_assistgen_plain']:>14.2f}x{str(r['identical_to_hf_plain']):>12}{acc:>8}{mlen:>10}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = [r for m in args.models for r in bench(m, args.tokens, args.repeats)]
    print_table(rows)
    print(json.dumps({"benchmark": "core", "tokens": args.tokens, "repeats": args.repeats, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
