"""A hub-format model on llama.cpp against the GGUF file it came from: decoding speed and exactness.

The embedded GGUF model is loaded on llama.cpp as shipped; its transformers folder (the torch backend's float32
conversion of the same file, a hub-format model) is converted by llama.cpp's converter and quantized by its
quantizer to `--quantize` (`backends/llamacpp/convert.py`), then loaded on llama.cpp too. Both decode the same
prompts greedily (plain and with prompt lookup, which must give the plain tokens), in alternating rounds; prints
decode tokens per second of each (prefill excluded, the best round per prompt), their ratio, and the files' sizes.

    python benchmarks/hub_gguf.py [--model smollm2-135m] [--quantize q4_1] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc

from assistgen import generate, load_model
from assistgen.backends.torch.loading import converted_dir

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a hash map works, in three sentences.",
           "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."]


def decode_rate(model, prompt: str, tokens: int, lookup: bool = False):
    out = generate(model, prompt, chat=True, max_new_tokens=tokens, lookup=lookup)
    return out.stats.decoded_tokens / (out.stats.total_s - out.stats.prefill_s), out.token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="q4_1", help="the GGUF type to convert the folder to (the file's own)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = converted_dir(args.model)
    if not (folder / "config.json").is_file():
        load_model(args.model, backend="torch", fast_linear=False)  # (writes the float32 folder)
        gc.collect()
    models = {"GGUF as shipped": load_model(args.model, backend="llama.cpp"),
              f"folder -> {args.quantize}": load_model(str(folder), backend="llama.cpp", quantize=args.quantize)}
    best = {name: [0.0] * len(PROMPTS) for name in models}
    same_as_plain = {name: True for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            for i, prompt in enumerate(PROMPTS):
                rate, ids = decode_rate(model, prompt, args.tokens)
                best[name][i] = max(best[name][i], rate)
                same_as_plain[name] &= decode_rate(model, prompt, args.tokens, lookup=True)[1] == ids
    print("| model | file (MB) | decode tok/s per prompt | mean | lookup == plain |")
    print("|---|---:|---|---:|---|")
    means = {}
    for name, model in models.items():
        means[name] = sum(best[name]) / len(PROMPTS)
        print(f"| {name} | {model.path.stat().st_size / 1e6:.0f} | {', '.join(f'{r:.1f}' for r in best[name])} | "
              f"{means[name]:.1f} | {same_as_plain[name]} |")
    first, second = means.values()
    print(f"converted / shipped: {second / first:.3f}")


if __name__ == "__main__":
    main()
