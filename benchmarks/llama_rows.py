"""Is a row's logits on the llama.cpp backend the same alone and inside a verification batch? Measured bitwise.

For each model and setting: after a chat prompt, 24 greedy tokens are decoded one per pass (the reference); then
each row count n = 2..17 feeds n of those tokens in one pass from every start position, and the share of rows
whose logits are bitwise the reference's is printed with the largest difference. Then, over the shipped suite,
the share of prompts whose greedy output with a drafter (prompt lookup, a fixed 4-token schedule, so that every
row count is used) differs from plain decoding on the same backend, and whether each first divergence is a near
tie (`first_divergence`, tests/reference.py). Prints a table, then one JSON line.

    python benchmarks/llama_rows.py --models smollm2-135m,gemma3-270m --settings repack,norepack
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.bench.dataset import default_suite, read_prompts, select
from assistgen.policy.rules import Constant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import first_divergence  # noqa: E402 (tests/reference.py)

SETTINGS = {"repack": {"repack": True}, "norepack": {"repack": False}}


def chat(model, text: str) -> list[int]:
    return encode_prompt(model, text, chat=getattr(model.tokenizer, "chat_template", None) is not None)


def row_agreement(model, ids: list[int], tokens: int = 24, max_rows: int = 17,
                  step: int = 4) -> dict[int, tuple[float, float]]:
    """n -> (share of rows bitwise equal to the one-token pass, largest |difference|)."""
    cache = model.new_cache()
    logits = cache.feed(ids)
    rows, alone, states = [], [], []
    for _ in range(tokens):
        states.append(cache.fork())  # the cache before row i, built one token per pass like the reference
        rows.append(int(logits[0].argmax()))
        logits = cache.feed(rows[-1:])
        alone.append(logits[0])
    out = {}
    for n in range(2, max_rows + 1):
        same = total = 0
        worst = 0.0
        for s in range(0, tokens - n + 1, step):
            branch = states[s].fork()
            got = branch.feed(rows[s:s + n], logits_to_keep=n)
            del branch
            for j in range(n):
                same += int(torch.equal(got[j], alone[s + j]))
                worst = max(worst, float((got[j] - alone[s + j]).abs().max()))
                total += 1
        out[n] = (same / total, worst)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--settings", default="repack,norepack")
    p.add_argument("--n", type=int, default=None, help="prompts of the suite (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    prompts = select(read_prompts(default_suite()), None, args.n, 0)
    results = []
    for spec in args.models.split(","):
        for setting in args.settings.split(","):
            model = load_model(spec, backend="llama.cpp", fast_linear=False, **SETTINGS[setting])
            rows = row_agreement(model, chat(model, "Write a Python function that merges two sorted lists."))
            differ = near = 0
            for prompt in prompts:
                ids = chat(model, prompt.turns[0])
                plain = generate(model, ids, max_new_tokens=args.max_new_tokens).token_ids
                ours = generate(model, ids, max_new_tokens=args.max_new_tokens, lookup=True,
                                schedule=Constant(4)).token_ids
                d = first_divergence(model, ids, plain, ours)
                if ours != plain:
                    differ += 1
                    near += int(d is not None and d.near_tie)
            bitwise_upto = max([1] + [n for n in rows if all(rows[m][0] == 1.0 for m in range(2, n + 1))])
            results.append({"model": spec, "setting": setting, "bitwise_up_to_rows": bitwise_upto,
                            "rows": {n: round(v[0], 3) for n, v in rows.items()},
                            "max_diff": {n: v[1] for n, v in rows.items()},
                            "prompts": len(prompts), "differ": differ, "near_tie": near})
            print(f"{spec:<14} {setting:<9} rows bitwise up to n={bitwise_upto:<3} "
                  + " ".join(f"{n}:{v[0]:.2f}" for n, v in rows.items())
                  + f" | outputs differing from plain: {differ}/{len(prompts)} ({near} at near ties)", flush=True)
            del model
    print(json.dumps(results))


if __name__ == "__main__":
    main()
