"""The small-row linear routes: `nn.Linear` layers whose products over a few rows stream the weight once.

Contract: on these CPUs PyTorch's `F.linear` (x @ W.T) costs almost linearly in the number of rows for a few rows,
so verifying k draft tokens costs close to k single steps and speculation cannot pay. `small_rows_linear(model)` swaps
every `nn.Linear` for a `SmallRowsLinear` (same weight and bias tensors, no copy) that streams W once for all rows
instead:
  - "mkl": (W @ x.T).T, a single row padded with a zero row (MKL's two-column product streams W
    faster than its matrix-vector path for large matrices);
  - "onednn": oneDNN's linear on a copy of W packed into its blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`), faster than MKL for many decoder-layer matrices at
    a few rows (docs/benchmarks.md has the measurements).
Which is faster depends on the row count, and only a whole-model timing tells (cache-hot
micro-benchmarks favour oneDNN even at one row, where inside the model MKL wins): `tune_routes`
times the whole model on each route once per model and machine (cached as JSON under
`$ASSISTGEN_CACHE/routes/`) and gives each row count the faster route, or a padded larger row count
where that measures faster still (the cheapest one-token step may be a padded several-row one).
Inputs with more than `max_rows` rows (prefill) take `F.linear`. The packed copies cost extra memory
(one more copy of the weights) and are made when the transform is applied: apply it after the
weights are final; a model whose weights are offloaded (`max_memory`) takes MKL only, so that they stay
file-backed. Quantized models (`quantize.py`) have no `nn.Linear` left and are not touched.
`remove_small_rows_linear` and `restore_small_rows_linear` swap the plain layers in and the very same
transformed ones back.

The result is the same product; floating-point summation order may differ in the last bits between routes and row
counts, which can only change an argmax at a near-tie. `mode` "auto" applies it only if a quick measurement on the
model's largest linear layer finds it faster (`measures_faster`). The routes are CPU kernels: asking for them on
weights elsewhere (`small_rows_linear`, `SmallRowsLinear`, `tune_routes`) raises a `DeviceError` that says so
(`transforms.optimize` leaves them out for a model on a GPU).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from assistgen.backends.measure import is_quiet, step_times, watched
from assistgen.backends.torch.attention import grouped_attention_applied
from assistgen.backends.torch.devices import model_device, require_cpu
from assistgen.backends.torch.swap import replace_module
from assistgen.backends.torch.timing import clock, measurement_key
from assistgen.paths import measurement_file, remembered

DEFAULT_MAX_ROWS = 32
ROUTES = ("mkl", "onednn")
PAD_GAIN = 0.97  # a padded row count is taken only when it measures at least 3% faster
CPU_ONLY = "The small-row linear transform"
ON_GPU = ("on a GPU PyTorch's own linear layers are the fast path, so leave the transform out "
          "(load_model(..., fast_linear=False), or transforms.optimize, which skips it there), or move the model "
          "to the CPU first.")


def _mkl_rows(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(W @ x.T).T for flat [rows, in] -> [rows, out]."""
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, torch.zeros_like(flat)])  # [2, in]
    elif not flat.is_contiguous():
        # e.g. act(gate) * up of two earlier products, laid out as [in, rows]: MKL is much slower on it
        flat = flat.contiguous()
    return (weight @ flat.T).T[:rows]


