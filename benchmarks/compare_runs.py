"""Two `assistgen bench --out` result files of the same prompts and methods, side by side: whether each run
gave the same tokens and took the same decisions (verification steps, drafted tokens), the median over prompts of
each run's seconds after / before (robust to a few noisy runs), and each method's tokens per second in both
(overall, and its speed-up over plain decoding within each file).

    python benchmarks/compare_runs.py BEFORE.jsonl AFTER.jsonl

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def read(path: str) -> dict[str, dict]:
    records = {}
    for line in open(path, encoding="utf-8"):
        if line.strip():
            record = json.loads(line)
            records[record["key"]] = record
    return records


def speeds(records: dict[str, dict]) -> dict[str, float]:
    """Tokens per second of each method over all its runs."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for r in records.values():
        tokens[r["method"]] += len(r["tokens"])
        seconds[r["method"]] += r["seconds"]
    return {m: tokens[m] / seconds[m] for m in tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args(argv)
    a, b = read(args.before), read(args.after)
    common = sorted(set(a) & set(b))
    same = defaultdict(lambda: [0, 0])
    decisions, ratios = defaultdict(int), defaultdict(list)
    for key in common:
        method = a[key]["method"]
        same[method][0] += a[key]["tokens"] == b[key]["tokens"]
        same[method][1] += 1
        decisions[method] += all(a[key].get(f) == b[key].get(f) for f in ("steps", "drafted", "accepted"))
        ratios[method].append(b[key]["seconds"] / a[key]["seconds"])
    sa, sb = speeds({k: a[k] for k in common}), speeds({k: b[k] for k in common})
    rows = []
    print(f"{'method':<24}{'identical':>12}{'same steps':>12}{'median s ratio':>16}{'tok/s before':>14}"
          f"{'tok/s after':>13}{'after/before':>14}{'vs plain before':>17}{'vs plain after':>16}")
    for method in sorted(same):
        n_same, n = same[method]
        row = {"method": method, "identical": n_same, "same_decisions": decisions[method], "runs": n,
               "median_seconds_ratio": statistics.median(ratios[method]), "before": sa[method], "after": sb[method],
               "ratio": sb[method] / sa[method], "vs_plain_before": sa[method] / sa.get("plain", sa[method]),
               "vs_plain_after": sb[method] / sb.get("plain", sb[method])}
        rows.append(row)
        print(f"{method:<24}{f'{n_same}/{n}':>12}{f'{decisions[method]}/{n}':>12}"
              f"{row['median_seconds_ratio']:>15.3f}x{row['before']:>14.1f}{row['after']:>13.1f}{row['ratio']:>13.2f}x"
              f"{row['vs_plain_before']:>16.2f}x{row['vs_plain_after']:>15.2f}x")
    print(json.dumps({"benchmark": "compare-runs", "before": args.before, "after": args.after, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
