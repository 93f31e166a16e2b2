"""Transforms applied to a loaded model (not flags inside the loop).

`small_rows_linear(model)`: on these CPUs PyTorch's `F.linear` (x @ W.T) costs almost linearly in
the number of rows for a few rows, so verifying k draft tokens costs close to k single steps and
speculation cannot pay. Computing the same product as (W @ x.T).T lets BLAS stream W once for all
rows. A single row is padded with a zero row: MKL's two-column product streams W faster than its
matrix-vector path (Gemma-3's 262144x640 head: 21 ms instead of 62 ms). The transform swaps the
forward of every `nn.Linear` for one that takes that route when the input has at most `max_rows`
rows, and the usual route otherwise (prefill).

Contract: the result is the same product; floating-point summation order may differ in the last
bits between a one-row and a multi-row call, which can only change an argmax at a near-tie. `mode`
"auto" applies it only if a quick measurement on the model's largest linear layer finds it faster.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

DEFAULT_MAX_ROWS = 32


def _small_rows_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if 0 < rows <= self._assistgen_max_rows and x.dtype == self.weight.dtype:
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        if rows == 1:
            flat = torch.cat([flat, torch.zeros_like(flat)])  # [2, in]
        out = (self.weight @ flat.T).T[:rows]  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


def _linears(model: torch.nn.Module):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def is_applied(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "_assistgen_max_rows") for m in _linears(model))


def small_rows_linear(model: torch.nn.Module, mode: str = "auto", max_rows: int = DEFAULT_MAX_ROWS) -> bool:
    """Apply the small-row linear route to every nn.Linear in `model`; returns whether it was applied."""
    linears = _linears(model)
    if not linears:
        return False
    if mode == "auto" and not measures_faster(max(linears, key=lambda m: m.weight.numel())):
        return False
    for m in linears:
        m._assistgen_max_rows = max_rows
        m.forward = types.MethodType(_small_rows_forward, m)
    return True


def remove_small_rows_linear(model: torch.nn.Module) -> None:
    for m in _linears(model):
        if hasattr(m, "_assistgen_max_rows"):
            del m._assistgen_max_rows
            del m.forward


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
