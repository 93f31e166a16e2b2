"""The target's forward-pass time per number of new tokens, on each linear route, and the cost curve.

For each model: one forward over n = 1..17 new tokens after a context (128 tokens by default),
with every linear on PyTorch's own `F.linear`, on the small-row MKL route and on the oneDNN
packed route; then the route per row count that `costs.tune_routes` picks and the resulting
verification-cost curve v(k) = t(k+1)/t(1) that the adaptive policy uses. Prints a table and one
JSON line.

    python benchmarks/costs.py [--models smollm2-135m,gemma3-270m] [--context 128]
"""

from __future__ import annotations

import argparse
import json

from assistgen import load_model
from assistgen.costs import measure_step_times
from assistgen.transforms import remove_small_rows_linear, small_rows_linear

ROUTES = ("F.linear", "mkl", "onednn")


def times_by_route(name: str, context: int) -> dict[str, list[float]]:
    model = load_model(name, fast_linear=False)
    out = {}
    for route in ROUTES:
        remove_small_rows_linear(model.hf)
        if route != "F.linear":
            small_rows_linear(model.hf, mode="on", routes=route)
        out[route] = measure_step_times(model, context=context, repeats=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        times = times_by_route(name, args.context)
        best = [min(times["mkl"][i], times["onednn"][i]) for i in range(len(times["mkl"]))]
        results[name] = {route: [round(t * 1e3, 1) for t in ts] for route, ts in times.items()}
        results[name]["tuned_v"] = [round(t / best[0], 2) for t in best]
        print(f"\n{name}: ms per forward over n new tokens after {args.context} tokens of context")
        print(f"{'n':>3} " + " ".join(f"{r:>9}" for r in ROUTES) + f"{'tuned':>9}{'v(n-1)':>8}")
        for i in range(len(best)):
            row = " ".join(f"{times[r][i] * 1e3:9.1f}" for r in ROUTES)
            print(f"{i + 1:>3} {row}{best[i] * 1e3:9.1f}{best[i] / best[0]:8.2f}")
    print(json.dumps({"benchmark": "costs", "context": args.context, "models": results}))


if __name__ == "__main__":
    main()
