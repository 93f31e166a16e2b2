"""What a wide pass costs on the llama.cpp backend's kernels: row-exact (the switch on) against ggml's fast ones.

Kernel level (`--level kernels`): for each matmul weight type and row length of a model (`kernels.model_cases`, with
the model's own output sizes for the largest, capped at 8,960), the seconds of one product with n rows, n = 1, 4, 8,
17, 33, 65, in each buffer type ggml gives the weight, with the switch on and off; printed as t(1) and v(n) = t(n)/t(1).
Model level (`--level model`, the default): after a 256-token context, one pass over n new tokens with logits for
every row (what a verification is), n = 1..65, on the row-exact kernels and on the fast ones; printed as t(1) and
v(k) = t(k+1)/t(1) for k = 1, 3, 7, 11, 16, 32, 64 (best of `--repeats`, rounds alternating the two). One JSON line
last. Run one process per library (`LLAMA_CPP_LIB_PATH` picks another build) and nothing else at once.

    python benchmarks/llama_kernels.py --model qwen2.5-coder-1.5b [--level kernels]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from assistgen import load_model
from assistgen.backends.embedded import EMBEDDED
from assistgen.backends.llamacpp.kernels import _Cpu, _multiply, _quantized, _takes, _Weight, library_dir, model_cases
from assistgen.backends.measure import random_context

KS = (1, 3, 7, 11, 16, 32, 64)
KERNEL_ROWS = (1, 4, 8, 17, 33, 65)


def model_level(spec: str, context: int, repeats: int) -> dict:
    model = load_model(spec, backend="llama.cpp")
    ids, context = random_context(model, context, max(KS) + 1, seed=0)
    cache = model.new_cache()
    cache.feed(ids[:context])
    switch = model._switch  # the benchmark holds the kernels: each pass sets the switch to `exact` as it starts
    best = {True: {}, False: {}}
    for _ in range(repeats):
        for exact in (True, False):
            model._switch = (lambda on, s=switch, e=exact: s(e))
            for n in (1, *(k + 1 for k in KS)):
                start = time.perf_counter()
                cache.feed(ids[context:context + n], logits_to_keep=n)
                elapsed = time.perf_counter() - start
                cache.crop(context)
                best[exact][n] = min(best[exact].get(n, elapsed), elapsed)
    model._switch = switch
    out = {}
    for exact, label in ((True, "row-exact"), (False, "fast")):
        t1 = best[exact][1]
        out[label] = {"t1_ms": round(t1 * 1e3, 2), **{f"v{k}": round(best[exact][k + 1] / t1, 2) for k in KS}}
    return out


def kernel_level(spec: str, repeats: int) -> list[dict]:
    cpu = _Cpu(library_dir(), threads=2)
    rng = np.random.default_rng(0)
    rows_out = []
    for case in model_cases(EMBEDDED[spec].gguf_path(), out_rows=2048):
        data = _quantized(cpu.api, case, rng)
        for buft in [*(b for b in cpu.extra if _takes(cpu, case, b)), cpu.plain]:
            weight = _Weight(cpu, case, buft, data)
            for on in (True, False):
                cpu.switch(on)
                times = {}
                for n in KERNEL_ROWS:
                    x = rng.standard_normal((n, case.row_length)).astype(np.float32)
                    best = float("inf")
                    for _ in range(repeats):
                        start = time.perf_counter()
                        _multiply(cpu, weight, case, x)
                        best = min(best, time.perf_counter() - start)
                    times[n] = best
                rows_out.append({"case": case.name, "buffer": cpu.name(buft), "kernels": "row-exact" if on else "fast",
                                 "t1_ms": round(times[1] * 1e3, 3),
                                 **{f"v{n}": round(times[n] / times[1], 2) for n in KERNEL_ROWS[1:]}})
            weight.close()
    cpu.switch(True)
    return rows_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--level", choices=("model", "kernels"), default="model")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.level == "kernels":
        rows = kernel_level(args.model, args.repeats)
        print(f"{'weight':<14} {'buffer':<11} {'kernels':<10} {'t(1) ms':>8} " +
              " ".join(f"{'v' + str(n):>6}" for n in KERNEL_ROWS[1:]))
        for r in rows:
            print(f"{r['case']:<14} {r['buffer']:<11} {r['kernels']:<10} {r['t1_ms']:>8.3f} " +
                  " ".join(f"{r['v' + str(n)]:>6.2f}" for n in KERNEL_ROWS[1:]))
        print(json.dumps({"model": args.model, "library": str(library_dir()), "kernels": rows}))
        return
    out = model_level(args.model, args.context, args.repeats)
    print(f"{'kernels':<10} {'t(1) ms':>8} " + " ".join(f"{'v(' + str(k) + ')':>7}" for k in KS))
    for label, r in out.items():
        print(f"{label:<10} {r['t1_ms']:>8.2f} " + " ".join(f"{r['v' + str(k)]:>7.2f}" for k in KS))
    print(json.dumps({"model": args.model, "library": str(library_dir()), "context": args.context, **out}))


if __name__ == "__main__":
    main()
