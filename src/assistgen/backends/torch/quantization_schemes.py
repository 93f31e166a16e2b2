"""The weight-only quantization schemes: which there are, and how a float weight is encoded in each.

Contract: `SCHEMES` are the schemes `quantize` takes; `check_scheme` names them when given another (`QuantizeError`).
Each encoding is a function of the float weight alone (the float tensor is left as it is, and a large one is encoded
`CHUNK` rows at a time), into the layout PyTorch's CPU kernels take:
  - int8 (`int8_rows`): symmetric, one scale per output channel, for `torch.ops.aten._weight_int8pack_mm`;
    the input embedding takes the same encoding with one scale per token.
  - int4 (`int4_groups`, `pack_int4`): asymmetric, groups of 128 (64, 32 where the input width needs it:
    `group_size`) along the input, bf16 scale and zero per group, as gpt-fast; packed by
    `_convert_weight_to_int4pack_for_cpu` for `torch.ops.aten._weight_int4pack_mm_for_cpu`. That layout depends on
    the CPU's vector width (`int4_block`); `unpack_int4` reads it back, and packing checks it does, refusing a layout
    it does not know.
Scales and zeros are `COMPUTE` (bfloat16), what the kernels take as activations.
"""

from __future__ import annotations

import functools

import torch

SCHEMES = ("int8", "int4")
GROUP_SIZES = (128, 64, 32)  # int4 group size: the largest that divides the layer's input width
COMPUTE = torch.bfloat16  # what the kernels take as activations


class QuantizeError(ValueError):
    """The model or the scheme cannot be quantized; the message names what is supported."""


def check_scheme(scheme: str | None) -> str | None:
    if scheme in (None, "", "none"):
        return None
    if scheme not in SCHEMES:
        raise QuantizeError(f"Unknown quantization {scheme!r}: supported are {', '.join(SCHEMES)} (weight-only), "
                            "or none for the model's own floating-point weights.")
    return scheme


# ---------------------------------------------------------------------------------------------------------------
# int8, one scale per output row


CHUNK = 8192  # rows quantized at a time: bounds the float temporaries of a large head


@torch.no_grad()
def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (int8 [out, in], bf16 scales [out]) with W ≈ q * scale."""
    if weight.shape[0] > CHUNK:
        parts = [int8_rows(w) for w in weight.split(CHUNK)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    scales = (weight.abs().amax(dim=1).float() / 127).clamp(min=1e-12).to(COMPUTE)
    q = torch.round(weight.float() / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


# ---------------------------------------------------------------------------------------------------------------
# int4, groupwise along the input


def group_size(in_features: int) -> int | None:
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


@torch.no_grad()
def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (q int32 in 0..15 [out, in], bf16 scale/zero [in/group, out, 2]),
    W ≈ (q - 8) * scale + zero per group (gpt-fast's asymmetric scheme)."""
    if weight.shape[0] > CHUNK:
        parts = [int4_groups(w, group) for w in weight.split(CHUNK)]
        return torch.cat([q for q, _ in parts]), torch.cat([sz for _, sz in parts], dim=1)
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6).to(COMPUTE)
    zero = (low + 8 * scale.float()).to(COMPUTE)
    base = zero.float() - 8 * scale.float()  # the value of q = 0 as the kernel computes it
    q = torch.round((w - base) / scale.float()).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    scale_zero = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return q, scale_zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int32 [out, in] -> the kernel's uint8 layout [out, in/2] (checked against `unpack_int4`)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    if not torch.equal(unpack_int4(packed, q.shape[0], q.shape[1]), q.to(torch.uint8)):
        raise QuantizeError("This PyTorch build packs int4 weights in a layout assistgen does not know: use int8.")
    return packed


@functools.cache
def int4_block() -> int:
    """The rows per block of this machine's int4 layout (PyTorch's CPU kernel packs by its vector width: 64 rows
    with AVX-512, 32 with AVX2), found by packing a probe; 0 when neither layout reads it back."""
    q = (torch.arange(64 * 32, dtype=torch.int32).reshape(64, 32) * 7 + 3).remainder(16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return next((b for b in (64, 32) if torch.equal(_unpack(packed, 64, 32, b), q.to(torch.uint8))), 0)


def unpack_int4(packed: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """The kernel's layout back to q uint8 [out, in]: blocks of B rows (`int4_block`) stored [in, B/2] bytes (low
    nibble row j, high nibble row B/2 + j), the remaining rows stored [in, rest/2] (low row 2j, high row 2j + 1)."""
    return _unpack(packed, out_f, in_f, int4_block() or 64)


def _unpack(packed: torch.Tensor, out_f: int, in_f: int, block: int) -> torch.Tensor:
    flat = packed.reshape(-1)
    full, half = out_f // block * block, block // 2
    q = torch.empty(out_f, in_f, dtype=torch.uint8)
    if full:
        blocks = flat[: full * in_f // 2].view(full // block, in_f, half)  # [blocks, in, block/2]
        q[:full].view(full // block, block, in_f)[:, :half] = (blocks & 0xF).transpose(1, 2)
        q[:full].view(full // block, block, in_f)[:, half:] = (blocks >> 4).transpose(1, 2)
    rest = out_f - full
    if rest:
        tail = flat[full * in_f // 2:].view(in_f, rest // 2)  # [in, rest/2]
        q[full::2] = (tail & 0xF).T
        q[full + 1::2] = (tail >> 4).T
    return q


