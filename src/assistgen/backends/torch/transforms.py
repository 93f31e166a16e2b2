"""Transforms applied to a loaded model as explicit steps (not flags inside the loop), the way gpt-fast
applies `quantize.py`: `optimize(model)` runs them; `assistgen.prepare` calls it after loading.

Contract: `optimize` switches the model's attention to the grouped-query variant (`attention.py`; the row-by-row one
for a quantized model, whose linears are row-independent, so that a verification step computes each row exactly as
plain decoding does) and, on the CPU, swaps its linears for the small-row routes (`small_rows.py`), tuned per row
count on this machine; on a GPU it leaves the routes out (PyTorch's own linear runs there). `untransformed(*models)`
runs models as PyTorch and transformers ship them for the span of a `with` block and puts the very same transformed
modules and attention back on exit.
"""

from __future__ import annotations

import torch

from assistgen.backends.torch.attention import (
    ROW_ATTENTION,
    grouped_attention_applied,
    grouped_query_attention,
    remove_grouped_query_attention,
)
from assistgen.backends.torch.devices import model_device
from assistgen.backends.torch.small_rows import (
    remove_small_rows_linear,
    restore_small_rows_linear,
    small_rows_linear,
    tune_routes,
)


def optimize(model, mode: str = "auto", refresh: bool = False) -> None:
    """The explicit optimization step after loading: grouped-query (or, quantized, row-by-row) attention,
    then, on the CPU, the small-row linear routes, tuned per row count on this machine (`refresh`: timed again)."""
    grouped_query_attention(model.hf, row_independent=model.quantization is not None)
    if model_device(model.hf).type == "cpu" and small_rows_linear(model.hf, mode=mode):
        tune_routes(model, refresh=refresh)


class untransformed:
    """Context manager: the models run as PyTorch and transformers ship them (no small-row linear
    routes, transformers' own attention), e.g. to time transformers' `generate()`; on exit the very
    same transformed modules (routes, packed weights) and attention come back."""

    def __init__(self, *models: torch.nn.Module):
        self.models = models
        self.attention = [(m, grouped_attention_applied(m)) for m in models if grouped_attention_applied(m)]

    def __enter__(self):
        self.linear = [(m, remove_small_rows_linear(m)) for m in self.models]
        for m, _ in self.attention:
            remove_grouped_query_attention(m)
        return self

    def __exit__(self, *exc):
        for m, swapped in self.linear:
            restore_small_rows_linear(m, swapped)
        for m, name in self.attention:
            grouped_query_attention(m, row_independent=name == ROW_ATTENTION)
