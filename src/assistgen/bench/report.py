"""Figures from benchmark records: per-category tables, one JSON line, plots.

Contract: pure functions of the records `runner.run_bench` produces (and of the target's cost
curve, when given). Speed-ups are ratios of tokens per second measured in the same run: vs
assistgen's plain decoding, and vs transformers' equivalent method. The theoretical speed-up is
the expected gain of `gain.py`, E(k) / (k*c + v[k]), for the measured acceptance rate a (the same at
every position), the mean lookahead k and the draft cost c per drafted token in plain steps, with
v the measured cost curve passed to `aggregate`; without one, verification is taken as free,
v[k] = 1 (Leviathan et al. 2023's (1 - a^(k+1)) / ((1 - a)(k*c + 1)), an upper bound on a CPU).
Efficiency = measured / theoretical. Given the curve, two ceilings per drafting method: the best
speed-up any lookahead k could reach at its measured acceptance and draft cost, max_k E(k) / (k*c +
v[k]) (`ceiling`), and the same with drafts for free, c = 0 (`free_ceiling`): what no policy, and no
cheaper drafter of the same acceptance, can pass on this target. The decode-phase speed-up leaves
out the prefill (the same forward pass over the prompt for every assistgen method), which
neither the theory nor the oracle bound (k+1)t(1)/t(k+1) models; the copy category's share of
the bound is given both ways.
"""

from __future__ import annotations

import re
from collections import defaultdict

from assistgen.policy.gain import MAX_K, best_lookahead, expected_tokens, step_cost

OVERALL = "overall"


def theoretical_speedup(alpha: float, k: float, c: float, cost_curve: list[float] | None = None) -> float | None:
    """Expected tokens per unit time of speculation relative to plain decoding, at acceptance rate alpha,
    mean lookahead k and draft cost c; cost_curve: v[k] (None: verification costs one plain step, v = 1).
    None when k is beyond the curve."""
    if cost_curve and k > len(cost_curve) - 1:
        return None
    return expected_tokens([alpha], k) / (k * c + unit_cost(cost_curve, k))


def unit_cost(cost_curve: list[float] | None, k: float) -> float:
    """v[k] of a step verifying k draft tokens on average, in plain steps (1 without a curve, or beyond it)."""
    if not cost_curve or k > len(cost_curve) - 1:
        return 1.0
    return step_cost(cost_curve, k)


def oracle_bound(k: int, cost_curve: list[float]) -> float:
    """Best speed-up when every draft is right: (k+1) t(1) / t(k+1); cost_curve[i] = t(i+1)/t(1)."""
    k = max(1, min(k, len(cost_curve) - 1))
    return (k + 1) / cost_curve[k]


def ceilings(alpha: float, c: float, cost_curve: list[float]) -> tuple[float, float]:
    """(best speed-up over every lookahead k at acceptance alpha and draft cost c, the same with c = 0), both
    at least 1 (k = 0 is plain decoding); cost_curve[k] = v[k]."""
    return (best_lookahead([alpha], cost_curve, c, MAX_K)[1], best_lookahead([alpha], cost_curve, 0.0, MAX_K)[1])


