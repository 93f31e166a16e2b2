"""How much of a decoding step on the llama.cpp backend is Python: one plain generation timed step by step.

The wall time of each step of `generate()` (plain decoding, so one row a pass) is split into the time inside
`llama_decode` and the logits copy (the backend's C calls, timed around them here) and the rest (the loop, the
sampler, text decoding, the policy's bookkeeping: Python). Prints the per-step figures and their share, then
one JSON line.

    python benchmarks/llama_step_profile.py --model qwen2.5-coder-1.5b --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

from assistgen import generate, load_model
from assistgen.api import encode_prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lookup", action="store_true", help="prompt lookup with the adaptive policy")
    args = p.parse_args()
    model = load_model(args.model, backend="llama.cpp")
    ids = encode_prompt(model, "Write a Python function that merges two sorted lists, with comments.",
                        chat=getattr(model.tokenizer, "chat_template", None) is not None)
    inside: list[float] = []
    decode = model._decode

    def timed(feeds, *args, **kwargs):
        start = time.perf_counter()
        out = decode(feeds, *args, **kwargs)
        inside.append(time.perf_counter() - start)
        return out

    generate(model, ids, max_new_tokens=4)  # warm
    model._decode = timed
    out = generate(model, ids, max_new_tokens=args.max_new_tokens, lookup=args.lookup)
    model._decode = decode
    steps = out.stats.target_forward_passes - 1  # the prefill excluded
    decode_wall = out.stats.total_s - out.stats.prefill_s
    in_c = sum(inside[1:])
    python = decode_wall - in_c
    row = {"model": args.model, "tokens": len(out.token_ids), "steps": steps,
           "step_ms": 1000 * decode_wall / steps, "llama_decode_ms": 1000 * in_c / steps,
           "python_ms": 1000 * python / steps, "python_share": python / decode_wall}
    print(f"{args.model}: {steps} steps, {row['step_ms']:.2f} ms a step, of which llama_decode + logits copy "
          f"{row['llama_decode_ms']:.2f} ms and Python {row['python_ms']:.2f} ms ({100 * row['python_share']:.1f} %)")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
