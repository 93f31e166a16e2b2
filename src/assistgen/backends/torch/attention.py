"""Grouped-query and row-by-row attention: transformers' SDPA attention without copying the KV cache per query head.

Contract: `grouped_query_attention(model)` switches a model on transformers' SDPA attention (`ragged.inner_attention`)
to `ATTENTION`, registered with transformers' attention interface. transformers' SDPA attention, for several new
tokens over a KV cache (a verification step) with grouped-query heads, first copies every cached key and value once
per query head (`repeat_kv`) and then runs the masked kernel. Here the query heads that share a key/value head are
stacked as extra query rows instead ([b, kv_heads, rep*q, d]) and the mask is repeated to match, so the cache is read
in place, and a verification step over a long context costs little more than one token (`benchmarks/costs.py`;
figures in docs/benchmarks.md). It is the same kernel on the same numbers (bitwise identical logits); every other case
(one token, prefill, softcap, position bias, no grouping) goes to transformers' own function unchanged. With
`row_independent=True` (quantized models) the model runs `ROW_ATTENTION` instead: every row of a step of up to
`ROW_ATTENTION_MAX_ROWS` rows is its own one-row call, so that a verification step computes each row exactly as plain
decoding does. `remove_grouped_query_attention` switches back to transformers' SDPA; `grouped_attention_applied` names
the variant a model runs. A model on another attention implementation is left as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from assistgen.backends.torch.ragged import inner_attention, set_inner_attention

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
