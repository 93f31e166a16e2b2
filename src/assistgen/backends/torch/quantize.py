"""Weight-only int8 / int4 quantization as a module swap, the way gpt-fast's `quantize.py` does it.

Contract: `quantize(model, scheme)` walks a loaded model (`model.Model`) once and swaps every `nn.Linear` (the output
head included) for an `Int8Linear` or `Int4Linear` and the input embedding for an `Int8Embedding`
(`quantized_layers.py`; the schemes' encodings are `quantization_schemes.py`'s); each is a small module with its own
buffers, and the floating-point weights are freed as it goes. The embedding is int8 with one scale per token (the
same tensors as the head when the model ties them and the scheme is int8); a scaled embedding (Gemma's
`embed_scale`) keeps its factor. `quantization_specs` says what will be swapped, refusing a model it cannot quantize
(`QuantizeError`) before anything changes; `quantized_linear` quantizes one layer; `row_independent(layer)` checks
that each row of a product is bitwise that row alone.

Device: the kernels are CPU kernels, so `quantize` refuses weights that are not on the CPU with a `DeviceError`
naming the way out (quantize on the CPU, or run the unquantized model in bfloat16 on the GPU).

The scheme and what was swapped are kept in the model's fields (`quantization`, `quantized_layers`).
`save_quantized` / `load_quantized` keep a quantized model on disk (a state dict next to the
config and tokenizer), so a second load builds the module tree with empty weights and reads the
quantized buffers directly: no floating-point copy of the weights is ever made again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from assistgen.backends.base import MAX_K
from assistgen.backends.torch.devices import require_cpu
from assistgen.backends.torch.model import Model
from assistgen.backends.torch.quantization_schemes import QuantizeError, check_scheme, group_size, int4_block, int8_rows
from assistgen.backends.torch.quantized_layers import Int4Linear, Int8Embedding, Int8Linear, QuantizedLinear
from assistgen.backends.torch.swap import replace_module
from assistgen.paths import replaced_atomically

FORMAT = 1  # version of the on-disk layout below

ON_GPU = ("quantize on the CPU (load_model(spec, quantize=..., device='cpu')), or on a GPU load the model "
          "unquantized in bfloat16 (load_model(spec, dtype=torch.bfloat16, device='cuda')).")

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
