"""Peak resident memory per configuration: each loads its model(s) in a fresh process and generates.

    python benchmarks/memory.py --model qwen2.5-coder-1.5b --assistant qwen2.5-coder-0.5b --quantize none,int8,int4

For every quantization it runs a child process that loads the target (and the assistant, when given)
from the cache, generates 32 tokens with the assistant drafting, and reports `ru_maxrss` (peak RSS).
The first use of a configuration converts or quantizes once; run it twice to measure cached loads.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import resource, sys, time
import assistgen
target_name, assistant_name, quantize = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
start = time.perf_counter()
target = assistgen.load_model(target_name, quantize=quantize)
assistant = assistgen.load_model(assistant_name, quantize=quantize) if assistant_name else None
loaded = time.perf_counter() - start
out = assistgen.generate(target, "Write a Python function that adds two numbers.", chat=True, max_new_tokens=32,
                         assistant=assistant)
print("RESULT", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, loaded, out.stats.new_tokens)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--assistant", default="")
    p.add_argument("--quantize", default="none,int8,int4")
    args = p.parse_args()
    rows = []
    for scheme in args.quantize.split(","):
        q = "" if scheme == "none" else scheme
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, args.assistant, q], capture_output=True,
                              text=True)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            raise SystemExit(f"{scheme}: the child failed\n{done.stderr[-2000:]}")
        _, rss, load_s, _ = line.split()
        rows.append({"quantize": scheme, "peak_rss_mib": round(float(rss)), "load_s": round(float(load_s), 1)})
    pair = f"{args.model} + {args.assistant}" if args.assistant else args.model
    print(f"{pair}: peak RSS while loading and generating 32 tokens")
    print(f"{'weights':<10}{'peak RSS MiB':>14}{'load s':>9}")
    for r in rows:
        print(f"{r['quantize']:<10}{r['peak_rss_mib']:>14,}{r['load_s']:>9}")
    print(json.dumps({"benchmark": "memory", "model": args.model, "assistant": args.assistant or None, "rows": rows}))


if __name__ == "__main__":
    main()
