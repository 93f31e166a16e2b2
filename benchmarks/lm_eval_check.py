"""lm-evaluation-harness against the real server and against lm_eval's own Hugging Face backend: the same scores,
and per-item log-likelihoods within float tolerance.

Contract: writes two lm_eval tasks over the data in `benchmarks/data/lm_eval/` (`assistgen_facts`: multiple choice,
scored by log-likelihood, acc and acc_norm; `assistgen_answers`: short answers generated greedily until a newline,
exact match) into a temporary folder; starts `assistgen serve` (`--model`, torch backend, prompt lookup: speculation
on) on a free 127.0.0.1 port and runs both tasks through lm_eval's `local-completions` model (loglikelihood through
`echo` + `logprobs`, generation through plain completions, token ids sent as lm_eval tokenizes them); then the same
tasks through lm_eval's `hf` model on the same float32 weights (the model's converted folder) on the CPU. Prints
each task's scores on both, the largest difference of a log-likelihood, the generations that differ, and the draft
tokens the server accepted (from /metrics: speculation happened); `--json FILE` writes them. Exits 1 when a score
differs, a log-likelihood differs by more than `--tolerance`, a generation differs, or nothing was drafted.
`make test-lm-eval` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, start_server  # noqa: E402

from assistgen.backends.machine import cpu_summary  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
TASKS = {
    "assistgen_facts": """task: assistgen_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/facts.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "assistgen_answers": """task: assistgen_answers
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/answers.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: What is the capital of England?\\nA: London\\nQ: {{{{question}}}}\\nA:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


def write_tasks(folder: Path) -> None:
    for name, text in TASKS.items():
        (folder / f"{name}.yaml").write_text(text.format(data=DATA))


def evaluate(model: str, model_args: dict, folder: Path) -> dict:
    """lm_eval's results and logged samples for both tasks, batch size 1 (one request, one forward pass each)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=1,
                           task_manager=TaskManager(include_path=str(folder)), log_samples=True)


def scores(result: dict) -> dict[str, dict[str, float]]:
    return {task: {k.split(",")[0]: v for k, v in values.items() if k.endswith(",none") and "stderr" not in k}
            for task, values in result["results"].items()}


def per_item(result: dict, task: str) -> dict[int, list]:
    """doc id -> what the model answered: (log-likelihood, greedy) per choice, or the generated text."""
    return {s["doc_id"]: s["filtered_resps"] for s in result["samples"][task]}


def accepted_drafts(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r"^assistgen:spec_decode_num_accepted_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="the largest log-likelihood difference allowed")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from assistgen import load_model
    from assistgen.backends.torch.loading import converted_dir

    load_model(args.model, backend="torch")  # (converts the weights to a float32 folder once, for both sides)
    folder = converted_dir(args.model)
    print(f"lm_eval on {args.model} ({folder}); CPU: {cpu_summary()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp)
        write_tasks(tasks)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server([sys.executable, "-m", "assistgen.cli.main", "serve", "--model", args.model,
                               "--backend", "torch", "--lookup", "--port", str(port)], port, timeout=300)
        try:
            start = time.perf_counter()
            served = evaluate("local-completions", {
                "model": args.model, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                "tokenizer": str(folder), "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1},
                tasks)
            served_s = time.perf_counter() - start
            accepted = accepted_drafts(url)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        start = time.perf_counter()
        hf = evaluate("hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, tasks)
        hf_s = time.perf_counter() - start
    return report(args, served, hf, accepted, served_s, hf_s)


def report(args, served: dict, hf: dict, accepted: float, served_s: float, hf_s: float) -> int:
    ok = True
    figures = {"model": args.model, "cpu": cpu_summary(), "server_s": round(served_s, 1), "hf_s": round(hf_s, 1),
               "accepted_draft_tokens": accepted, "tasks": {}}
    a, b = scores(served), scores(hf)
    print("\n| task | metric | server (speculation on) | lm_eval hf | same |\n|---|---|---:|---:|---|")
    for task in TASKS:
        for metric in sorted(a[task]):
            same = a[task][metric] == b[task][metric]
            ok &= same
            print(f"| {task} | {metric} | {a[task][metric]:.4f} | {b[task][metric]:.4f} | {'yes' if same else 'NO'} |")
    worst, greedy_differ, items = 0.0, 0, per_item(served, "assistgen_facts")
    for doc, theirs in per_item(hf, "assistgen_facts").items():
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(items[doc], theirs, strict=True):
            worst = max(worst, abs(float(ll_a) - float(ll_b)))
            greedy_differ += bool(greedy_a) != bool(greedy_b)
    generated, theirs = per_item(served, "assistgen_answers"), per_item(hf, "assistgen_answers")
    differing = [doc for doc in theirs if generated[doc] != theirs[doc]]
    print(f"\nlog-likelihoods: {sum(len(v) for v in items.values())} compared, the largest difference {worst:.2e} "
          f"(tolerance {args.tolerance:g}); is-greedy flags that differ: {greedy_differ}")
    print(f"generations: {len(theirs)} compared, {len(differing)} differ {differing or ''}")
    print(f"draft tokens the server accepted: {accepted:.0f}; time: server {served_s:.1f} s, hf {hf_s:.1f} s")
    ok &= worst <= args.tolerance and not greedy_differ and not differing and accepted > 0
    figures["tasks"] = {"scores_server": a, "scores_hf": b, "largest_loglikelihood_difference": worst,
                        "greedy_flags_differing": greedy_differ,
                        "generations_differing": differing}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print("\nsame scores, log-likelihoods within tolerance, same generations" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
