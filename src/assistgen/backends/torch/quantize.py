"""Weight-only int8 / int4 quantization as a module swap, the way gpt-fast's `quantize.py` does it.

Contract: `quantize(model, scheme)` walks a loaded model (`model.Model`) once and swaps every `nn.Linear` (the output
head included) for an `Int8Linear` or `Int4Linear` and the input embedding for an `Int8Embedding`;
each is a small module with its own buffers, and the floating-point weights are freed as it goes.
Activations stay floating point (the model's dtype); a quantized layer casts its input rows to
bfloat16 for PyTorch's CPU kernels and its output back.

  - int8: symmetric, one scale per output channel; `torch.ops.aten._weight_int8pack_mm`.
  - int4: asymmetric, groups of 128 (64, 32 where the input width needs it) along the input,
    bf16 scale and zero per group, as gpt-fast; `torch.ops.aten._weight_int4pack_mm_for_cpu` on
    the layout of `_convert_weight_to_int4pack_for_cpu`.
  - embedding: int8 with one scale per token (the same tensors as the head when the model ties
    them and the scheme is int8); a scaled embedding (Gemma's `embed_scale`) keeps its factor.

Exactness: both kernels are row-independent (a row's result is bitwise the same alone or among
other rows), which is what makes greedy assisted decoding equal plain decoding with no near-tie
exception. They are used for up to `KERNEL_ROWS` rows, which covers every decoding and
verification step (at most 1 + `gain.MAX_K` rows); above that (a long prompt's prefill, the same forward
in plain and assisted decoding) a layer dequantizes its weight to bfloat16 and runs one matrix
product, which is faster for many rows. `row_independent(layer)` checks the property.

Device: the kernels used here are CPU kernels (`_weight_int4pack_mm_for_cpu` and its packing have no
GPU form; PyTorch has a CUDA `_weight_int8pack_mm`, but its row independence is not checked here), so
`quantize` refuses weights that are not on the CPU with a `DeviceError` naming the way out
(quantize on the CPU, or run the unquantized model in bfloat16 on the GPU).

The scheme and what was swapped are kept in the model's fields (`quantization`, `quantized_layers`).
`save_quantized` / `load_quantized` keep a quantized model on disk (a state dict next to the
config and tokenizer), so a second load builds the module tree with empty weights and reads the
quantized buffers directly: no floating-point copy of the weights is ever made again.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from assistgen.backends.base import MAX_K
from assistgen.backends.torch.devices import require_cpu
from assistgen.backends.torch.model import Model
from assistgen.backends.torch.swap import replace_module
from assistgen.paths import replaced_atomically

SCHEMES = ("int8", "int4")
KERNEL_ROWS = 128  # rows up to which the row-independent kernels run (every decoding and verification step);
# above, dequantizing the layer once and one bf16 product is faster (docs/benchmarks.md, prefill)
GROUP_SIZES = (128, 64, 32)  # int4 group size: the largest that divides the layer's input width
FORMAT = 1  # version of the on-disk layout below
COMPUTE = torch.bfloat16  # what the kernels take as activations


class QuantizeError(ValueError):
    """The model or the scheme cannot be quantized; the message names what is supported."""


ON_GPU = ("quantize on the CPU (load_model(spec, quantize=..., device='cpu')), or on a GPU load the model "
          "unquantized in bfloat16 (load_model(spec, dtype=torch.bfloat16, device='cuda')).")


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


# ---------------------------------------------------------------------------------------------------------------
# the handler: walks the model once


def _embed_scale(module: torch.nn.Module):
    """The factor a scaled embedding multiplies by (Gemma), or None; refuses other embedding subclasses."""
    if type(module) is torch.nn.Embedding:
        return None
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        raise QuantizeError(f"The input embedding {type(module).__name__} computes something assistgen does not "
                            "know; int8/int4 quantization supports nn.Embedding and scaled embeddings (embed_scale).")
    return float(scale)


def quantization_specs(hf: torch.nn.Module, scheme: str) -> dict[str, dict]:
    """What `quantize` will swap: {module name: spec}; raises QuantizeError for a model it cannot quantize
    (DeviceError for one whose weights are not on the CPU)."""
    scheme = check_scheme(scheme)
    from transformers.pytorch_utils import Conv1D

    specs: dict[str, dict] = {}
    for name, m in hf.named_modules():
        if isinstance(m, Conv1D):
            raise QuantizeError(f"{type(hf).__name__} uses GPT-2-style Conv1D layers ({name}); int8/int4 quantization "
                                "supports models built from nn.Linear layers (Llama, Qwen2, Gemma, Mistral, ...).")
        if isinstance(m, torch.nn.Linear):
            require_cpu(m.weight.device, f"{scheme} quantization ({name})", ON_GPU)
            if scheme == "int4":
                group = group_size(m.in_features)
                if group is None:
                    raise QuantizeError(f"Layer {name} ({m.in_features} -> {m.out_features}) cannot be int4-quantized: "
                                        f"int4 needs an input width divisible by 32; "
                                        "use --quantize int8 for this model.")
                specs[name] = {"kind": "int4", "group": group, "bias": m.bias is not None}
            else:
                specs[name] = {"kind": "int8", "bias": m.bias is not None}
    if not specs:
        raise QuantizeError(f"{type(hf).__name__} has no nn.Linear layers to quantize.")
    embedding = hf.get_input_embeddings()
    embed_name = next(n for n, m in hf.named_modules() if m is embedding)
    require_cpu(embedding.weight.device, f"{scheme} quantization ({embed_name})", ON_GPU)
    specs[embed_name] = {"kind": "embedding", "embed_scale": _embed_scale(embedding)}
    return specs


@torch.no_grad()
def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> QuantizedLinear:
    """One quantized layer computing x W^T + b from float W [out, in] (the float tensors are left as they are)."""
    scheme = check_scheme(scheme)
    require_cpu(weight.device, f"{scheme} quantization", ON_GPU)
    out_f, in_f = weight.shape
    group = group_size(in_f) if scheme == "int4" else None
    if scheme == "int4" and group is None:
        raise QuantizeError(f"A {in_f} -> {out_f} layer cannot be int4-quantized (int4 needs an input width divisible "
                            "by 32): use int8.")
    spec = {"kind": scheme, "group": group, "bias": bias is not None}
    layer = _empty_module(spec, (out_f, in_f), weight.dtype, "cpu")
    if scheme == "int4":
        layer.set_weight(weight)
    else:
        layer.weight, layer.scales = int8_rows(weight)
    if bias is not None:
        layer.bias = bias.detach().clone()
    return layer


def _empty_module(spec: dict, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.nn.Module:
    out_f, in_f = shape
    if spec["kind"] == "int8":
        return Int8Linear(in_f, out_f, spec["bias"], device=device)
    if spec["kind"] == "int4":
        return Int4Linear(in_f, out_f, spec["bias"], group=spec["group"], device=device)
    return Int8Embedding(out_f, in_f, embed_scale=spec["embed_scale"], device=device, dtype=dtype)


def _tied(hf: torch.nn.Module) -> bool:
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    return head is not None and head.weight is embedding.weight


@torch.no_grad()
def quantize(model: Model, scheme: str) -> Model:
    """Swap the linears and the embedding of a loaded model on the CPU for quantized modules (in place); returns
    the model, its `quantization` and `quantized_layers` set."""
    hf = model.hf
    specs = quantization_specs(hf, scheme)
    dtype = hf.get_input_embeddings().weight.dtype
    tied = hf.get_input_embeddings().weight if _tied(hf) else None  # an int8 head and embedding tied to one
    shared: tuple | None = None  # float weight share its int8 rows too
    for name, spec in specs.items():
        old = hf.get_submodule(name)
        if spec["kind"] != "embedding" and not (spec["kind"] == "int8" and old.weight is tied):
            new = quantized_linear(old.weight, old.bias, spec["kind"])
        else:  # the embedding, or an int8 head tied to it: one set of int8 rows for both
            new = _empty_module(spec, tuple(old.weight.shape), dtype, "cpu")  # weight [out, in] or [vocab, dim]
            shared = shared or int8_rows(old.weight)
            new.weight, new.scales = shared
            if spec["kind"] != "embedding" and old.bias is not None:
                new.bias = old.bias.detach().clone()
        replace_module(hf, name, new)
        del old
    model.quantization, model.quantized_layers = scheme, specs  # (its fingerprint changes with them: what was
    # measured of the unquantized model no longer applies)
    return model


@torch.inference_mode()
def row_independent(layer: torch.nn.Module, max_rows: int = MAX_K + 1, seed: int = 0) -> bool:
    """True when each row of a product over 2..max_rows rows equals that row alone, bitwise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max_rows, layer.in_features, generator=gen)  # [rows, in]
    alone = torch.cat([layer(x[i:i + 1]) for i in range(max_rows)])  # [rows, out]
    return all(torch.equal(layer(x[:n]), alone[:n]) for n in range(2, max_rows + 1))


