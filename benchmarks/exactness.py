"""How often does greedy output differ with the small-row linear transform, and is it always a near-tie?

For each embedded model and prompt: transformers' generate() on the unmodified model, assistgen
plain decoding and assistgen prompt lookup (both with the transform). Every pair that differs is
reported with the target's top-2 logit margin at the first differing token. Prints a table and
one JSON line.

    python benchmarks/exactness.py [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.reference import hf_generate
from assistgen.cli.demo import summary_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import first_divergence  # noqa: E402 (tests/reference.py)

PROMPTS = [
    summary_prompt(),
    "Write a short story about a dragon who learns to bake bread.",
    "Write a Python function that checks whether a number is prime, with comments.",
    "Explain why the sky is blue.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "What is 17 times 23? Show your steps.",
    "Give me a recipe for pancakes.",
    "List the planets of the solar system in order from the Sun.",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def hf_reference(model, ids, n):
    return hf_generate(model, ids, n)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        model = load_model(name, fast_linear="on")
        chat = bool(getattr(model.tokenizer, "chat_template", None))
        for i, text in enumerate(PROMPTS):
            ids = encode_prompt(model, text, chat=chat)
            hf = hf_reference(model, ids, args.tokens)
            plain = generate(model, ids, max_new_tokens=args.tokens).token_ids
            lookup = generate(model, ids, lookup=True, max_new_tokens=args.tokens).token_ids
            for pair, (a, b) in {"hf vs plain": (hf, plain), "plain vs lookup": (plain, lookup)}.items():
                d = first_divergence(model, ids, a, b)
                rows.append({"model": name, "prompt": i, "pair": pair, "identical": a == b,
                             "position": d.position if d else None, "margin": d.margin if d else None,
                             "near_tie": d.near_tie if d else None})
                tie = "near-tie" if d and d.near_tie else "NOT a tie"
                status = "identical" if a == b else (
                    f"differs at token {d.position}, margin {d.margin:.2e} ({tie})" if d else "prefix (stopped early)")
                print(f"{name:<14} prompt {i:<3}{pair:<18}{status}", flush=True)
    differing = [r for r in rows if not r["identical"]]
    print(f"\n{len(rows)} comparisons, {len(differing)} differ, "
          f"{sum(1 for r in differing if r['near_tie'])} of those at a near-tie (margin < 1e-4)")
    print(json.dumps({"benchmark": "exactness", "tokens": args.tokens, "comparisons": len(rows),
                      "differ": len(differing), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