def _onednn_rows(packed: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")


class PackedWeight:
    """Holds a layer's oneDNN-packed weight; a deep copy of the layer packs its own copy on first use."""

    def __init__(self, tensor: torch.Tensor | None):
        self.tensor = tensor

    def __deepcopy__(self, memo):
        return PackedWeight(None)


class SmallRowsLinear(torch.nn.Module):
    """An `nn.Linear` (its own weight and bias tensors) whose products over up to `max_rows` rows take the
    route the table gives for that row count, padded with zero rows to `padded[rows]` rows."""

    def __init__(self, linear: torch.nn.Linear, routes: list[str], padded: list[int], packed: PackedWeight):
        super().__init__()
        require_cpu(linear.weight.device, CPU_ONLY, ON_GPU)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (a tied head stays tied)
        self.routes, self.padded, self.packed = routes, padded, packed
        self.max_rows = len(routes) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 0 < rows <= self.max_rows or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        if self.padded[rows] > rows:
            flat = torch.cat([flat, flat.new_zeros(self.padded[rows] - rows, flat.shape[1])])
        route = self.routes[self.padded[rows]]
        if route == "onednn" and self.packed.tensor is None:
            self.packed.tensor = pack(self.weight)
        if route == "onednn" and self.packed.tensor is not None:
            out = _onednn_rows(self.packed.tensor, flat)  # [padded rows, out]
        else:
            out = _mkl_rows(self.weight, flat)  # [padded rows, out]
        out = out[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def as_linear(self) -> torch.nn.Linear:
        """The plain `nn.Linear` on the same tensors."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, small-row routes"


def _swapped(model: torch.nn.Module) -> list[tuple[str, SmallRowsLinear]]:
    if isinstance(model, SmallRowsLinear):
        return [("", model)]
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SmallRowsLinear)]


def is_applied(model: torch.nn.Module) -> bool:
    return bool(_swapped(model))


def applied_routes(model: torch.nn.Module) -> list[str] | None:
    """The route table the small-row transform runs with (index = row count), or None when not applied."""
    swapped = _swapped(model)
    return list(swapped[0][1].routes) if swapped else None


def small_rows_linear(
    model: torch.nn.Module, mode: str = "auto", max_rows: int = DEFAULT_MAX_ROWS, routes="mkl",
    padded: list[int] | None = None,
) -> bool:
    """Swap every nn.Linear in `model` for a `SmallRowsLinear` (or give swapped ones a new table); returns
    whether the transform is on. routes: "mkl" or "onednn" for every row count, or a list giving the route
    for 0..max_rows rows; padded: the row count each one runs as (default: itself)."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    swapped = _swapped(model)
    if not linears and not swapped:
        return False
    for _, m in linears:  # refused before anything is swapped
        require_cpu(m.weight.device, CPU_ONLY, ON_GPU)
    if mode == "auto" and not swapped and not measures_faster(max((m for _, m in linears),
                                                                  key=lambda m: m.weight.numel())):
        return False
    table = [routes] * (max_rows + 1) if isinstance(routes, str) else list(routes)
    if len(table) != max_rows + 1 or any(r not in ROUTES for r in table):
        raise ValueError(f"routes must be 'mkl', 'onednn' or a list of {max_rows + 1} of them")
    padded = list(padded) if padded is not None else list(range(max_rows + 1))
    if len(padded) != max_rows + 1 or any(not n <= p <= max_rows for n, p in enumerate(padded)):
        raise ValueError(f"padded must give a row count n..{max_rows} for each n = 0..{max_rows}")
    for _, m in swapped:  # a layer packed by an earlier call keeps its copy
        m.routes, m.padded, m.max_rows = table, padded, max_rows
    for name, m in linears:
        packed = PackedWeight(pack(m.weight) if "onednn" in table else None)
        new = SmallRowsLinear(m, table, padded, packed)
        if not name:
            raise ValueError("small_rows_linear swaps the linears inside a model; wrap a lone layer in a module")
        replace_module(model, name, new)
    return True


def remove_small_rows_linear(model: torch.nn.Module) -> list[tuple[str, SmallRowsLinear]]:
    """Back to `nn.Linear` on the same tensors; returns the swapped-out modules (with their packed weights),
    which `restore_small_rows_linear` puts back."""
    swapped = _swapped(model)
    for name, m in swapped:
        replace_module(model, name, m.as_linear())
    return swapped


def restore_small_rows_linear(model: torch.nn.Module, swapped: list[tuple[str, SmallRowsLinear]]) -> None:
    for name, m in swapped:
        replace_module(model, name, m)


@torch.inference_mode()
def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """W in oneDNN's blocked layout for small batches, or None where this PyTorch build cannot."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)
        probe = torch.ones(2, weight.shape[1])
        if not torch.allclose(_onednn_rows(packed, probe), probe @ weight.detach().T, rtol=1e-3, atol=1e-3):
            return None
        return packed
    except (AttributeError, RuntimeError):
        return None


@torch.inference_mode()
def measures_faster(layer: torch.nn.Linear, rows: int = 4, repeats: int = 5) -> bool:
    """Time both routes on `rows` rows of the given layer; True if the small-row route wins by 5%."""
    x = torch.randn(rows, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = clock(x.device)
            fn()
            times.append(clock(x.device) - t)
        return min(times)

    plain = best(lambda: F.linear(x, layer.weight, layer.bias))
    small = best(lambda: (layer.weight @ x.T).T)
    return small < 0.95 * plain


# ---------------------------------------------------------------------------------------------------------------
# route tuning: measured once per model and machine, cached


def routes_path(model):
    """Where the route table of this model on this machine is cached (None for a model without a `cache_key`)."""
    if not model.cache_key:
        return None
    key = measurement_key(model, f"attention={grouped_attention_applied(model.hf)}", "routes=v3",
                          *(["file-backed"] if getattr(model, "max_memory", None) else []))
    return measurement_file("routes", model.cache_key, key)


def tune_routes(model, refresh: bool = False, timed=None, context: int = 128) -> dict | None:
    """Give the transformed model's linears the fastest route (and padding) per row count: from the model's
    `routes` field, from disk, or measured now by timing the whole model on each route (and saved). Returns the
    record, which `model.routes` keeps. `timed`: the `LanguageModel` whose passes are timed (a callable making it,
    called only when measuring; default the model itself), after `context` tokens. CPU only: a model on another
    device raises `DeviceError`."""
    require_cpu(model_device(model.hf), CPU_ONLY, ON_GPU)
    if not is_applied(model.hf):
        return None

    def measure() -> dict:
        by_route = {}
        subject = model if timed is None else timed()
        for route in routes_allowed(model):
            small_rows_linear(model.hf, mode="on", routes=route)
            by_route[route] = step_times(subject, context=context, repeats=2)
        routes, padded = route_table(by_route)
        return {"model": model.name, "measured": time.strftime("%Y-%m-%d %H:%M"), "routes": routes,
                "padded": padded, "step_seconds": {r: [round(t, 5) for t in ts] for r, ts in by_route.items()}}

    record = model.routes if model.routes is not None and not refresh else None
    if record is None:
        record = remembered(routes_path(model), lambda: watched(measure), ("routes", "padded", "others_share"), refresh,
                            keep=is_quiet)
    small_rows_linear(model.hf, mode="on", routes=record["routes"], padded=record["padded"])
    model.routes = record
    return record


def routes_allowed(model) -> tuple[str, ...]:
    """The routes a model may take: all, except for offloaded weights (`max_memory`), which must stay file-backed:
    oneDNN's packed copies would be anonymous memory the size of the weights."""
    return ("mkl",) if getattr(model, "max_memory", None) else ROUTES


def route_table(by_route: dict[str, list[float]], max_rows: int = DEFAULT_MAX_ROWS) -> tuple[list[str], list[int]]:
    """(route per row count, row count each runs as), index = rows 0..max_rows, from whole-model step times
    by_route[route][n] for n+1 rows. A row count runs padded to a larger measured one where that is at least
    3% faster; ties go to MKL; rows beyond the measured ones keep the last route, unpadded."""
    measured = len(next(iter(by_route.values())))
    best = [min(by_route, key=lambda r: by_route[r][n - 1]) for n in range(1, measured + 1)]  # best[n-1]: n rows
    cost = [by_route[best[n - 1]][n - 1] for n in range(1, measured + 1)]
    routes, padded = ["mkl"] + best + [best[-1]] * (max_rows - measured), list(range(max_rows + 1))
    for n in range(1, measured + 1):
        m = min(range(n, measured + 1), key=lambda m: cost[m - 1])
        if cost[m - 1] < PAD_GAIN * cost[n - 1]:
            padded[n] = m
    return routes, padded
