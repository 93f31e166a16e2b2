"""The torch backend's two ways to run weights beyond a memory budget on the CPU, measured under one cap:
the memory map (transformers' safetensors loading, what `max_memory` uses) against accelerate's disk offload
(`device_map="auto"` with `max_memory={"cpu": budget}` and an `offload_folder`: layers beyond the budget saved as
numpy memory maps and copied in by hooks for each pass).

Contract: needs root and cgroup v1's memory controller, like `offload.py`. Each way runs transformers' own greedy
`generate()` in a child process inside a fresh memory group limited to the child's baseline plus `--max-memory`,
the weights' files dropped from the page cache first; it prints tokens per second, the group's peak, and whether the
tokens match. transformers' loop on both sides, so the figures compare the mechanisms, not assistgen's decoding.

    python benchmarks/offload_mechanisms.py --model smollm2-135m --max-memory 270MB --tokens 24
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from assistgen.backends.budget import megabytes, parse_budget
from assistgen.bench.memory_group import MemoryGroup, cgroups_available, drop_from_page_cache

CHILD = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, way, budget, tokens, offload = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
extra = {} if way == "mmap" else {"device_map": "auto", "max_memory": {"cpu": budget}, "offload_folder": offload}
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
ids = AutoTokenizer.from_pretrained(folder)("def fibonacci(n):", return_tensors="pt").input_ids
placed = sorted(set(getattr(model, "hf_device_map", {"": "cpu"}).values()))
with torch.inference_mode():
    model.generate(ids, max_new_tokens=2, do_sample=False)  # (warm-up: the first pass reads what it can keep)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "seconds": seconds, "placed": placed}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="an embedded alias or a model folder (safetensors)")
    parser.add_argument("--max-memory", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    why = cgroups_available()
    if why:
        raise SystemExit(f"benchmarks/offload_mechanisms.py: {why}. Run it as root with cgroup v1's memory controller.")
    sys.path.insert(0, str(Path(__file__).parent))
    from offload import baseline_bytes, weight_files

    files = weight_files(args.model, "torch", None)
    folder = files[0].parent
    budget = parse_budget(args.max_memory)
    limit = baseline_bytes() + budget
    weights = sum(f.stat().st_size for f in files)
    print(f"{args.model}: {megabytes(weights)} of safetensors; budget {megabytes(budget)}, group limit "
          f"{megabytes(limit)}", flush=True)
    results = {}
    for way in ("mmap", "disk-offload"):
        with tempfile.TemporaryDirectory() as offload:
            for f in files:
                drop_from_page_cache(f)
            group = MemoryGroup(limit)
            try:
                done = subprocess.run([sys.executable, "-c", CHILD, str(folder), way, str(budget), str(args.tokens),
                                       offload], capture_output=True, text=True, preexec_fn=group.add_self)
                peak = group.peak()
            finally:
                group.remove()
        if done.returncode != 0:
            print(f"{way}: failed (rc {done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        results[way] = r = json.loads(line[len("RESULT "):])
        print(f"{way}: {args.tokens / r['seconds']:.2f} tok/s; peak {megabytes(peak)} of {megabytes(limit)}; "
              f"placed on {r['placed']}", flush=True)
    if len(results) == 2:
        same = results["mmap"]["tokens"] == results["disk-offload"]["tokens"]
        ratio = results["mmap"]["seconds"] / results["disk-offload"]["seconds"]
        print(f"disk offload vs mmap: {ratio:.2f}x the speed; same tokens: {same}")


if __name__ == "__main__":
    main()
