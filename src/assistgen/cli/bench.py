"""`assistgen bench`: wires the command line to the bench library (dataset, runner, report) and prints the results.

Output: a readable table on stdout, then one JSON line last (figures, the verification-cost curve,
the settings, peak memory: the process's, and the GPU's with `--device cuda`). `--out` appends one
record per prompt and method as it goes; `--plot` draws speed-ups per category and per temperature
(or lookahead).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from assistgen.api import load_model
from assistgen.bench.dataset import default_suite, extraction_suite, read_prompts, select
from assistgen.bench.report import aggregate, format_table, plot
from assistgen.bench.runner import HF_METHODS, SOURCES, Method, Runner, run_bench, terminal_progress
from assistgen.cli.options import add_model, add_placement, load_target_and_assistant, placement, structure_from
from assistgen.cli.schedule import parse_schedule
from assistgen.policy.costs import measured_costs


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p, help="target: alias, hub id, folder or .gguf")
    p.add_argument("--assistant", "-a", help="assistant model (any tokenizer) for the assistant methods")
    p.add_argument("--methods", help="comma-separated: plain; lookup, ngram, assistant, early-exit or several "
                                     "joined by + (cheapest first), each optionally @schedule; hf-plain, hf-lookup, "
                                     "hf-assistant (default: plain, lookup and their transformers equivalents, "
                                     "plus assistant ones with --assistant)")
    p.add_argument("--dataset", help="JSONL prompt set (default: the shipped suite; 'extraction': the shipped "
                                     "extraction prompts, each with the JSON schema of its answer)")
    p.add_argument("--json-schema", metavar="FILE", help="every prompt without a schema of its own answers in JSON "
                                                         "following this schema (assistgen's methods only)")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument("--n", type=int, help="random subset of N prompts (reproducible with --seed)")
    p.add_argument("--seed", type=int, default=0, help="subset and sampling seed")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="apply the target's chat template")
    p.add_argument("--turn", type=int, default=1, help="which turn of multi-turn prompts to use (1-based)")
    p.add_argument("--temperatures", default="0", help="comma-separated sweep, e.g. 0,0.2,0.4,0.6,0.8,1.0,1.2")
    p.add_argument("--lookaheads", help="comma-separated k sweep: each drafter method also runs @constant:k")
    p.add_argument("--out", help="append one JSON record per prompt and method; rerunning skips what is done")
    p.add_argument("--plot", help="write a PNG of the speed-ups")
    p.add_argument("--no-cost-curve", action="store_true", help="skip measuring t(k)/t(1) of the target")
    p.add_argument("--no-fast-linear", action="store_true", help="keep PyTorch's own linear layers")
    p.add_argument("--quantize", help="int8 | int4: assistgen's methods run the quantized model(s); transformers' "
                                      "methods run the unquantized ones, loaded beside them")
    p.add_argument("--repeats", type=int, default=1, help="run every prompt and method this many times (interleaved)")
    add_placement(p)


def parse_method(spec: str) -> Method:
    """A benchmark method from its text: NAME[@SCHEDULE] (the schedule in `--schedule`'s form)."""
    name, _, schedule = spec.strip().partition("@")
    engine = "hf" if name.startswith("hf-") else "assistgen"
    drafter = name[3:] if engine == "hf" else name
    sources = drafter.split("+")
    known = HF_METHODS if engine == "hf" else ("plain",) if drafter == "plain" else SOURCES
    repeated = len(set(sources)) < len(sources)
    if any(s not in known for s in sources) or (engine == "hf" and len(sources) > 1) or repeated:
        raise ValueError(f"Unknown method {spec!r}: use plain, or sources joined by '+' from "
                         f"{', '.join(SOURCES)} (optionally @schedule), or hf-plain, hf-lookup, hf-assistant.")
    if "assistant" in sources and "early-exit" in sources:
        raise ValueError(f"{spec!r}: one model drafter at a time (assistant or early-exit).")
    if schedule:
        if engine == "hf":
            raise ValueError(f"{spec!r}: transformers' methods take no schedule.")
        if drafter == "plain":
            raise ValueError(f"{spec!r}: plain decoding drafts nothing, so it takes no schedule.")
    return Method(spec.strip(), engine, drafter, parse_schedule(schedule) if schedule else None)


def methods_from(args: argparse.Namespace) -> list:
    if args.methods:
        specs = [s for s in args.methods.split(",") if s.strip()]
    else:
        specs = ["plain", "lookup", "hf-plain", "hf-lookup"] + (["assistant", "hf-assistant"] if args.assistant else [])
    if "plain" not in specs:
        specs.insert(0, "plain")  # every speed-up is measured against it
    if args.lookaheads:
        ks = [int(k) for k in args.lookaheads.split(",")]
        drafters = [s for s in specs if s and not s.startswith("hf-") and s != "plain" and "@" not in s]
        specs += [f"{d}@constant:{k}" for d in drafters for k in ks]
    return [parse_method(s) for s in dict.fromkeys(specs)]


def validity(records: list[dict]) -> dict[str, tuple[int, int]]:
    """{method: (answers that are valid JSON following their schema, answers)} over the structured runs."""
    out: dict[str, tuple[int, int]] = {}
    for r in records:
        if "valid" in r:
            ok, n = out.get(r["method"], (0, 0))
            out[r["method"]] = (ok + bool(r["valid"]), n + 1)
    return out


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def peak_gpu_mb(device) -> float | None:
    """The peak memory PyTorch allocated on a CUDA `device` so far, in MiB (None for the CPU)."""
    import torch

    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def run_command(args: argparse.Namespace) -> int:
    dataset = extraction_suite() if args.dataset == "extraction" else args.dataset or default_suite()
    prompts = read_prompts(dataset)
    prompts = select(prompts, args.categories.split(",") if args.categories else None, args.n, args.seed)
    methods = methods_from(args)
    if any(m.needs_assistant for m in methods) and not args.assistant:
        raise ValueError("The assistant methods need --assistant MODEL.")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1.")
    if not 1 <= args.turn:
        raise ValueError("--turn counts from 1.")
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1.")
    where = {k: v for k, v in placement(args).items() if k != "max_memory"}  # (transformers' runs: no budget)
    target, assistant = load_target_and_assistant(args)
    runner = Runner(target, assistant, args.max_new_tokens, args.chat, args.turn, args.seed)
    if args.json_schema:
        runner.schema = structure_from(argparse.Namespace(json_schema=args.json_schema)).spec
    if args.quantize and any(m.engine == "hf" for m in methods):
        runner.hf_target = load_model(args.model, fast_linear=False, **{**where, "backend": "torch"})
        if assistant is not None and any(m.engine == "hf" and m.needs_assistant for m in methods):
            runner.hf_assistant = load_model(args.assistant, fast_linear=False,
                                             **{**placement(args, assistant=True), "backend": "torch"})
    records, ran = run_bench(runner, prompts, methods, temperatures, Path(args.out) if args.out else None,
                             terminal_progress, args.repeats)
    curve = None if args.no_cost_curve else list(measured_costs(target).curve)
    rows = aggregate(records, curve)
    print(format_table(rows))
    valid = validity(records)
    if valid:
        print("valid JSON following the schema: " + ", ".join(f"{m} {ok}/{n}" for m, (ok, n) in valid.items()))
    quantized = f" (quantized {args.quantize})" if args.quantize else ""
    device = target.device
    gpu = peak_gpu_mb(device)
    print(f"peak RSS of this run: {peak_rss_mb():,.0f} MiB{quantized}"
          + (f"; peak GPU memory on {device}: {gpu:,.0f} MiB" if gpu is not None else ""))
    if curve:
        print(f"verification cost t(n)/t(1), n = 1..{len(curve)} tokens per forward: "
              + " ".join(f"{x:.2f}" for x in curve))
    if args.plot:
        plot(rows, args.plot, curve)
        print(f"plot written to {args.plot}")
    print(json.dumps({"benchmark": "assistgen-bench", "model": target.name,
                      "assistant": assistant.name if assistant else None, "quantize": args.quantize,
                      "device": str(device), "dtype": target.describe().get("dtype", "gguf"),
                      "repeats": args.repeats, "prompts": len(prompts), "peak_rss_mb": peak_rss_mb(),
                      "peak_gpu_mb": gpu,
                      "methods": [m.spec for m in methods], "temperatures": temperatures,
                      "valid_json": {m: list(v) for m, v in valid.items()},
                      "max_new_tokens": args.max_new_tokens, "runs_this_time": ran, "cost_curve": curve,
                      "rows": rows}))
    return 0
