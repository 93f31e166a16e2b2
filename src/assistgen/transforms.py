"""Transforms applied to a loaded model (not flags inside the loop).

`small_rows_linear(model)`: on these CPUs PyTorch's `F.linear` (x @ W.T) costs almost linearly in
the number of rows for a few rows, so verifying k draft tokens costs close to k single steps and
speculation cannot pay. Two routes stream W once for all rows instead:
  - "mkl": (W @ x.T).T, a single row padded with a zero row (MKL's two-column product streams W
    faster than its matrix-vector path: Gemma-3's 262144x640 head, 16 ms instead of 62 ms);
  - "onednn": oneDNN's linear on a copy of W packed into its blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`), measured here 2-3x faster than MKL for the
    decoder layers' matrices at 1-16 rows, and for the big output heads from 3 rows up.
Which is faster depends on the row count, and only a whole-model timing tells (cache-hot
micro-benchmarks favour oneDNN even at one row, where inside the model MKL wins): `routes` takes a
route per row count, which `costs.tune_routes` measures once per model and machine. The transform
swaps the forward of every `nn.Linear` for one that takes the chosen route when the input has at
most `max_rows` rows, and `F.linear` otherwise (prefill). The packed copies cost extra memory (one
more copy of the weights) and are taken when the transform is applied: apply it after the weights
are final.

Contract: the result is the same product; floating-point summation order may differ in the last
bits between routes and row counts, which can only change an argmax at a near-tie. `mode` "auto"
applies it only if a quick measurement on the model's largest linear layer finds it faster.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

DEFAULT_MAX_ROWS = 32


def _mkl_rows(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(W @ x.T).T for flat [rows, in] -> [rows, out]."""
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, torch.zeros_like(flat)])  # [2, in]
    elif not flat.is_contiguous():
        # e.g. act(gate) * up of two earlier products, laid out as [in, rows]: MKL is ~4x slower on it
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


def _small_rows_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if 0 < rows <= self._assistgen_max_rows and x.dtype == self.weight.dtype:
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        packed = self._assistgen_packed
        onednn = self._assistgen_routes[rows] == "onednn"
        if onednn and packed.tensor is None:
            packed.tensor = pack(self.weight)
        if onednn and packed.tensor is not None:
            out = _onednn_rows(packed.tensor, flat)  # [rows, out]
        else:
            out = _mkl_rows(self.weight, flat)  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


def _linears(model: torch.nn.Module):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def is_applied(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "_assistgen_max_rows") for m in _linears(model))


def small_rows_linear(
    model: torch.nn.Module, mode: str = "auto", max_rows: int = DEFAULT_MAX_ROWS, routes="mkl"
) -> bool:
    """Apply the small-row routes to every nn.Linear in `model`; returns whether it was applied.

    routes: "mkl" or "onednn" for every row count, or a list giving the route for 0..max_rows rows
    (as `costs.tune_routes` measures it on the whole model).
    """
    linears = _linears(model)
    if not linears:
        return False
    if mode == "auto" and not measures_faster(max(linears, key=lambda m: m.weight.numel())):
        return False
    table = [routes] * (max_rows + 1) if isinstance(routes, str) else list(routes)
    if len(table) != max_rows + 1 or any(r not in ("mkl", "onednn") for r in table):
        raise ValueError(f"routes must be 'mkl', 'onednn' or a list of {max_rows + 1} of them")
    for m in linears:
        packed = None
        if "onednn" in table:  # a layer packed by an earlier call keeps its copy (remove_small_rows_linear drops it)
            earlier = getattr(m, "_assistgen_packed", None)
            packed = earlier.tensor if earlier is not None and earlier.tensor is not None else pack(m.weight)
        m._assistgen_max_rows = max_rows
        m._assistgen_routes = table if packed is not None else ["mkl"] * (max_rows + 1)
        m._assistgen_packed = PackedWeight(packed)
        m.forward = types.MethodType(_small_rows_forward, m)
    return True


def remove_small_rows_linear(model: torch.nn.Module) -> None:
    for m in _linears(model):
        if hasattr(m, "_assistgen_max_rows"):
            for attr in ("_assistgen_max_rows", "_assistgen_routes", "_assistgen_packed", "forward"):
                if attr in m.__dict__:
                    delattr(m, attr)


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
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    plain = best(lambda: F.linear(x, layer.weight, layer.bias))
    small = best(lambda: (layer.weight @ x.T).T)
    return small < 0.95 * plain
