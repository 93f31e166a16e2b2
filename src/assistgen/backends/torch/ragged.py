"""One forward pass of a model over the new rows of several sequences, each against its own keys and values.

Contract: `forward(model, feeds)` runs the model once over the concatenated new tokens of every
`Feed` (a sequence's `SequenceKV`, its token ids, and how many of its last rows' logits to keep) and
returns each feed's logits. Rows are laid out flat, as one sequence of N = sum(len(ids)) tokens with
each token's own position (vLLM's layout): every linear layer, norm and the output head see all rows
at once, so the weights are streamed once for the whole batch; only attention is per sequence. There
each sequence's rows read exactly its own keys (the cached ones and its new ones, causally, within a
sliding window where the layer has one) through the attention the model is configured with
(transformers' SDPA or assistgen's grouped / row-by-row variant, `attention.py`), called per
sequence as it would be for that sequence alone. A sequence's result therefore does not depend on
which others share the pass, up to the linear kernels' summation order for a different row count
(none with row-independent quantized kernels).

`SequenceKV` is one sequence's cache: per layer a preallocated [1, kv_heads, capacity, head_dim]
buffer written by position (gpt-fast), its capacity doubled when full, so rolling back a rejected
draft is setting `length` (`crop`) and the next write overwrites it. Sliding-window layers keep every
position; the window is applied in the mask. This module knows nothing about drafting or sampling.

Plumbing: `attach(model)` makes the model's attention the ragged one around the attention it had (the inner one,
which every call without a ragged plan, a plain forward, goes to unchanged): one ragged attention is registered with
transformers' `AttentionInterface` per inner attention (`assistgen_ragged` around SDPA, `assistgen_ragged_<n>`
around another), so the config's own `_attn_implementation` names both, and nothing else is written on a config;
`inner_attention` and `set_inner_attention` read and change the inner one (the attention transforms use them). The
model gets a 4D placeholder mask (transformers then builds none) and the plan as its cache, which receives each
layer's new keys and values.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from dataclasses import dataclass

import torch

ATTENTION = "assistgen_ragged"  # the ragged attention around SDPA (`ragged_attention`: around another, numbered)
_INNER: dict[str, str] = {}  # each registered ragged attention's name -> the inner attention it calls
_REGISTERING = threading.Lock()
BOOL_MASK_ATTENTION = ("sdpa", "assistgen_sdpa", "assistgen_rows")  # inner attentions that take a boolean mask


class SequenceKV:
    """One sequence's keys and values for every layer, written by position; `length` positions are valid."""

    def __init__(self):
        self.keys: list[torch.Tensor | None] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = []
        self.length = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int):
        """Store key/value [1, kv_heads, n, d] at positions start..start+n-1 of `layer`; return the layer's keys
        and values for positions 0..start+n-1 (views, [1, kv_heads, start+n, d])."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        end = start + key.shape[2]
        buffer = self.keys[layer]
        if buffer is None or buffer.shape[2] < end:
            self.keys[layer] = grown(buffer, end, key, start)
            self.values[layer] = grown(self.values[layer], end, value, start)
        self.keys[layer][:, :, start:end] = key
        self.values[layer][:, :, start:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def grown(buffer: torch.Tensor | None, needed: int, like: torch.Tensor, keep: int) -> torch.Tensor:
    """A buffer of at least `needed` positions (the next power of two, at least 64) holding buffer's first `keep`."""
    capacity = max(64, 1 << (needed - 1).bit_length())
    new = like.new_empty((*like.shape[:2], capacity, like.shape[3]))
    if buffer is not None and keep:
        new[:, :, :keep] = buffer[:, :, :keep]
    return new


@dataclass
class Feed:
    kv: SequenceKV
    ids: list[int]  # new tokens, written at positions kv.length..
    keep: int = 1  # logits of the last `keep` of them are returned


@dataclass
class Segment:
    kv: SequenceKV
    start: int  # first position written
    rows: slice  # its rows in the flat layout


class RaggedPass:
    """One ragged forward pass, handed to the model as its cache: stores each layer's new keys and values in the
    sequences' caches and keeps, per layer, each sequence's keys and values for the attention that follows."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        self.current: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [1, kv_heads, N, d] for every new row -> the same (attention reads `current`)."""
        self.current[layer_idx] = [s.kv.write(layer_idx, key[:, :, s.rows], value[:, :, s.rows], s.start)
                                   for s in self.segments]
        return key, value