def aggregate(records: list[dict], cost_curve: list[float] | None = None) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        for category in (r["category"], OVERALL):
            groups[(r["temperature"], category, r["method"])].append(r)
    plain_tokens = {(r["temperature"], r["question_id"]): r["tokens"] for r in records if r["method"] == "plain"}
    rows = []
    for (temperature, category, method), rs in groups.items():
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        row = {"temperature": temperature, "category": category, "method": method, "prompts": len(rs),
               "tokens": tokens, "tok_s": tokens / seconds if seconds else 0.0,
               "target_fwd_per_token": sum(r["target_forward_passes"] for r in rs) / max(tokens, 1)}
        if all("prefill_s" in r for r in rs):  # assistgen's records: the tokens and time after the prefill (whose
            # pass gives the first token)
            decode_s = sum(r["seconds"] - r["prefill_s"] for r in rs)
            decoded = sum(max(0, r["new_tokens"] - 1) for r in rs)
            row["decode_tok_s"] = decoded / decode_s if decode_s > 0 else 0.0
        drafted = sum(r.get("drafted", 0) for r in rs)
        if "steps" in rs[0]:
            steps = sum(r["steps"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            row["acceptance_rate"] = accepted / drafted if drafted else 0.0
            row["mean_accepted_length"] = 1 + accepted / steps if steps else 0.0
            row["lookahead"] = drafted / steps if steps else 0.0
            # A mean verification step costs v[k] plain steps: the plain step's time follows from it.
            verify_step = sum(r["verify_s"] for r in rs) / max(steps, 1)
            plain_step = verify_step / unit_cost(cost_curve, row["lookahead"])
            row["draft_cost"] = (sum(r["draft_s"] for r in rs) / drafted) / plain_step if drafted else 0.0
            theory = theoretical_speedup(row["acceptance_rate"], row["lookahead"], row["draft_cost"], cost_curve)
            if theory is not None:
                row["theoretical_speedup"] = theory
            if cost_curve and drafted:
                row["ceiling"], row["free_ceiling"] = ceilings(row["acceptance_rate"], row["draft_cost"], cost_curve)
        if temperature == 0.0:
            compared = [(r["tokens"], plain_tokens.get((0.0, r["question_id"]))) for r in rs]
            compared = [(t, p) for t, p in compared if p is not None]
            if compared:
                row["identical_share"] = sum(t == p for t, p in compared) / len(compared)
                row["first_differences"] = [next((i for i, (x, y) in enumerate(zip(t, p, strict=False)) if x != y),
                                                 min(len(t), len(p))) for t, p in compared if t != p]
        rows.append(row)
    by = {(r["temperature"], r["category"], r["method"]): r for r in rows}
    for row in rows:
        plain = by.get((row["temperature"], row["category"], "plain"))
        if plain and plain["tok_s"]:
            row["speedup_vs_plain"] = row["tok_s"] / plain["tok_s"]
            if row.get("decode_tok_s") and plain.get("decode_tok_s"):
                row["decode_speedup_vs_plain"] = row["decode_tok_s"] / plain["decode_tok_s"]
            if "theoretical_speedup" in row and row["theoretical_speedup"] > 0:
                row["efficiency"] = row["speedup_vs_plain"] / row["theoretical_speedup"]
        base = row["method"].partition("@")[0]
        if not base.startswith("hf-"):
            hf = by.get((row["temperature"], row["category"], f"hf-{base}"))
            if hf and hf["tok_s"]:
                row["speedup_vs_hf"] = row["tok_s"] / hf["tok_s"]
        if cost_curve and row["category"] == "copy" and row.get("lookahead"):
            row["oracle_bound"] = oracle_bound(round(row["lookahead"]), cost_curve)
            if "speedup_vs_plain" in row:
                row["share_of_oracle_bound"] = row["speedup_vs_plain"] / row["oracle_bound"]
            if "decode_speedup_vs_plain" in row:
                row["decode_share_of_oracle_bound"] = row["decode_speedup_vs_plain"] / row["oracle_bound"]
    rows.sort(key=lambda r: (r["temperature"], r["category"] == OVERALL, r["category"], r["method"]))
    return rows


def _fmt(value, pattern: str) -> str:
    return pattern.format(value) if value is not None else "-"


def columns_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width table: one line a row, each column `(header, key, format)` with the format's width
    (`"<16"`, `">8.1f"`), the header aligned as its values are."""
    def width(spec: str) -> str:
        return re.match(r"[<>^]?\d*", spec).group(0)

    lines = ["".join(f"{header:{width(spec)}}" for header, _, spec in columns)]
    for r in rows:
        lines.append("".join(f"{r[key]:{spec}}" for _, key, spec in columns))
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = (f"{'temp':>5} {'category':<14}{'method':<22}{'tok/s':>7}{'vs plain':>9}{'decode':>7}{'vs hf':>7}"
            f"{'accept':>8}"
            f"{'mean len':>9}{'fwd/tok':>8}{'exact':>7}{'theory':>8}{'eff':>6}{'ceil':>7}{'free':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['temperature']:>5.1f} {r['category']:<14}{r['method']:<22}{r['tok_s']:>7.1f}"
            f"{_fmt(r.get('speedup_vs_plain'), '{:.2f}x'):>9}{_fmt(r.get('decode_speedup_vs_plain'), '{:.2f}x'):>7}"
            f"{_fmt(r.get('speedup_vs_hf'), '{:.2f}x'):>7}"
            f"{_fmt(r.get('acceptance_rate'), '{:.0%}'):>8}{_fmt(r.get('mean_accepted_length'), '{:.2f}'):>9}"
            f"{r['target_fwd_per_token']:>8.2f}{_fmt(r.get('identical_share'), '{:.0%}'):>7}"
            f"{_fmt(r.get('theoretical_speedup'), '{:.2f}x'):>8}{_fmt(r.get('efficiency'), '{:.0%}'):>6}"
            f"{_fmt(r.get('ceiling'), '{:.2f}x'):>7}{_fmt(r.get('free_ceiling'), '{:.2f}x'):>7}"
        )
    bounds = [r for r in rows if "oracle_bound" in r]
    for r in bounds:
        lines.append(f"copy (oracle) {r['method']}: bound (k+1)t(1)/t(k+1) = {r['oracle_bound']:.2f}x at "
                     f"k={round(r['lookahead'])}; measured {_fmt(r.get('speedup_vs_plain'), '{:.2f}x')} = "
                     f"{_fmt(r.get('share_of_oracle_bound'), '{:.0%}')} of the bound; after the prefill "
                     f"{_fmt(r.get('decode_speedup_vs_plain'), '{:.2f}x')} = "
                     f"{_fmt(r.get('decode_share_of_oracle_bound'), '{:.0%}')}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, cost_curve: list[float] | None = None) -> None:
    """Speed-up vs plain per category per method; and speed-up vs temperature (or lookahead, or t(k)/t(1))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    first = [r for r in rows if r["temperature"] == temperatures[0] and "speedup_vs_plain" in r]
    categories = sorted({r["category"] for r in first if r["category"] != OVERALL}) + [OVERALL]
    methods = sorted({r["method"] for r in first if r["method"] != "plain"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(len(methods), 1)
    by = {(r["category"], r["method"]): r["speedup_vs_plain"] for r in first}
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(categories))]
        ax1.bar(xs, [by.get((c, m), 0.0) for c in categories], width, label=m)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))])
    ax1.set_xticklabels(categories, rotation=30, ha="right")
    ax1.set_ylabel("speed-up vs assistgen plain")
    ax1.set_title(f"speed-up per category (temperature {temperatures[0]})")
    ax1.legend(fontsize=8)
    overall = [r for r in rows if r["category"] == OVERALL and "speedup_vs_plain" in r and r["method"] != "plain"]
    lookaheads = [(int(m.group(1)), r) for r in overall if (m := re.search(r"@constant:(\d+)$", r["method"]))]
    if len(temperatures) > 1:
        series = {m: sorted((r["temperature"], r["speedup_vs_plain"]) for r in overall if r["method"] == m)
                  for m in methods}
        _lines(ax2, series, "temperature", "speed-up vs temperature")
    elif lookaheads:
        bases = sorted({r["method"].partition("@")[0] for _, r in lookaheads})
        series = {b: sorted((k, r["speedup_vs_plain"]) for k, r in lookaheads if r["method"].startswith(b + "@"))
                  for b in bases}
        _lines(ax2, series, "lookahead k", "speed-up vs lookahead")
    elif cost_curve:
        ax2.plot(range(1, len(cost_curve) + 1), cost_curve, marker="o")
        ax2.set_xlabel("new tokens k in one target forward pass")
        ax2.set_ylabel("t(k) / t(1)")
        ax2.set_title("verification cost")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lines(ax, series: dict[str, list[tuple[float, float]]], xlabel: str, title: str) -> None:
    for label, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up vs plain (overall)")
    ax.set_title(title)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend(fontsize=8)
