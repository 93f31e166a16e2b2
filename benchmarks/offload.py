"""Offloaded weights measured for real: `assistgen bench` with the target in a memory cgroup capped below its weights.

Contract: needs root and cgroup v1's memory controller (/sys/fs/cgroup/memory); refuses with a message saying so
elsewhere. It loads the target and the configurations' assistants once outside any cap first (a first use converts
their tokenizers, a transient a tight group would kill the child for; the result is cached). It measures the disk's
read speed on the target's GGUF file (the file dropped from the page cache first,
then read once in 16 MiB blocks) and the baseline of the child process (Python with assistgen imported, no model),
then runs each configuration as a child `assistgen bench ... --max-memory (LIMIT - baseline)` inside a fresh memory
group limited to LIMIT (`memory.limit_in_bytes`, page cache included; swap off in the group), so that every weight
page beyond what fits is read from the file again when needed. After each child it reads the group's peak usage
(`memory.max_usage_in_bytes`), its anonymous memory (polled: what cannot be evicted; LIMIT minus what decoding keeps is
the room left for the weights' pages) and page-ins, and removes the group. The records (tokens, seconds, whether the
greedy output equals plain's) go to `--out`; the table is the bench's own, with a line per configuration of its
peak, its room for the weights and page-ins.

    sudo python benchmarks/offload.py --model qwen2.5-coder-1.5b --limit 1500MB --context 1024 \\
        --config "--assistant qwen2.5-coder-0.5b --methods plain,lookup,ngram,assistant" \\
        --config "--assistant smollm2-135m --methods plain,assistant" --categories code,summarization --n 4
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from assistgen.backends.budget import megabytes, parse_budget
from assistgen.backends.llamacpp.loading import gguf_file
from assistgen.bench.memory_group import MemoryGroup, cgroups_available, drop_from_page_cache

BLOCK = 16 << 20


def weight_files(spec: str, backend: str, quantize: str | None) -> list[Path]:
    """The files a model's weights are memory-mapped from: its GGUF file (llama.cpp), its quantized copy or its
    folder's safetensors (torch: made once first, outside any cap, by loading it in a child)."""
    if backend == "llama.cpp":
        path = gguf_file(spec)
        if path is None or not path.is_file():
            raise SystemExit(f"{spec}: not a GGUF model here (an embedded alias or a .gguf path).")
        return [path]
    from assistgen.backends.torch.loading import _source, converted_dir
    from assistgen.backends.torch.quantize import WEIGHTS
    from assistgen.paths import cache_root

    options = f"backend='torch', quantize={quantize!r}"
    subprocess.run([sys.executable, "-c", f"from assistgen import load_model; load_model({spec!r}, {options})"],
                   check=True)
    source = _source(spec)
    if quantize:
        return [cache_root() / "quantized" / f"{source.key}-{quantize}" / WEIGHTS]
    folder = source.folder or (converted_dir(spec) if source.entry else source.converted)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{spec}: no safetensors in {folder} (the torch backend memory-maps those).")
    return files


def first_uses(model: str, backend: str, configs: list[str]) -> None:
    """Load the target and each configuration's assistant once, outside any cap, in a child: a first use converts
    their tokenizers (hundreds of MB for a while, which a tight group would kill the bench for), and what it writes is
    cached for the capped runs."""
    specs = [(model, backend)]
    for config in configs:
        words = shlex.split(config)
        for flag in ("--assistant", "-a"):
            if flag in words[:-1]:
                specs.append((words[words.index(flag) + 1], "llama.cpp" if backend == "llama.cpp" else "auto"))
    loads = "; ".join(f"load_model({spec!r}, backend={b!r})" for spec, b in dict.fromkeys(specs))
    subprocess.run([sys.executable, "-c", f"from assistgen import load_model; {loads}"], check=True)


def read_speed(path: Path) -> float:
    """Bytes per second of one sequential read of `path` after dropping it from the page cache."""
    drop_from_page_cache(path)
    start, total = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(BLOCK):
            total += len(chunk)
    elapsed = time.perf_counter() - start
    drop_from_page_cache(path)
    return total / elapsed