@torch.inference_mode()
def forward(model: torch.nn.Module, feeds: list[Feed]) -> list[torch.Tensor]:
    """One forward over every feed's new tokens; returns per feed its last `keep` rows' logits [keep, vocab] float32."""
    if not feeds or any(not f.ids for f in feeds):
        raise ValueError("every feed needs at least one token")
    device = next(model.parameters()).device
    segments, positions, ids, kept, offset = [], [], [], [], 0
    for f in feeds:
        n = len(f.ids)
        segments.append(Segment(f.kv, f.kv.length, slice(offset, offset + n)))
        positions.append(torch.arange(f.kv.length, f.kv.length + n))
        ids.extend(f.ids)
        kept.append(torch.arange(offset + n - f.keep, offset + n))
        offset += n
    plan = RaggedPass(segments)
    keep = kept[0].numel() if len(feeds) == 1 else torch.cat(kept).to(device)  # an int slices (one sequence)
    out = model(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),  # [1, N]
        position_ids=torch.cat(positions).to(device)[None],  # [1, N]
        attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),  # placeholder: no mask is built
        **{cache_keyword(type(model)): plan},
        ragged=plan,
        use_cache=True,
        logits_to_keep=keep,
    )
    for f in feeds:
        f.kv.length += len(f.ids)
    logits = out.logits[0].float()  # [sum keep, vocab]
    return list(torch.split(logits, [f.keep for f in feeds]))


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The name the model's forward takes its cache by: `cache` (transformers >= 5.24) or `past_key_values` (before)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _ragged_attention(module, query, key, value, attention_mask, ragged: RaggedPass | None = None,
                      inner_name: str = "sdpa", **kwargs):
    """query [1, heads, N, d] over the flat rows -> ([1, N, heads, d], None), each sequence's rows attending to its
    own keys only, through the attention `inner_name`; without a plan (a plain forward) it runs unchanged."""
    inner = inner_function(module, inner_name)
    if ragged is None:
        return inner(module, query, key, value, additive(attention_mask, inner_name, query.dtype), **kwargs)
    window = kwargs.get("sliding_window")
    outputs = []
    for segment, (k, v) in zip(ragged.segments, ragged.current[module.layer_idx], strict=True):
        q = query[:, :, segment.rows]  # [1, heads, n, d]
        sdpa = inner_name in BOOL_MASK_ATTENTION  # takes is_causal for a plainly causal fill (a faster kernel)
        first, mask = sequence_mask(segment.start, q.shape[2], window, q.device, explicit=not sdpa)
        causal = mask is None and q.shape[2] > 1
        out, _ = inner(module, q, k[:, :, first:], v[:, :, first:], additive(mask, inner_name, q.dtype),
                       is_causal=causal, **kwargs)
        outputs.append(out)  # [1, n, heads, d]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def inner_function(module, name: str):
    """The attention function `name` names, as the model's own layer would look it up (eager is its module's)."""
    from transformers import AttentionInterface

    function = AttentionInterface._global_mapping.get(name)
    if function is None:
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"attention {name!r} is not available to {type(module).__name__}")
    return function


def additive(mask: torch.Tensor | None, inner_name: str, dtype) -> torch.Tensor | None:
    """A boolean mask as the inner attention takes it: unchanged for SDPA, 0 / -inf to add for the others (eager)."""
    if mask is None or mask.dtype != torch.bool or inner_name in BOOL_MASK_ATTENTION:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def sequence_mask(past: int, n: int, window: int | None, device, explicit: bool = False
                  ) -> tuple[int, torch.Tensor | None]:
    """The keys n new rows at positions past..past+n-1 may see: (first key, boolean mask [1, 1, n, keys from the
    first], None when the mask is plain causality, unless `explicit`: one row, or rows from position 0 within the
    window). Causal; within `window` positions when given."""
    first = 0 if not window else max(0, past - window + 1)
    if n == 1 or (not explicit and past == 0 and (not window or n <= window)):
        return first, None  # one row sees every key up to itself; a first fill is plainly causal
    query_pos = torch.arange(past, past + n, device=device)[:, None]  # [n, 1]
    key_pos = torch.arange(first, past + n, device=device)[None]  # [1, keys]
    allowed = key_pos <= query_pos
    if window:
        allowed &= query_pos - key_pos < window
    return first, allowed[None, None]


def attach(model: torch.nn.Module) -> None:
    """Route the model's attention through `_ragged_attention` (idempotent); what it had becomes the inner one.
    Every config the model's modules read is switched: layers shared with another model (early exit's truncated
    copy) read that model's config."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    for config in configs.values():
        if config._attn_implementation not in _INNER:
            config._attn_implementation = ragged_attention(config._attn_implementation or "sdpa")


def ragged_attention(inner: str) -> str:
    """The name of the ragged attention around the attention `inner` (registered with transformers on first use,
    with SDPA's mask for plain forwards)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    with _REGISTERING:
        name = next((n for n, wrapped in _INNER.items() if wrapped == inner), None)
        if name is None:
            name = ATTENTION if inner == "sdpa" else f"{ATTENTION}_{len(_INNER)}"
            AttentionInterface.register(name, functools.partial(_ragged_attention, inner_name=inner))
            AttentionMaskInterface.register(name, sdpa_mask)  # plain forwards (no plan) get SDPA's mask
            _INNER[name] = inner
        return name


def inner_attention(config) -> str | None:
    """The attention a model runs (inside the ragged one when attached)."""
    name = getattr(config, "_attn_implementation", None)
    return _INNER.get(name, name)


def set_inner_attention(config, name: str) -> None:
    attached = getattr(config, "_attn_implementation", None) in _INNER
    config._attn_implementation = ragged_attention(name) if attached else name
