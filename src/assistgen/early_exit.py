"""Early-exit self-speculation: the target's own first N decoder layers draft for it.

Contract: `truncated_model(target, N)` returns a `Model` that runs the target's first N decoder
layers, then the target's final norm and output head. It shares every weight with the target (the
module objects are shallow copies, the layer list is a new `ModuleList` over the same layers) and has
its own config (N layers), so its KV cache holds N layers and nothing of the target changes.
`EarlyExitDrafter` drafts with it through `AssistantDrafter` (its own KV cache, synced to the
sequence at every proposal). `calibrate_exit_layer` picks N when none is given: one teacher-forced
forward of the full target over a calibration text measures, for every N, how often the exit-N
argmax equals the full model's (alpha_N); a parameter count estimates the cost of a draft token
relative to a target step (c_N); the N with the best expected speed-up (`gain.expected_gain` with the
target's measured verification costs, `costs.verification_costs`, over k = 1..MAX_K) wins. The drafter remembers
a calibration per target module for the life of the process, so only the first request pays for it.
This module knows nothing about acceptance or schedules: the generation loop verifies what it drafts.

Supported layouts: a causal LM whose base model (`hf.base_model`) keeps its decoder layers in
`layers` (Llama, Gemma-3, Mistral, Qwen, ...) or `h` (GPT-2), with the final norm in `norm` or `ln_f`.
"""

from __future__ import annotations

import copy
import weakref
from importlib.resources import files

import torch
from torch import nn
from transformers import DynamicCache

from assistgen.costs import verification_costs
from assistgen.devices import model_device
from assistgen.drafters import AssistantDrafter, Draft
from assistgen.gain import MAX_K, best_draft_length
from assistgen.models import Model
from assistgen.sampling import Sampler

LAYER_LISTS = ("layers", "h")  # where a base model keeps its decoder layers (Llama-style, GPT-2)
FINAL_NORMS = ("norm", "ln_f", "final_layernorm")
CALIBRATION_TOKENS = 256
SCORED_POSITIONS = 128  # positions of the calibration text at which every exit is scored (None: all)


class EarlyExitDrafter:
    """Drafts with the target truncated to its first `layers` decoder layers (chosen by calibration if None)."""

    name = "early-exit"

    def __init__(
        self,
        target: Model,
        layers: int | None = None,
        calibration_ids: list[int] | None = None,
        verify_cost: list[float] | None = None,
    ):
        self.calibration: list[dict] | None = None  # the table of calibrate_exit_layer, when it ran
        self.agreement: float | None = None
        if layers is None:
            ids = calibration_ids if calibration_ids is not None else default_calibration_ids(target)
            layers, self.calibration = remembered_calibration(target, ids, verify_cost)
            self.agreement = next(row["agreement"] for row in self.calibration if row["layers"] == layers)
        self.layers = layers
        self.model = truncated_model(target, layers)
        self.assistant = AssistantDrafter(self.model, target)
        self.context_length = self.assistant.context_length

    @property
    def acceptance_prior(self) -> float | None:
        """The calibrated agreement: the adaptive policy's acceptance estimate before any draft."""
        return self.agreement

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        draft = self.assistant.propose(ids, k, sampler, min_confidence)
        draft.source = "early-exit"
        return draft

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        self.assistant.observe(num_accepted, target_probs)

    def finish(self, ids: list[int]) -> None:
        pass

    def report(self) -> dict:
        return {"early_exit_layers": self.layers, "early_exit_agreement": self.agreement}


# --- the truncated model ---------------------------------------------------------------------------


def truncated_model(target: Model, layers: int) -> Model:
    """The target's first `layers` decoder layers + its final norm and head, sharing all weights."""
    base, attr, full = decoder_layers(target.hf)
    total = len(full)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ValueError(
            f"early exit needs 1 <= layers < {total} (the decoder layers of {target.name}), got {layers!r}"
        )
    config = truncated_config(target.hf.config, layers)
    inner = shallow_module_copy(base)
    setattr(inner, attr, nn.ModuleList(full[:layers]))
    inner.config = config
    if base is target.hf:
        top = inner
    else:
        top = shallow_module_copy(target.hf)
        setattr(top, target.hf.base_model_prefix, inner)
        top.config = config
    check_cache_layers(top, layers)
    model = Model(top, target.tokenizer, f"{target.name}[:{layers}]")
    if getattr(target, "cache_key", None):  # on-disk measurements (costs) must not mix the two models
        model.cache_key = f"{target.cache_key}[:{layers}]"
    return model


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


# --- calibration -----------------------------------------------------------------------------------


