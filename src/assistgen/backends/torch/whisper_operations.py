"""The operations Whisper's decoder pass is built from, written over a Hugging Face Whisper module's weights.

Contract: `heads` splits [1, t, d] into attention heads; `attention` is Whisper's attention over given keys and
values, with transformers' operations in its order (the query scaled before attention); `norm` is a layer norm by
its module's parameters; `product` runs a quantized layer's kernel directly (its own forward beyond
`quantized_layers.KERNEL_ROWS` rows); `HeadRows` and `rows_product` compute some rows of an output head for a few rows
(a drafter's head). None of them holds state: the caches and the layers that use them are `heard.py`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from assistgen.backends.torch.quantization_schemes import COMPUTE
from assistgen.backends.torch.quantized_layers import KERNEL_ROWS


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, t, d] -> [1, n, t, d/n]."""
    return x.view(1, x.shape[1], n, -1).transpose(1, 2).contiguous()


class HeadRows(torch.nn.Module):
    """Some rows of an output head [rows, d] as a layer: [n, d] -> [n, rows] (`rows_product`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return rows_product(self.weight, h)


def rows_product(weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h @ W.T for a few rows [n, d] as (W @ h.T).T, one row padded to two (the small-row route: a drafter's head)."""
    padded = torch.cat([h, torch.zeros_like(h)]) if h.shape[0] == 1 else h.contiguous()
    return (weight @ padded.T).T[: h.shape[0]]


def attention(attn, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """Whisper's attention for queries from `h` [1, n, d] over keys/values [1, heads, t, d_h] (query scaled first,
    as transformers does)."""
    q = heads(attn.q_proj(h) * attn.scaling, attn.num_heads)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)  # [1, heads, n, d_h]
    return attn.out_proj(out.transpose(1, 2).reshape(h.shape))


def norm(layer_norm, h: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, layer_norm.normalized_shape, layer_norm.weight, layer_norm.bias, layer_norm.eps)


def product(layer, x: torch.Tensor) -> torch.Tensor:
    """A quantized layer's x W^T + b for rows x [n, in] float32 -> [n, out] float32: its kernel called directly (its
    own forward beyond the kernel's rows)."""
    if x.shape[0] > KERNEL_ROWS:
        return layer(x)
    out = layer.matmul(x.to(COMPUTE)).float()
    return out if layer.bias is None else out + layer.bias