def baseline_bytes() -> int:
    """Peak memory of a child that imports assistgen and its backends and loads nothing (measured in a group)."""
    group = MemoryGroup(1 << 40)
    try:
        code = "import assistgen.backends.llamacpp.loading, assistgen.cli.bench, assistgen.cli.main, matplotlib.pyplot"
        subprocess.run([sys.executable, "-c", code], check=True, preexec_fn=group.add_self)
        return group.peak()
    finally:
        group.remove()


def run_capped(argv: list[str], limit: int) -> dict:
    """Run `argv` in a fresh group limited to `limit`; its peak usage, its anonymous memory (polled every 0.2 s: what
    the kernel cannot evict; the peak, and the median over the run's second half, which is what decoding keeps while
    the peak may be a moment of loading or measuring) and the pages it read in."""
    group = MemoryGroup(limit)
    try:
        start, anon = time.perf_counter(), []
        child = subprocess.Popen(argv, preexec_fn=group.add_self)
        while child.poll() is None:
            anon.append(group.stat("total_rss"))
            time.sleep(0.2)
        late = sorted(anon[len(anon) // 2:]) or [0]
        return {"rc": child.returncode, "seconds": time.perf_counter() - start, "peak": group.peak(),
                "peak_anon": max(anon, default=0), "decoding_anon": late[len(late) // 2],
                "pgmajfault": group.stat("total_pgmajfault"), "pgpgin": group.stat("total_pgpgin")}
    finally:
        group.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--backend", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--quantize", choices=("int8", "int4"), help="torch backend: its quantized copy")
    cap = parser.add_mutually_exclusive_group(required=True)
    cap.add_argument("--limit", help="the group's limit: all the child may keep resident")
    cap.add_argument("--max-memory", help="the model's budget (--max-memory of the bench): the group's limit is "
                                          "that plus the child's baseline (Python and assistgen imported)")
    parser.add_argument("--config", action="append", required=True,
                        help="assistgen bench arguments of one configuration (repeatable)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--categories")
    parser.add_argument("--n", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("out/offload.jsonl"))
    args = parser.parse_args()
    why = cgroups_available()
    if why:
        raise SystemExit(f"benchmarks/offload.py: {why}. Run it as root on a Linux machine with cgroup v1's memory "
                         "controller mounted at /sys/fs/cgroup/memory.")
    files = weight_files(args.model, args.backend, args.quantize)
    first_uses(args.model, args.backend, args.config)
    speed = sum(f.stat().st_size for f in files) / sum(f.stat().st_size / read_speed(f) for f in files)
    base = baseline_bytes()
    limit = parse_budget(args.limit) if args.limit else base + parse_budget(args.max_memory)
    budget = limit - base
    weights = sum(f.stat().st_size for f in files)
    print(f"target {', '.join(f.name for f in files)}: {megabytes(weights)}; disk read {speed / 1e9:.2f} GB/s; "
          f"group limit {megabytes(limit)}; child baseline (imports) {megabytes(base)}, so --max-memory "
          f"{megabytes(budget)}",
          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cli = [str(Path(sys.executable).with_name("assistgen")), "bench", "--model", args.model, "--backend", args.backend,
           "--max-memory", str(budget), "--max-new-tokens", str(args.max_new_tokens), "--out", str(args.out)]
    if args.backend == "llama.cpp":
        cli += ["--assistant-backend", "llama.cpp", "--context", str(args.context)]
    cli += ["--quantize", args.quantize] if args.quantize else []
    cli += ["--categories", args.categories] if args.categories else []
    cli += ["--n", str(args.n)] if args.n else []
    for config in args.config:
        for f in files:
            drop_from_page_cache(f)
        r = run_capped(cli + shlex.split(config), limit)
        room = limit - r["decoding_anon"]
        print(f"[{config}] rc {r['rc']}, {r['seconds']:.0f} s; peak {megabytes(r['peak'])} of {megabytes(limit)}; "
              f"anonymous: peak {megabytes(r['peak_anon'])}, while decoding {megabytes(r['decoding_anon'])}, so room "
              f"for file pages (weights) {megabytes(room)}, {room / weights:.0%} of the target's file; major faults "
              f"{r['pgmajfault']}, pages in {r['pgpgin']}", flush=True)


if __name__ == "__main__":
    main()
