"""A model's own first layers as a model: the torch side of early exit (the `first_layers` capability).

Contract: `truncated_module(hf, n)` returns a module that runs the first n decoder layers, then the final
norm and output head. It shares every weight with `hf` (the module objects are shallow copies, the layer
list is a new `ModuleList` over the same layers) and has its own config (n layers), so its KV cache holds
n layers and nothing of `hf` changes. `exit_agreement(hf, ids, positions)` measures, in one teacher-forced
forward, how often each exit's argmax equals the full model's; `layer_costs(hf)` is the share of the
parameters a draft token through the first n layers touches. Supported layouts: a causal LM whose base
model (`hf.base_model`) keeps its decoder layers in `layers` (Llama, Gemma-3, Mistral, Qwen, ...) or `h`
(GPT-2), with the final norm in `norm`, `ln_f` or `final_layernorm`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from assistgen.backends.torch.devices import model_device

LAYER_LISTS = ("layers", "h")  # where a base model keeps its decoder layers (Llama-style, GPT-2)
FINAL_NORMS = ("norm", "ln_f", "final_layernorm")


def has_decoder_layers(hf: nn.Module) -> bool:
    try:
        decoder_layers(hf)
    except ValueError:
        return False
    return True


def decoder_layers(hf: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(base model, name of its layer list, the layer list), or a ValueError naming the architecture."""
    base = getattr(hf, "base_model", None)
    if isinstance(base, nn.Module) and hf.get_output_embeddings() is not None:
        for attr in LAYER_LISTS:
            found = getattr(base, attr, None)
            if isinstance(found, nn.ModuleList) and len(found):
                return base, attr, found
    raise ValueError(
        f"early exit does not support {type(hf).__name__}: no decoder layer list "
        f"({' or '.join(f'base_model.{a}' for a in LAYER_LISTS)}) with an output head was found"
    )


def final_norm(hf: nn.Module) -> nn.Module:
    base, _, _ = decoder_layers(hf)
    for attr in FINAL_NORMS:
        norm = getattr(base, attr, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"early exit does not support {type(hf).__name__}: no final norm ({', '.join(FINAL_NORMS)})")


def truncated_module(hf: nn.Module, layers: int, name: str = "the model") -> nn.Module:
    """The first `layers` decoder layers + the final norm and head of `hf`, sharing all weights."""
    base, attr, full = decoder_layers(hf)
    total = len(full)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ValueError(f"early exit needs 1 <= layers < {total} (the decoder layers of {name}), got {layers!r}")
    config = truncated_config(hf.config, layers)
    inner = shallow_module_copy(base)
    setattr(inner, attr, nn.ModuleList(full[:layers]))
    inner.config = config
    if base is hf:
        top = inner
    else:
        top = shallow_module_copy(hf)
        setattr(top, hf.base_model_prefix, inner)
        top.config = config
    check_cache_layers(top, layers)
    return top


def shallow_module_copy(module: nn.Module) -> nn.Module:
    """A new module object over the same submodules, parameters and buffers (registries copied, not shared)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def truncated_config(config, layers: int):
    """A copy of `config` describing only the first `layers` decoder layers."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers  # GPT-2's config maps this to n_layer
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:layers])
    return config


def check_cache_layers(hf: nn.Module, layers: int) -> None:
    """The KV cache transformers builds from the truncated config must hold exactly `layers` layers."""
    built = len(DynamicCache(config=hf.config).layers)
    if built != layers:
        raise ValueError(f"the truncated {type(hf).__name__} config builds a cache of {built} layers, not {layers}")


def scored_positions(length: int, limit: int | None) -> torch.Tensor:
    """Up to `limit` positions evenly spaced over a text of `length` tokens (all of them when None)."""
    if limit is not None and limit < 1:
        raise ValueError(f"calibration needs at least 1 scored position, got {limit}")
    if limit is None or limit >= length:
        return torch.arange(length)
    return torch.linspace(0, length - 1, steps=limit).round().long()  # [limit], increasing, distinct


@torch.inference_mode()
def exit_agreement(hf: nn.Module, ids: list[int], positions: int | None) -> list[float]:
    """alpha_N for N = 1..L-1: how often the argmax of exit-N logits equals the full model's.

    One teacher-forced forward over all of `ids`; the exits are scored at `positions` of them (the
    output heads, one per exit, cost more than the forward with a large vocabulary). hidden_states[N]
    (N < L) is the output of layer N before the final norm. Gemma's logit soft-capping is monotonic,
    so the exits' argmaxes are taken without it.
    """
    if len(ids) < 2:
        raise ValueError(f"calibration needs at least 2 token ids, got {len(ids)}")
    _, _, full = decoder_layers(hf)
    norm, head = final_norm(hf), hf.get_output_embeddings()
    device = model_device(hf)
    keep = scored_positions(len(ids), positions).to(device)  # [P]
    out = hf(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, logits_to_keep=keep)
    hidden = out.hidden_states  # L+1 of [1, n, hidden]: embeddings, layers 1..L-1, final (normed) output
    if len(hidden) != len(full) + 1:
        raise ValueError(f"{type(hf).__name__} returned {len(hidden)} hidden states for {len(full)} layers")
    reference = out.logits[0].argmax(-1)  # [P]
    agreement = []
    for n in range(1, len(full)):
        exit_tokens = head(norm(hidden[n][0, keep])).argmax(-1)  # [P]
        agreement.append(float((exit_tokens == reference).float().mean()))
    return agreement


def layer_costs(hf: nn.Module) -> list[float]:
    """c_N for N = 1..L-1: parameters a draft token touches relative to a full step.

    (params of layers 1..N + head) / (params of all layers + head); the input embedding is a lookup
    and is not counted; a head tied to it counts once.
    """
    _, _, full = decoder_layers(hf)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in full]
    head = sum(p.numel() for p in hf.get_output_embeddings().parameters())
    total = sum(per_layer) + head
    return [(sum(per_layer[:n]) + head) / total for n in range(1, len(full))]
