"""`assistgen bench`: prompt reader, figures, resume, and a tiny end-to-end run (table, JSON, PNG)."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_llama

from assistgen.bench.dataset import DatasetError, Prompt, read_prompts, select
from assistgen.bench.report import aggregate, ceilings, oracle_bound, theoretical_speedup
from assistgen.bench.runner import Runner, run_bench
from assistgen.cli.bench import parse_method
from assistgen.cli.main import main
from assistgen.policy.rules import Constant


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


TINY_SET = [
    {"question_id": "s1", "category": "summarization", "turns": ["the cat sat on the mat. the cat sat on the mat."]},
    {"question_id": "c1", "category": "copy", "turns": ["abc abc abc abc abc abc"], "reference": ["abc"]},
    {"question_id": "m1", "category": "multi_turn", "turns": ["hello there", "and again"]},
]


def test_reader_accepts_the_format(tmp_path):
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", TINY_SET))
    assert [p.question_id for p in prompts] == ["s1", "c1", "m1"]
    assert prompts[2].turns == ("hello there", "and again") and prompts[1].reference == ("abc",)


@pytest.mark.parametrize("bad, message", [
    ('{"question_id": "x", "category": "a", "turns": ["ok"]', r"p.jsonl line 2: not valid JSON"),
    ('{"question_id": "x", "category": "a"}', r"line 2: missing turns"),
    ('{"question_id": "x", "category": "a", "turns": []}', r"line 2: 'turns' must be a non-empty list"),
    ('{"question_id": "s1", "category": "a", "turns": ["x"]}', r"line 2: duplicate question_id 's1'"),
    ('[1, 2]', r"line 2: expected a JSON object"),
])
def test_reader_names_the_bad_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [TINY_SET[0], bad])
    with pytest.raises(DatasetError, match=message):
        read_prompts(path)


def test_select_filters_and_draws_a_reproducible_subset():
    prompts = [Prompt(f"q{i}", "a" if i % 2 else "b", ("t",)) for i in range(20)]
    assert {p.category for p in select(prompts, ["a"])} == {"a"}
    first, again = select(prompts, n=5, seed=3), select(prompts, n=5, seed=3)
    assert first == again and len(first) == 5 and first != select(prompts, n=5, seed=4)
    with pytest.raises(DatasetError, match="Unknown categories"):
        select(prompts, ["zzz"])


def test_the_shipped_suite_reads_and_has_every_category():
    from assistgen.bench.dataset import default_suite

    prompts = read_prompts(default_suite())
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    for category in ("summarization", "retrieval_qa", "translation", "code", "writing", "math", "multi_turn", "copy"):
        assert counts.get(category, 0) >= 8, category


def test_theoretical_speedup_formula():
    # no acceptance: only the cost of drafting remains
    assert theoretical_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)
    # geometric series: expected tokens per step 1 + a + ... + a^k
    a, k, c = 0.7, 5, 0.1
    assert theoretical_speedup(a, k, c) == pytest.approx(sum(a**i for i in range(k + 1)) / (k * c + 1))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0
    assert theoretical_speedup(0.5, 0, 0.3) == 1.0
    assert oracle_bound(3, [1.0, 1.1, 1.2, 1.6]) == pytest.approx(4 / 1.6)


def test_theoretical_speedup_uses_the_measured_cost_curve():
    curve = [1.0, 1.2, 1.5, 2.0]
    a, c = 0.6, 0.1
    assert theoretical_speedup(a, 2, c, curve) == pytest.approx((1 + a + a * a) / (2 * c + 1.5))
    # a mean lookahead between two integers: the mix of the two with that mean
    mixed = (0.5 * (1 + a) + 0.5 * (1 + a + a * a)) / (1.5 * c + 0.5 * (1.2 + 1.5))
    assert theoretical_speedup(a, 1.5, c, curve) == pytest.approx(mixed)
    assert theoretical_speedup(a, 3.5, c, curve) is None  # beyond the measured curve: unknown
    record = {"question_id": "q", "category": "copy", "method": "lookup", "temperature": 0.0, "tokens": [1] * 30,
              "new_tokens": 30, "seconds": 1.0, "prefill_s": 0.1, "target_forward_passes": 11, "steps": 10,
              "drafted": 20, "accepted": 12, "draft_s": 0.02, "verify_s": 0.5}
    row = next(r for r in aggregate([record], curve) if r["category"] == "copy")
    plain_step = 0.05 / 1.5  # a mean verification step (k = 2) costs v[2] = 1.5 plain steps
    assert row["draft_cost"] == pytest.approx(0.02 / 20 / plain_step)
    assert row["theoretical_speedup"] == pytest.approx(theoretical_speedup(0.6, 2, row["draft_cost"], curve))
    free = next(r for r in aggregate([record]) if r["category"] == "copy")  # no curve: verification free
    assert free["theoretical_speedup"] == pytest.approx(theoretical_speedup(0.6, 2, 0.02 / 20 / 0.05))


def test_ceilings_take_the_best_lookahead_on_the_curve():
    curve = [1.0, 1.3, 1.6, 1.8, 3.1]  # the int4 1.5B's shape: a 5-row step costs much more
    a = 0.77
    by_k = [(sum(a**i for i in range(k + 1)), curve[k]) for k in range(5)]
    best_free = max(e / v for e, v in by_k)  # k = 3 here: 2.82 / 1.8
    assert best_free == pytest.approx(by_k[3][0] / 1.8)
    best_paid = max(e / (k * 0.39 + v) for k, (e, v) in enumerate(by_k))
    assert ceilings(a, 0.39, curve) == pytest.approx((best_paid, best_free))
    assert ceilings(a, 0.05, curve)[0] == pytest.approx(by_k[3][0] / (3 * 0.05 + 1.8))  # cheap drafts: k = 3 again
    assert ceilings(0.05, 0.3, curve) == (1.0, 1.0)  # nothing pays: plain decoding, k = 0
    assert ceilings(1.0, 0.0, curve)[1] == pytest.approx(4 / 1.8)  # perfect free drafts: the oracle bound
    record = {"question_id": "q", "category": "code", "method": "assistant", "temperature": 0.0, "tokens": [1] * 30,
              "new_tokens": 30, "seconds": 1.0, "prefill_s": 0.1, "target_forward_passes": 11, "steps": 10,
              "drafted": 20, "accepted": 12, "draft_s": 0.02, "verify_s": 0.5}
    row = next(r for r in aggregate([record], curve) if r["category"] == "code")
    assert (row["ceiling"], row["free_ceiling"]) == pytest.approx(ceilings(0.6, row["draft_cost"], curve))
    assert "ceiling" not in next(r for r in aggregate([record]) if r["category"] == "code")  # no curve, no ceiling


def test_method_parsing():
    assert parse_method("lookup@constant:4").schedule == Constant(k=4)
    assert parse_method("hf-assistant").engine == "hf"
    assert parse_method("lookup+ngram+assistant@adaptive").sources == ["lookup", "ngram", "assistant"]
    assert parse_method("early-exit").sources == ["early-exit"] and parse_method("plain").sources == []
    for bad in ("nope", "hf-lookup@constant:3", "plain@heuristic", "lookup@weird", "lookup+lookup",
                "assistant+early-exit", "hf-lookup+assistant", "plain+lookup"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_ngram_method_learns_from_earlier_prompts_only(tmp_path):
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", TINY_SET))
    runner = Runner(tiny_llama(), max_new_tokens=6)
    seen = []
    runner.learn = lambda ids, tokens: seen.append(ids + tokens)
    run_bench(runner, prompts, [parse_method(m) for m in ("plain", "ngram")])
    taught = [runner.prompt_ids(p) for p in prompts[:-1]]  # the last prompt is never taught before it runs
    assert [s[: len(t)] for s, t in zip(seen, taught, strict=True)] == taught


def test_resume_skips_what_is_done(tmp_path):
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", TINY_SET))
    runner = Runner(tiny_llama(), max_new_tokens=6)
    methods = [parse_method(m) for m in ("plain", "lookup", "hf-plain")]
    out = tmp_path / "results.jsonl"
    records, ran = run_bench(runner, prompts, methods, out=out)
    assert ran == 9 and len(records) == 9 and len(out.read_text().splitlines()) == 9
    records, ran = run_bench(runner, prompts, methods, out=out)
    assert ran == 0 and len(records) == 9
    # an interrupted run: the last record is missing and the one before is cut short
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:7] + [lines[7][:20]]) + "\n")
    records, ran = run_bench(runner, prompts, methods, out=out)
    assert ran == 2 and len(records) == 9
    # greedy exactness is measured against plain decoding
    rows = aggregate(records)
    overall = {r["method"]: r for r in rows if r["category"] == "overall"}
    assert overall["lookup"]["identical_share"] == 1.0 and overall["hf-plain"]["identical_share"] == 1.0
    assert overall["plain"]["speedup_vs_plain"] == 1.0 and "speedup_vs_hf" in overall["plain"]
    assert "speedup_vs_hf" not in overall["lookup"]  # hf-lookup did not run


def test_tiny_end_to_end_cli_writes_table_json_and_png(tmp_path, capsys):
    model = tiny_llama()
    model.hf.save_pretrained(tmp_path / "tiny")
    model.tokenizer.save_pretrained(tmp_path / "tiny")
    data = write_jsonl(tmp_path / "p.jsonl", TINY_SET)
    png = tmp_path / "speedups.png"
    argv = ["bench", "--model", str(tmp_path / "tiny"), "--dataset", str(data), "--max-new-tokens", "16",
            "--temperatures", "0,1.0", "--out", str(tmp_path / "r.jsonl"), "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "vs plain" in out[0] and any("copy" in line and "lookup" in line for line in out)
    assert any(line.startswith("copy (oracle) lookup: bound") for line in out)
    summary = json.loads(out[-1])
    assert summary["benchmark"] == "assistgen-bench" and len(summary["cost_curve"]) == 17
    assert {r["method"] for r in summary["rows"]} == {"plain", "lookup", "hf-plain", "hf-lookup"}
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert main(argv[:-2] + ["--categories", "nope"]) == 2
    assert "Unknown categories" in capsys.readouterr().err


def test_decode_phase_speedup_leaves_out_the_prefill():
    def record(method, seconds, prefill_s, steps, drafted, accepted):
        return {"question_id": "c1", "category": "copy", "method": method, "temperature": 0.0, "tokens": [1] * 60,
                "new_tokens": 60, "seconds": seconds, "prefill_s": prefill_s, "target_forward_passes": steps + 1,
                "steps": steps, "drafted": drafted, "accepted": accepted, "draft_s": 0.0, "verify_s": seconds}

    curve = [1.0] + [1.5] * 16
    rows = aggregate([record("plain", 6.5, 0.5, 60, 0, 0), record("lookup", 2.5, 0.5, 6, 54, 54)], curve)
    lookup = next(r for r in rows if r["category"] == "copy" and r["method"] == "lookup")
    assert lookup["speedup_vs_plain"] == pytest.approx(6.5 / 2.5)
    assert lookup["decode_speedup_vs_plain"] == pytest.approx(6.0 / 2.0)
    assert lookup["oracle_bound"] == pytest.approx(10 / 1.5)  # k = 54 / 6 = 9
    assert lookup["decode_share_of_oracle_bound"] == pytest.approx(3.0 / (10 / 1.5))
    hf_record = record("hf-plain", 6.0, 0, 60, 0, 0)
    del hf_record["prefill_s"]  # transformers' generate() reports no prefill time
    hf = aggregate([record("plain", 6.5, 0.5, 60, 0, 0), hf_record])
    assert all("decode_speedup_vs_plain" not in r for r in hf if r["method"] == "hf-plain")


def test_the_gpu_checks_timing_script_runs_on_a_tiny_model(tmp_path):
    """benchmarks/gpu_random.py (what the offline GPU check times) end to end on the CPU: every figure is written,
    the curve starts at 1, and the projections use the recorded acceptance rates."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_random.py"
    out = tmp_path / "random.json"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--dtype", "float32", "--sizes", "tiny",
                          "--tokens", "4", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    tiny = json.loads(out.read_text())["tiny"]
    assert {"plain", "curve", "batch", "engine", "step", "projected"} <= set(tiny)
    assert tiny["curve"]["v"][0] == 1.0 and len(tiny["curve"]["v"]) == 17
    assert sorted(int(b) for b in tiny["engine"]) == [1, 8, 32] and all(v > 0 for v in tiny["engine"].values())
    assert 0 < tiny["projected"]["lookup"]["acceptance"] < 1 and tiny["projected"]["lookup"]["speedup"] >= 1
    assert "v(k), k = 0..16" in run.stdout
