"""Transforms applied to a loaded model as explicit steps (not flags inside the loop), the way gpt-fast
applies `quantize.py`: `optimize(model)` runs them; `assistgen.prepare` calls it after loading.

`small_rows_linear(model)`: on these CPUs PyTorch's `F.linear` (x @ W.T) costs almost linearly in
the number of rows for a few rows, so verifying k draft tokens costs close to k single steps and
speculation cannot pay. Every `nn.Linear` is swapped for a `SmallRowsLinear` (same weight and bias
tensors, no copy) that streams W once for all rows instead:
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

Contract: the result is the same product; floating-point summation order may differ in the last
bits between routes and row counts, which can only change an argmax at a near-tie. `mode` "auto"
applies it only if a quick measurement on the model's largest linear layer finds it faster. The
routes are CPU kernels: `optimize` leaves them out for a model on a GPU (PyTorch's own linear runs
there), and asking for them directly on weights elsewhere (`small_rows_linear`, `SmallRowsLinear`,
`tune_routes`) raises a `DeviceError` that says so.

`grouped_query_attention(model)`: transformers' SDPA attention, for several new tokens over a KV
cache (a verification step) with grouped-query heads, first copies every cached key and value
once per query head (`repeat_kv`) and then runs the masked kernel. Here the query heads that share
a key/value head are stacked as extra query rows instead ([b, kv_heads, rep*q, d]) and the mask is
repeated to match, so the cache is read in place, and a verification step over a long context costs
little more than one token (`benchmarks/costs.py`; figures in docs/benchmarks.md). It is the same
kernel on the same numbers (bitwise identical logits); every other case (one token,
prefill, softcap, position bias, no grouping) goes to transformers' own function unchanged. With
`row_independent=True` (quantized models) every row of a step of up to 32 rows is its own one-row
call instead, so that a verification step computes each row exactly as plain decoding does.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from assistgen.backends.measure import step_times
from assistgen.backends.torch.devices import model_device, require_cpu
from assistgen.backends.torch.ragged import inner_attention, set_inner_attention
from assistgen.backends.torch.timing import clock, measurement_key
from assistgen.paths import measurement_file, remembered

DEFAULT_MAX_ROWS = 32
ROUTES = ("mkl", "onednn")
PAD_GAIN = 0.97  # a padded row count is taken only when it measures at least 3% faster
CPU_ONLY = "The small-row linear transform"
ON_GPU = ("on a GPU PyTorch's own linear layers are the fast path, so leave the transform out "
          "(load_model(..., fast_linear=False), or transforms.optimize, which skips it there), or move the model "
          "to the CPU first.")


def optimize(model, mode: str = "auto", refresh: bool = False) -> None:
    """The explicit optimization step after loading: grouped-query (or, quantized, row-by-row) attention,
    then, on the CPU, the small-row linear routes, tuned per row count on this machine (`refresh`: timed again)."""
    grouped_query_attention(model.hf, row_independent=model.quantization is not None)
    if model_device(model.hf).type == "cpu" and small_rows_linear(model.hf, mode=mode):
        tune_routes(model, refresh=refresh)


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


def replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where `root.get_submodule(name)` is: the one way a transform swaps a layer."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


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


ATTENTION = "assistgen_sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """query [b, heads, q, d], key/value [b, kv_heads, kv, d] -> ([b, q, heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q, d = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    plain = (q == 1 or kv == q or heads == kv_heads or dropout or kwargs.get("softcap") is not None
             or kwargs.get("position_bias") is not None or kwargs.get("output_attentions"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    rep = heads // kv_heads  # query head h uses key/value head h // rep (as repeat_kv lays them out)
    stacked = query.reshape(b, kv_heads, rep * q, d)  # row r*q + t: head (kv_head*rep + r), position t
    mask = attention_mask
    if mask is not None:  # [b or 1, 1, q, kv] -> [b or 1, 1, rep*q, kv]
        mask = mask[:, :, None].expand(mask.shape[0], 1, rep, q, kv).reshape(mask.shape[0], 1, rep * q, kv)
    elif (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # transformers skips the mask only where causality is implied; keep it explicitly
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)
        mask = mask.repeat(rep, 1)[None, None]  # [1, 1, rep*q, kv]
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)  # [b, kv_heads, rep*q, d]
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


ROW_ATTENTION = "assistgen_rows"
ROW_ATTENTION_MAX_ROWS = 32  # steps up to this many query rows (decoding, verification) go row by row


def _rowwise_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Row-independent attention: every query row of a step with few rows is its own one-row SDPA call over
    exactly the keys it may see, so a verification row is computed as the plain decoding step at that
    position computes it, bitwise (a multi-row SDPA call sums in another order). query [b, heads, q, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, _, q, _ = query.shape
    kv = key.shape[2]
    special = (b != 1 or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
               or kwargs.get("output_attentions"))
    if q > ROW_ATTENTION_MAX_ROWS or special:  # a prefill: one call
        return _grouped_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
    rows = []
    for i in range(q):
        end = kv - q + i + 1  # row i sees keys [0, end) causally
        start, mask = 0, None
        if attention_mask is not None:
            allowed = attention_mask[0, 0, i, :end]
            allowed = allowed if allowed.dtype == torch.bool else allowed == 0
            start = int(allowed.to(torch.uint8).argmax())  # the first key it may see (a sliding window starts later)
            if not bool(allowed[start:].all()):  # not one range of keys: keep the row's mask
                start, mask = 0, attention_mask[:, :, i:i + 1, :end]
        out, _ = sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, start:end], value[:, :, start:end],
                                        mask, scaling=scaling, is_causal=False)
        rows.append(out)  # [b, 1, heads, d]
    return torch.cat(rows, dim=1), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, function in ((ATTENTION, _grouped_sdpa), (ROW_ATTENTION, _rowwise_sdpa)):
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, function)
            AttentionMaskInterface.register(name, sdpa_mask)


def grouped_query_attention(model: torch.nn.Module, row_independent: bool = False) -> bool:
    """Switch a model on transformers' SDPA attention to the grouped variant above, or with `row_independent`
    to the row-by-row one (what quantized models, whose linears are row-independent, need for exactness);
    returns whether it was switched."""
    config = getattr(model, "config", None)
    if config is None or inner_attention(config) != "sdpa":
        return False
    _register_attention()
    set_inner_attention(config, ROW_ATTENTION if row_independent else ATTENTION)
    return True


def remove_grouped_query_attention(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is not None and inner_attention(config) in (ATTENTION, ROW_ATTENTION):
        set_inner_attention(config, "sdpa")


def grouped_attention_applied(model: torch.nn.Module) -> str | None:
    """The assistgen attention a model runs (its name), or None."""
    config = getattr(model, "config", None)
    name = inner_attention(config) if config is not None else None
    return name if name in (ATTENTION, ROW_ATTENTION) else None


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
        record = remembered(routes_path(model), measure, ("routes", "padded"), refresh)
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
