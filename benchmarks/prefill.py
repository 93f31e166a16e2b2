"""Prefill of a quantized model: seconds per prompt length, and how much of it is dequantization.

A prompt longer than `quantized_layers.KERNEL_ROWS` tokens dequantizes every layer to bf16 for one matrix product
(`QuantizedLinear.dequantized`). This times one forward over n random tokens from an empty cache (best of
`--repeats`) for each n in `--rows`, and the seconds spent inside `dequantized` during it. With
`--compare`, the int4 dequantization is also run the way it was computed before 2026-12-01 (a fresh
[out, in] buffer for each of q - 8, * scale, + zero), alternating with the current in-place one in the
same process, so the two are measured under the same conditions. Prints a table, then one JSON line.

    python benchmarks/prefill.py --model qwen2.5-coder-1.5b --quantize int4 --compare
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from assistgen import load_model
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.quantization_schemes import COMPUTE, unpack_int4
from assistgen.backends.torch.quantized_layers import Int4Linear, QuantizedLinear


def out_of_place(self: Int4Linear) -> torch.Tensor:
    """The int4 dequantization as computed before 2026-12-01: bitwise the same weights, more temporary buffers."""
    q = unpack_int4(self.weight, self.padded_out, self.in_features)[: self.out_features].to(COMPUTE)
    q = q.view(self.out_features, -1, self.group)
    sz = self.scale_zero[:, : self.out_features]
    scale, zero = (sz[..., i].T.contiguous()[..., None] for i in (0, 1))
    return ((q - 8) * scale + zero).view(self.out_features, self.in_features)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--quantize", default="int4", choices=["int8", "int4"])
    p.add_argument("--rows", default="64,128,129,145,256,600", help="prompt lengths to time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", action="store_true", help="also time the previous (out-of-place) int4 dequantization")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, quantize=args.quantize)
    cache = KVCache(model)
    vocab = min(model.vocab_size, len(model.tokenizer))
    ids = torch.randint(3, vocab, (max(int(n) for n in args.rows.split(",")),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    current = {cls: cls.dequantized for cls in {type(m) for m in model.hf.modules() if isinstance(m, QuantizedLinear)}}
    ways = {"in place": current}
    if args.compare and Int4Linear in current:
        ways["out of place"] = {**current, Int4Linear: out_of_place}
    spent = [0.0]

    def timed(function):
        def wrapper(self):
            start = time.perf_counter()
            out = function(self)
            spent[0] += time.perf_counter() - start
            return out
        return wrapper

    results = {way: {} for way in ways}
    with torch.inference_mode():
        for n in [int(n) for n in args.rows.split(",")]:
            best = {way: (float("inf"), 0.0) for way in ways}
            for _ in range(args.repeats):  # round-robin over the ways: noise spoils one round of each
                for way, functions in ways.items():
                    for cls, function in functions.items():
                        cls.dequantized = timed(function)
                    cache.crop(0)
                    spent[0] = 0.0
                    start = time.perf_counter()
                    cache.feed(ids[:n])
                    elapsed = time.perf_counter() - start
                    best[way] = min(best[way], (elapsed, spent[0]))
            for way in ways:
                results[way][n] = {"seconds": best[way][0], "dequantize_s": best[way][1], "tok_s": n / best[way][0]}
    for cls, function in current.items():
        cls.dequantized = function
    print(f"{model.name} ({args.quantize}), prefill from an empty cache, best of {args.repeats}, "
          f"{args.threads} threads")
    print(f"{'way':<14}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'dequantize s':>14}")
    for way, by_n in results.items():
        for n, r in by_n.items():
            print(f"{way:<14}{n:>8}{r['seconds']:>9.2f}{r['tok_s']:>8.0f}{r['dequantize_s']:>14.2f}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:,.0f} MiB")
    print(json.dumps({"benchmark": "prefill", "model": args.model, "quantize": args.quantize,
                      "threads": args.threads, "results": results, "peak_rss_mib": rss}))


if __name__ == "__main__":
    main()
