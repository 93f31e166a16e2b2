"""What grammar-constrained decoding costs end to end: tokens per second of JSON-schema generations, free and
constrained, plain and drafted, and the share of the constrained runs' time spent in the grammar (its checks,
masks and advances, timed around `core.constraint.Constraint`'s methods). Greedy; the drafted output is asserted
equal to the plain one. Prints a table; run it on a tree whose `core/constraint.py` uses the engine to measure.

    python benchmarks/structured_speed.py [--model smollm2-135m] [--backend llama.cpp] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "Describe a fictional person as JSON with their name, age, email, a few tags and an address.",
    "Give me a JSON record for a new library member: name, age, email, interests as tags, home address.",
    "Invent a customer profile in JSON (name, age, email, tags, address with city and zip, active flag).",
    "Return JSON for the author of a short story: name, age, email, tags, where they live.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}


def timed_constraint():
    """Wrap Constraint's per-step methods with a clock; returns the dict the seconds accumulate in."""
    from assistgen.core import constraint

    spent = {"s": 0.0}
    for name in ("check", "mask", "advance", "jump_forward"):
        original = getattr(constraint.Constraint, name)

        def wrapped(self, *a, _f=original, **kw):
            t = time.perf_counter()
            try:
                return _f(self, *a, **kw)
            finally:
                spent["s"] += time.perf_counter() - t
        setattr(constraint.Constraint, name, wrapped)
    return spent


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--backend", default="llama.cpp")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    from assistgen import Structure, generate, load_model
    from assistgen.chat.templates import encode_chat

    spent = timed_constraint()
    model = load_model(args.model, backend=args.backend)
    structure = Structure("json_schema", json.dumps(SCHEMA))
    prompts = [encode_chat(model, [{"role": "user", "content": text}]) for text in PROMPTS]
    generate(model, prompts[0], max_new_tokens=8, structure=structure)  # (warm-up: the tokenizer's grammar view)
    rows = []
    for label, kwargs in (("free, plain", {}), ("constrained, plain", {"structure": structure}),
                          ("constrained, lookup", {"structure": structure, "lookup": True})):
        spent["s"], tokens, start, outputs = 0.0, 0, time.perf_counter(), []
        for ids in prompts:
            out = generate(model, ids, max_new_tokens=args.tokens, **kwargs)
            tokens += len(out.token_ids)
            outputs.append(out.token_ids)
        elapsed = time.perf_counter() - start
        rows.append((label, tokens, tokens / elapsed, spent["s"] / elapsed, outputs))
    assert rows[1][4] == rows[2][4], "drafted constrained output differs from plain constrained output"
    from assistgen.core import constraint
    print(f"model {args.model} ({args.backend}), {len(prompts)} prompts, up to {args.tokens} tokens; "
          f"constraint module: {constraint.__doc__.splitlines()[0]}")
    print("| run | tokens | tokens/s | time in the grammar |")
    print("|---|---:|---:|---:|")
    for label, tokens, rate, share, _ in rows:
        print(f"| {label} | {tokens} | {rate:.1f} | {share * 100:.1f} % |")


if __name__ == "__main__":
    main()