# ---------------------------------------------------------------------------------------------------------------
# on disk

WEIGHTS = "quantized.pt"
META = "assistgen-quantized.json"


def save_quantized(model: Model, folder: Path) -> None:
    """Write config, tokenizer and the quantized state dict to `folder` (atomically: a temporary folder renamed)."""
    hf = model.hf
    with replaced_atomically(folder) as tmp:
        tmp.mkdir(parents=True)
        hf.config.save_pretrained(tmp)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(tmp)
        model.tokenizer.save_pretrained(tmp)
        torch.save(hf.state_dict(), tmp / WEIGHTS)
        (tmp / META).write_text(json.dumps({"format": FORMAT, "scheme": model.quantization,
                                            "specs": model.quantized_layers, "torch": torch.__version__,
                                            **({"int4_block": int4_block()} if model.quantization == "int4" else {})}))


def is_saved(folder: Path) -> bool:
    """Whether `folder` holds a quantized model this machine can run (an int4 model packed in another machine's
    layout is not: it is quantized again)."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return False
    same_layout = meta.get("scheme") != "int4" or meta.get("int4_block", 64) == int4_block()  # older files: AVX-512
    return meta.get("format") == FORMAT and same_layout and (folder / WEIGHTS).exists()


@torch.no_grad()
def load_quantized(folder: Path, dtype: torch.dtype = torch.float32, name: str | None = None) -> Model:
    """The model in a folder written by `save_quantized`, without materialising float weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    meta = json.loads((folder / META).read_text())
    config = AutoConfig.from_pretrained(str(folder))
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (rotary) real
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for layer, spec in meta["specs"].items():
        old = hf.get_submodule(layer)
        replace_module(hf, layer, _empty_module(spec, tuple(old.weight.shape), dtype, "meta"))
    state = torch.load(folder / WEIGHTS, mmap=True, weights_only=True)
    hf.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.device.type == "meta"]
    if left:
        raise QuantizeError(f"The quantized model in {folder} lacks {left[:3]}: delete that folder to rebuild it.")
    try:
        hf.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        pass
    return Model(hf.eval(), AutoTokenizer.from_pretrained(str(folder)), name or folder.name,
                 quantization=meta["scheme"], quantized_layers=meta["specs"])
