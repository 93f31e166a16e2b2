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

`grouped_query_attention(model)`: transformers' SDPA attention, for several new tokens over a KV
cache (a verification step) with grouped-query heads, first copies every cached key and value
once per query head (`repeat_kv`) and then runs the masked kernel. Here the query heads that share
a key/value head are stacked as extra query rows instead ([b, kv_heads, rep*q, d]) and the mask is
repeated to match, so the cache is read in place: at 700 tokens of context SmolLM2-135M then
verifies 2 tokens for 1.02x one step instead of 1.22x (`benchmarks/costs.py`). It is the same
kernel on the same numbers (bitwise identical logits here); every other case (one token,
prefill, softcap, position bias, no grouping) goes to transformers' own function unchanged.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

DEFAULT_MAX_ROWS = 32


def optimize(model, mode: str = "auto") -> None:
    """The explicit optimization step after loading (`load_model` calls it unless fast_linear=False):
    grouped-query attention, then the small-row linear routes, tuned per row count on this machine."""
    grouped_query_attention(model.hf, row_independent=model.quantization is not None)
    if small_rows_linear(model.hf, mode=mode):
        from assistgen.costs import tune_routes

        tune_routes(model)  # the faster route per row count, measured once per machine (cached)


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


def applied_routes(model: torch.nn.Module) -> list[str] | None:
    """The route table the small-row transform runs with (index = row count), or None when not applied."""
    for m in _linears(model):
        if hasattr(m, "_assistgen_routes"):
            return list(m._assistgen_routes)
    return None


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


def remove_small_rows_linear(model: torch.nn.Module, keep_packed: bool = False) -> None:
    """Back to `F.linear`; `keep_packed` keeps the packed weights for a later re-apply (not their memory back)."""
    attrs = ["_assistgen_max_rows", "_assistgen_routes", "forward"] + ([] if keep_packed else ["_assistgen_packed"])
    for m in _linears(model):
        if hasattr(m, "_assistgen_max_rows"):
            for attr in attrs:
                if attr in m.__dict__:
                    delattr(m, attr)


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
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register_attention()
    config._attn_implementation = ROW_ATTENTION if row_independent else ATTENTION
    return True


def remove_grouped_query_attention(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) in (ATTENTION, ROW_ATTENTION):
        config._attn_implementation = "sdpa"


def grouped_attention_applied(model: torch.nn.Module) -> str | None:
    """The assistgen attention a model runs (its name), or None."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return name if name in (ATTENTION, ROW_ATTENTION) else None


class untransformed:
    """Context manager: the models run as PyTorch and transformers ship them (no small-row linear
    routes, transformers' own attention), e.g. to time transformers' `generate()`; on exit the
    transforms come back with the same routes and packed weights."""

    def __init__(self, *models: torch.nn.Module):
        self.linear = [(m, routes) for m in models if (routes := applied_routes(m))]
        self.attention = [(m, grouped_attention_applied(m)) for m in models if grouped_attention_applied(m)]

    def __enter__(self):
        for m, _ in self.linear:
            remove_small_rows_linear(m, keep_packed=True)
        for m, _ in self.attention:
            remove_grouped_query_attention(m)
        return self

    def __exit__(self, *exc):
        for m, routes in self.linear:
            small_rows_linear(m, mode="on", max_rows=len(routes) - 1, routes=routes)
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
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    plain = best(lambda: F.linear(x, layer.weight, layer.bias))
    small = best(lambda: (layer.weight @ x.T).T)
    return small < 0.95 * plain
