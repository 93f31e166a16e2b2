"""Every drafter's tokens on the suite, both backends, greedy and seeded sampling: a record to compare a change by.

One prompt of each suite category (the first turn, chat template), `--tokens` new tokens, for each target and
drafter: plain, prompt lookup, the n-gram cache, the suffix drafter, early exit (torch only), a same-tokenizer
assistant (SmolLM2 on the other backend) and a universal assistant (another tokenizer), each greedy and with
temperature 0.8, top_p 0.95, seed 7. Writes {case: token ids} as JSON to `--out`; with `--compare FILE` it prints
every case whose tokens differ from FILE's and exits 1 if any does (a refactor must change nothing).

    python benchmarks/drafter_outputs.py --out build/outputs-before.json
    python benchmarks/drafter_outputs.py --out build/outputs-after.json --compare build/outputs-before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from assistgen import generate, load_model
from assistgen.bench.dataset import default_suite, read_prompts
from assistgen.drafters.ngram import NGramCache

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


def prompts() -> list[tuple[str, str]]:
    seen, out = set(), []
    for item in read_prompts(default_suite()):
        if item.category not in seen:
            seen.add(item.category)
            out.append((item.category, item.turns[0]))
    return out


def drafters(target_backend: str, models: dict) -> dict:
    """name -> keyword arguments of `generate` for one drafter."""
    other = models["smol-llama" if target_backend == "torch" else "smol-torch"]
    cases = {"plain": {}, "lookup": {"lookup": True}, "ngram": {"ngram_cache": "fresh"}, "suffix": {"suffix": True},
             "assistant": {"assistant": other}, "universal": {"assistant": models["gemma"]}}
    if target_backend == "torch":
        cases["early_exit"] = {"early_exit": True}
    return cases


def run(tokens: int) -> dict[str, list[int]]:
    models = {"smol-torch": load_model("smollm2-135m", backend="torch"),
              "smol-llama": load_model("smollm2-135m", backend="llama.cpp"),
              "gemma": load_model("gemma3-270m", backend="llama.cpp")}
    out = {}
    for target_name, backend in (("smol-torch", "torch"), ("smol-llama", "llama.cpp")):
        target = models[target_name]
        for drafter, kwargs in drafters(backend, models).items():
            for mode, settings in (("greedy", {}), ("sampled", SAMPLED)):
                for category, prompt in prompts():
                    given = dict(kwargs)
                    if given.get("ngram_cache") == "fresh":
                        given["ngram_cache"] = NGramCache()
                    result = generate(target, prompt, chat=True, max_new_tokens=tokens, **given, **settings)
                    out[f"{target_name}/{drafter}/{mode}/{category}"] = result.token_ids
                print(f"{target_name} {drafter} {mode}: done", file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compare", type=Path)
    args = p.parse_args()
    outputs = run(args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(outputs, indent=0))
    print(f"{len(outputs)} cases written to {args.out}")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [k for k in sorted(set(before) | set(outputs)) if before.get(k) != outputs.get(k)]
    for k in differ:
        print(f"differs: {k}")
    print(f"{len(outputs) - len(differ)} of {len(outputs)} cases identical to {args.compare}")
    print(json.dumps({"cases": len(outputs), "differ": len(differ)}))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
