"""Timing on real-size models with random weights: the GPU check's measurements, with no weights to download.

Contract: for each size in `--sizes` (`qwen2.5-1.5b` and `qwen2.5-0.5b`: Qwen2.5's real configurations, Qwen2.5-Coder's
too; `tiny`: a 2-layer model for a smoke run on any device) it builds the model from its transformers
configuration with random weights, in `--dtype` on `--device`, behind a word-level tokenizer of the same vocabulary
size, and measures, each figure the median of `--repeats` runs after a warm-up:
- plain: greedy decoding of `--tokens` new tokens after a random `--prompt`-token prompt, assistgen's `generate`
  against transformers' `generate()` on the same module and ids, both to exactly that many tokens;
- the verification cost curve v(k) = t(k+1 rows) / t(1 row) for k = 0..16 (`backends.measure.step_times`) and,
  for batches of B = 1..32 sequences, t(B sequences x (k+1) rows) / t(B sequences x 1 row) and t(B x 1) / t(1 x 1);
- the batched engine's aggregate tok/s with B = 1, 8 and 32 requests at once (`serving.batching.BatchEngine`,
  plain decoding);
- the Python time per step: one decode step's wall time minus the device time of its kernels (torch.profiler's
  self device times; on a CPU the whole step is host time and the figure is left out);
- projected speed-ups: `policy.gain.best_draft_length` over this device's curve at the acceptance rates the CPU
  runs recorded (`--acceptance`, docs/results/*.jsonl: accepted over drafted tokens per method), with the drafter's
  cost per token measured here where the drafter is a model (the 0.5B size drafting for the 1.5B).
Prints progress lines with timestamps and a table per size; writes everything to `--out` as JSON.

    python benchmarks/gpu_random.py --device cuda --dtype bfloat16 --out gpu-results/random.json
    python benchmarks/gpu_random.py --device cpu --dtype float32 --sizes tiny --tokens 8 --repeats 1  (smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from assistgen import generate
from assistgen.api import make_drafter
from assistgen.backends.measure import random_context, step_times
from assistgen.backends.torch.model import Model
from assistgen.backends.torch.reference import hf_generate
from assistgen.config import GenerationConfig
from assistgen.policy.gain import best_draft_length
from assistgen.policy.rules import Constant
from assistgen.serving.batching import BatchEngine, EngineSettings

SIZES = {  # Qwen2.5's published configurations (the Coder models share them)
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
DRAFTS_FOR = {"qwen2.5-1.5b": "qwen2.5-0.5b"}  # the size whose step cost is a model drafter's cost per token
KS = list(range(17))
BATCHES = [1, 2, 4, 8, 16, 32]
BATCH_KS = [0, 1, 2, 4, 8, 16]
ENGINE_BATCHES = [1, 8, 32]
ACCEPTANCE = {  # method: (CPU record file, its method name there, the drafter's size or None for a free drafter)
    "lookup": ("docs/results/qwen-1.5b-int4.jsonl", "lookup", None),
    "assistant (0.5B)": ("docs/results/qwen-1.5b-int4.jsonl", "assistant@constant:3", "qwen2.5-0.5b"),
    "universal (SmolLM2-135M)": ("docs/results/qwen-1.5b-int4-universal-smollm2.jsonl", "assistant@constant:2",
                                 None),
}
START = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:6.1f}s] {message}", flush=True)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer with one word per id (ids decode to '<i>'): what the model wrapper needs, for random ids."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", pad_token="<0>")


def random_model(size: str, device: str, dtype: torch.dtype) -> Model:
    config = Qwen2Config(**SIZES[size], max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen2ForCausalLM(config).to(dtype).eval()
    hf.generation_config.eos_token_id = None  # random weights: every run goes to its token count
    hf.generation_config.pad_token_id = 0
    return Model(hf, word_tokenizer(config.vocab_size), f"random-{size}")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_time(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn, device) for _ in range(repeats))


def plain_speeds(model: Model, device: str, prompt: int, tokens: int, repeats: int) -> dict:
    ids, _ = random_context(model, prompt, 0, seed=3)
    ours = median_time(lambda: generate(model, ids, max_new_tokens=tokens, eos_token_ids=()), device, repeats)
    theirs = median_time(lambda: hf_generate(model, ids, tokens, min_new_tokens=tokens, untransform=False),
                         device, repeats)
    return {"assistgen_tok_s": tokens / ours, "transformers_tok_s": tokens / theirs, "ratio": theirs / ours}


def cost_curve(model: Model, context: int, repeats: int) -> dict:
    times = step_times(model, max_k=max(KS), context=context, repeats=repeats)
    return {"t1_s": times[0], "v": [t / times[0] for t in times]}


@torch.inference_mode()
def batch_curve(model: Model, device: str, context: int, repeats: int) -> dict:
    """t(B sequences x (k+1) rows) in units of t(B x 1), and t(B x 1) in units of t(1 x 1)."""
    ids, context = random_context(model, context, max(BATCH_KS) + 1, seed=1)
    first = model.new_cache()
    first.feed(ids[:context])
    caches = [first] + [first.fork() for _ in range(max(BATCHES) - 1)]

    def step(batch: int, k: int) -> float:
        feeds = [(c, ids[context:context + k + 1], k + 1) for c in caches[:batch]]
        elapsed = timed(lambda: model.feed_together(feeds), device)
        for c in caches[:batch]:
            c.crop(context)
        return elapsed

    t = {(b, k): statistics.median(step(b, k) for _ in range(repeats + 1)) for b in BATCHES for k in BATCH_KS}
    return {"batches": BATCHES, "ks": BATCH_KS,
            "v_by_batch": {b: [t[b, k] / t[b, 0] for k in BATCH_KS] for b in BATCHES},
            "sequence_cost": {b: t[b, 0] / t[1, 0] for b in BATCHES}}


def engine_speeds(model: Model, prompt: int, tokens: int) -> dict:
    out = {}
    for batch in ENGINE_BATCHES:
        engine = BatchEngine(model, partial(make_drafter, model), Constant(0),
                             EngineSettings(max_batch=batch, max_queue=batch, prefill_budget=batch * prompt)).start()
        prompts = [random_context(model, prompt, 0, seed=10 + i)[0] for i in range(batch)]
        config = GenerationConfig(max_new_tokens=tokens, eos_token_ids=())
        engine.submit(prompts[0], config).done.wait()  # warm-up
        start = time.perf_counter()
        requests = [engine.submit(p, config) for p in prompts]
        made = sum(sum(len(c.tokens) for c in r) for r in requests)
        out[batch] = made / (time.perf_counter() - start)
        engine.shutdown()
    return out


def python_time_per_step(model: Model, device: str, prompt: int, tokens: int) -> dict:
    """Wall seconds per decode step and what of it the device spends in kernels (None on a CPU): runs of 1 and
    tokens+1 new tokens, their difference over `tokens` (so the prompt's pass drops out of both)."""
    ids, _ = random_context(model, prompt, 0, seed=4)
    runs = {n: (lambda n=n: generate(model, ids, max_new_tokens=n, eos_token_ids=())) for n in (1, tokens + 1)}
    runs[1]()  # warm-up
    step = (timed(runs[tokens + 1], device) - timed(runs[1], device)) / tokens
    if not device.startswith("cuda"):
        return {"step_s": step, "device_s": None, "python_s": None}
    device_s = (kernel_seconds(runs[tokens + 1], device) - kernel_seconds(runs[1], device)) / tokens
    return {"step_s": step, "device_s": device_s, "python_s": max(0.0, step - device_s)}


def kernel_seconds(fn, device: str) -> float:
    """The device time of the kernels `fn` launches (torch.profiler's self device times, summed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1e6


def acceptance_rates(root: Path) -> dict[str, float]:
    """Accepted over drafted tokens per method in the CPU runs' records (lines without counts skipped)."""
    rates = {}
    for method, (path, name, _) in ACCEPTANCE.items():
        drafted = accepted = 0
        for line in (root / path).read_text().splitlines():
            record = json.loads(line)
            if record.get("method") == name and "drafted" in record:
                drafted += record["drafted"]
                accepted += record["accepted"]
        if drafted:
            rates[method] = accepted / drafted
    return rates


def projections(results: dict, root: Path) -> dict:
    """Speed-up over plain decoding that this device's curve gives at the CPU runs' acceptance rates."""
    out = {}
    for size, r in results.items():
        if "curve" not in r:
            continue
        for method, rate in acceptance_rates(root).items():
            drafter = ACCEPTANCE[method][2]
            if drafter is not None and (drafter not in results or DRAFTS_FOR.get(size) != drafter):
                continue
            c = results[drafter]["curve"]["t1_s"] / r["curve"]["t1_s"] if drafter else 0.0
            k, gain = best_draft_length([rate], r["curve"]["v"], c, max(KS))
            out.setdefault(size, {})[method] = {"acceptance": rate, "drafter_cost": c, "k": k, "speedup": gain}
    return out


def table(size: str, r: dict) -> str:
    lines = [f"\n## {size} ({r['parameters'] / 1e9:.2f}B parameters, {r['dtype']}, {r['device_name']})"]
    if "plain" in r:
        p = r["plain"]
        lines.append(f"plain: assistgen {p['assistgen_tok_s']:.1f} tok/s, transformers generate() "
                     f"{p['transformers_tok_s']:.1f} tok/s: {p['ratio']:.2f}x")
    if "curve" in r:
        v = r["curve"]["v"]
        lines.append(f"t(1) = {r['curve']['t1_s'] * 1e3:.2f} ms; v(k), k = 0..16: " + " ".join(f"{x:.2f}" for x in v))
    if "batch" in r:
        b = r["batch"]
        lines.append("| B | t(B x 1) / t(1 x 1) | " + " | ".join(f"v(k={k})" for k in b["ks"]) + " |")
        lines.append("|---" * (2 + len(b["ks"])) + "|")
        for n in b["batches"]:
            lines.append(f"| {n} | {b['sequence_cost'][n]:.2f} | " + " | ".join(f"{x:.2f}" for x in b["v_by_batch"][n])
                         + " |")
    if "engine" in r:
        lines.append("engine aggregate tok/s: " + ", ".join(f"{n} seq {s:.1f}" for n, s in r["engine"].items()))
    if "step" in r:
        s = r["step"]
        tail = "" if s["device_s"] is None else (f", device {s['device_s'] * 1e3:.2f} ms, Python and launches "
                                                 f"{s['python_s'] * 1e3:.2f} ms ({s['python_s'] / s['step_s']:.0%})")
        lines.append(f"decode step: {s['step_s'] * 1e3:.2f} ms wall{tail}")
    for method, p in r.get("projected", {}).items():
        lines.append(f"projected {method}: acceptance {p['acceptance']:.2f}, drafter cost {p['drafter_cost']:.2f} "
                     f"-> k = {p['k']}, {p['speedup']:.2f}x plain")
    return "\n".join(lines)


def measure(what: str, model: Model, args: argparse.Namespace):
    if what == "plain":
        return plain_speeds(model, args.device, args.prompt, args.tokens, args.repeats)
    if what == "curve":
        return cost_curve(model, args.prompt, args.repeats)
    if what == "batch":
        return batch_curve(model, args.device, args.prompt, args.repeats)
    if what == "engine":
        return engine_speeds(model, args.prompt, args.tokens)
    return python_time_per_step(model, args.device, args.prompt, min(args.tokens, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["qwen2.5-1.5b", "qwen2.5-0.5b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (random ids)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=["plain", "curve", "batch", "engine", "step"],
                        default=["plain", "curve", "batch", "engine", "step"])
    parser.add_argument("--out", type=Path, default=Path("gpu-results/random.json"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"torch {torch.__version__} sees no CUDA device: run with --device cpu for a smoke run.")
    dtype = getattr(torch, args.dtype)
    root = Path(__file__).resolve().parent.parent
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    say(f"torch {torch.__version__}, {name}, sizes {args.sizes}, {args.dtype}")
    results: dict = defaultdict(dict)
    for size in args.sizes:
        model = random_model(size, args.device, dtype)
        r = results[size]
        r.update(parameters=sum(p.numel() for p in model.hf.parameters()), dtype=args.dtype, device_name=name)
        say(f"{size}: built ({r['parameters'] / 1e9:.2f}B parameters)")
        for what in args.only:
            r[what] = measure(what, model, args)
            say(f"{size}: {what} done")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for size, p in projections(results, root).items():
        results[size]["projected"] = p
    for size, r in results.items():
        print(table(size, r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    say(f"written {args.out}")


if __name__ == "__main__":
    main()