def default_calibration_ids(target: Model, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The first `n` tokens of the package's sample article, in the target's tokenizer."""
    text = files("assistgen").joinpath("data/article.txt").read_text()
    return list(target.tokenizer(text)["input_ids"])[:n]


def scored_positions(length: int, limit: int | None) -> torch.Tensor:
    """Up to `limit` positions evenly spaced over a text of `length` tokens (all of them when None)."""
    if limit is not None and limit < 1:
        raise ValueError(f"calibration needs at least 1 scored position, got {limit}")
    if limit is None or limit >= length:
        return torch.arange(length)
    return torch.linspace(0, length - 1, steps=limit).round().long()  # [limit], increasing, distinct


@torch.inference_mode()
def exit_agreement(target: Model, ids: list[int], positions: int | None = SCORED_POSITIONS) -> list[float]:
    """alpha_N for N = 1..L-1: how often the argmax of exit-N logits equals the full model's.

    One teacher-forced forward over all of `ids`; the exits are scored at `positions` of them (the
    output heads, one per exit, cost more than the forward with a large vocabulary). hidden_states[N]
    (N < L) is the output of layer N before the final norm. Gemma's logit soft-capping is monotonic,
    so the exits' argmaxes are taken without it.
    """
    if len(ids) < 2:
        raise ValueError(f"calibration needs at least 2 token ids, got {len(ids)}")
    _, _, full = decoder_layers(target.hf)
    norm, head = final_norm(target.hf), target.hf.get_output_embeddings()
    device = model_device(target)
    keep = scored_positions(len(ids), positions).to(device)  # [P]
    out = target.hf(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, logits_to_keep=keep)
    hidden = out.hidden_states  # L+1 of [1, n, hidden]: embeddings, layers 1..L-1, final (normed) output
    if len(hidden) != len(full) + 1:
        raise ValueError(f"{type(target.hf).__name__} returned {len(hidden)} hidden states for {len(full)} layers")
    reference = out.logits[0].argmax(-1)  # [P]
    agreement = []
    for n in range(1, len(full)):
        exit_tokens = head(norm(hidden[n][0, keep])).argmax(-1)  # [P]
        agreement.append(float((exit_tokens == reference).float().mean()))
    return agreement


def layer_costs(target: Model) -> list[float]:
    """c_N for N = 1..L-1: parameters a draft token touches relative to a full step.

    (params of layers 1..N + head) / (params of all layers + head); the input embedding is a lookup
    and is not counted; a head tied to it counts once.
    """
    _, _, full = decoder_layers(target.hf)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in full]
    head = sum(p.numel() for p in target.hf.get_output_embeddings().parameters())
    total = sum(per_layer) + head
    return [(sum(per_layer[:n]) + head) / total for n in range(1, len(full))]


def best_speedup(alpha: float, cost: float, verify_cost: list[float]) -> tuple[float, int]:
    """(max over k = 1..MAX_K of the expected gain E(k) / (k * cost + v[k]) at acceptance rate alpha, that k),
    with v = verify_cost (k within it)."""
    k, gain = best_draft_length([alpha], verify_cost, cost, MAX_K)
    return gain, k


def calibrate_exit_layer(
    target: Model,
    ids: list[int] | None = None,
    verify_cost: list[float] | None = None,
    positions: int | None = SCORED_POSITIONS,
) -> tuple[int, list[dict]]:
    """The exit layer N with the best expected speed-up, and the table behind the choice.

    `ids`: the calibration text (default: the first 256 tokens of the package's sample article);
    `verify_cost[k]`: the cost of verifying k draft tokens relative to a plain step (default: the target's
    measured costs, `costs.verification_costs`).
    Rows: {"layers", "agreement", "cost", "best_speedup", "best_k"} for N = 1..L-1. When no row's
    best_speedup exceeds 1, early exit is not expected to pay on this model (N is still the best one).
    """
    if verify_cost is None:
        verify_cost = verification_costs(target)
    if len(verify_cost) < 2:
        raise ValueError("verify_cost needs v[0] and at least v[1] (cost of verifying 1 draft token)")
    ids = default_calibration_ids(target) if ids is None else list(ids)
    agreement, costs = exit_agreement(target, ids, positions), layer_costs(target)
    table = []
    for n, (alpha, cost) in enumerate(zip(agreement, costs, strict=True), start=1):
        speedup, k = best_speedup(alpha, cost, verify_cost)
        table.append({"layers": n, "agreement": alpha, "cost": cost, "best_speedup": speedup, "best_k": k})
    best = max(table, key=lambda row: row["best_speedup"])
    return best["layers"], table


_calibrations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target module -> {settings: result}


def remembered_calibration(
    target: Model, ids: list[int], verify_cost: list[float] | None = None
) -> tuple[int, list[dict]]:
    """`calibrate_exit_layer`, run once per target module and settings in this process (each request builds
    a drafter; calibrating a large-vocabulary model takes seconds). verify_cost None: the target's measured costs."""
    if verify_cost is None:
        verify_cost = verification_costs(target)
    key = (tuple(ids), tuple(verify_cost))
    known = _calibrations.setdefault(target.hf, {})
    if key not in known:
        known[key] = calibrate_exit_layer(target, ids, verify_cost)
    layers, table = known[key]
    return layers, [dict(row) for row in table]
