"""The quantized layers: small modules with their own buffers that compute with int8 / int4 weights.

Contract: `Int8Linear` and `Int4Linear` (both `QuantizedLinear`) compute y = x W^T + b with W held in the encodings
of `quantization_schemes.py`, `Int8Embedding` looks tokens up in int8 rows (times the model's `embed_scale` where it
has one, as Gemma's scaled embedding). Activations stay floating point (the model's dtype); a quantized layer casts
its input rows to bfloat16 (`COMPUTE`) for PyTorch's CPU kernels and its output back.

Exactness: both kernels are row-independent (a row's result is bitwise the same alone or among
other rows), which is what makes greedy assisted decoding equal plain decoding with no near-tie
exception. They are used for up to `KERNEL_ROWS` rows, which covers every decoding and
verification step (at most 1 + `gain.MAX_K` rows); above that (a long prompt's prefill, the same forward
in plain and assisted decoding) a layer dequantizes its weight to bfloat16 and runs one matrix
product, which is faster for many rows. `quantize.row_independent(layer)` checks the property.

Device: the kernels used here are CPU kernels (`_weight_int4pack_mm_for_cpu` and its packing have no
GPU form; PyTorch has a CUDA `_weight_int8pack_mm`, but its row independence is not checked here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from assistgen.backends.torch.quantization_schemes import COMPUTE, int4_groups, pack_int4, unpack_int4

KERNEL_ROWS = 128  # rows up to which the row-independent kernels run (every decoding and verification step);
# above, dequantizing the layer once and one bf16 product is faster (docs/benchmarks.md, prefill)


class QuantizedLinear(torch.nn.Module):
    """y = x W^T + b with W held quantized; subclasses give `matmul` (the kernel) and `dequantized`."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out] in x's dtype: the kernel for up to KERNEL_ROWS rows, else one bf16 product."""
        flat = x.reshape(-1, self.in_features).to(COMPUTE)  # [rows, in]
        out = self.matmul(flat) if flat.shape[0] <= KERNEL_ROWS else F.linear(flat, self.dequantized())
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:  # [out, in] bf16
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=COMPUTE, device=device))
        self.register_buffer("bias", torch.empty(out_features, device=device) if bias else None)

    def dequantized(self) -> torch.Tensor:  # [out, in] bf16
        return self.weight.to(COMPUTE, copy=True).mul_(self.scales[:, None])  # in place: one fresh buffer

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(QuantizedLinear):
    """int4 groups; the kernel wants a multiple of 16 output rows, so the weight is padded with zero rows
    to `padded_out` and the product cut back to `out_features`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: int = 128, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.padded_out = -(-out_features // 16) * 16
        self.register_buffer("weight", torch.empty(self.padded_out, in_features // 2, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("scale_zero", torch.empty(in_features // group, self.padded_out, 2, dtype=COMPUTE,
                                                       device=device))
        self.register_buffer("bias", torch.empty(out_features, device=device) if bias else None)

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize float W [out, in] into this layer's buffers."""
        padded = F.pad(weight.float(), (0, 0, 0, self.padded_out - self.out_features))  # [padded_out, in]
        q, self.scale_zero = int4_groups(padded, self.group)
        self.weight = pack_int4(q)

    def dequantized(self) -> torch.Tensor:  # [out, in] bf16
        """(q - 8) * scale + zero, computed in place on one bf16 buffer: every prefill above
        KERNEL_ROWS pays this for every layer, and fresh [out, in] buffers per operation cost about as much as
        the arithmetic (docs/benchmarks.md, prefill)."""
        q = unpack_int4(self.weight, self.padded_out, self.in_features)[: self.out_features].to(COMPUTE, copy=True)
        q = q.view(self.out_features, -1, self.group)  # [out, groups, group]
        sz = self.scale_zero[:, : self.out_features]  # [groups, out, 2]
        scale, zero = (sz[..., i].T[..., None] for i in (0, 1))  # [out, groups, 1] each
        return q.sub_(8).mul_(scale).add_(zero).view(self.out_features, self.in_features)

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.scale_zero)
        return out if self.padded_out == self.out_features else out[:, : self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group={self.group}"


class Int8Embedding(torch.nn.Module):
    """Token embedding from int8 rows with one scale per token, times `embed_scale` where the model has one."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, embed_scale=None, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=COMPUTE, device=device))
        self.dtype = dtype  # what it returns: the model's activations
        self.embed_scale = embed_scale  # a float or None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., dim]
        rows = F.embedding(ids, self.weight).to(self.dtype) * self.scales[ids].to(self.dtype)[..., None]
        return rows if self.embed_scale is None else rows * torch.tensor(self.embed_scale, dtype=self.dtype)


