"""The target's forward-pass time per number of new tokens, on each linear route, and the cost curve.

For each model: one forward over n = 1..MAX_K+1 (17) new tokens after a context (128 tokens by default),
with every linear on PyTorch's own `F.linear`, on the small-row MKL route and on the oneDNN
packed route (all with transformers' SDPA attention); then the faster route per row count (as
`small_rows.tune_routes` picks it) with transformers' attention ("tuned") and with the grouped-query
attention (`attention.grouped_query_attention`, "tuned+gqa"), and the verification-cost curve
v(k) = t(k+1)/t(1) of the latter, which is what `load_model` gives. Prints a table and one JSON line.

    python benchmarks/costs.py [--models smollm2-135m,gemma3-270m] [--context 128]
"""

from __future__ import annotations

import argparse
import json

from assistgen import load_model
from assistgen.backends.measure import step_times as measure_step_times
from assistgen.backends.torch.attention import grouped_query_attention, remove_grouped_query_attention
from assistgen.backends.torch.small_rows import remove_small_rows_linear, route_table, small_rows_linear

ROUTES = ("F.linear", "mkl", "onednn")
COLUMNS = (*ROUTES, "tuned", "tuned+gqa")


def times_by_route(name: str, context: int) -> dict[str, list[float]]:
    model = load_model(name, fast_linear=False)
    out = {}
    for route in ROUTES:
        remove_small_rows_linear(model.hf)
        if route != "F.linear":
            small_rows_linear(model.hf, mode="on", routes=route)
        out[route] = measure_step_times(model, context=context, repeats=3)
    remove_small_rows_linear(model.hf)
    routes, padded = route_table(out)
    small_rows_linear(model.hf, mode="on", routes=routes, padded=padded)
    for column in ("tuned", "tuned+gqa"):
        (grouped_query_attention if column == "tuned+gqa" else remove_grouped_query_attention)(model.hf)
        out[column] = measure_step_times(model, context=context, repeats=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        times = times_by_route(name, args.context)
        best = times["tuned+gqa"]
        results[name] = {route: [round(t * 1e3, 1) for t in ts] for route, ts in times.items()}
        results[name]["tuned_v"] = [round(t / best[0], 2) for t in best]
        print(f"\n{name}: ms per forward over n new tokens after {args.context} tokens of context")
        print(f"{'n':>3} " + " ".join(f"{r:>10}" for r in COLUMNS) + f"{'v(n-1)':>8}")
        for i in range(len(best)):
            row = " ".join(f"{times[r][i] * 1e3:10.1f}" for r in COLUMNS)
            print(f"{i + 1:>3} {row}{best[i] / best[0]:8.2f}")
    print(json.dumps({"benchmark": "costs", "context": args.context, "models": results}))


if __name__ == "__main__":
    main()
