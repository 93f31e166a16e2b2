"""The torch backend's model: a Hugging Face causal LM behind the seam of `backends.base`.

Contract: `Model(hf, tokenizer, name)` wraps a loaded module in eval mode and implements
`backends.base.LanguageModel`: `new_cache()` gives a `KVCache` (preallocated keys and values written by
position, `ragged.py`), `feed_together` runs one ragged forward pass over several caches, `clock()` waits
for the model's device, `optimize()` applies the transforms, `fingerprint()` keys measurements by the
model, this machine and the model's set-up (quantization, linear routes, attention, KV layout). What
loading and the transforms decide about the model is kept in its own fields (`quantization`,
`quantized_layers`, `routes`; `describe()` says them to the layers above); it holds nothing of the policy's, and
nothing is stashed on the Hugging Face module or its config. The first-layers capability (`truncated`,
`exit_agreement`, `layer_costs`) is declared for models whose decoder layers `layers.py` can find.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from assistgen.backends.base import Capabilities, Feed
from assistgen.backends.torch import layers
from assistgen.backends.torch.cache import KVCache, feed_together
from assistgen.backends.torch.devices import OnDevice
from assistgen.backends.torch.timing import clock, measurement_key


@dataclass(eq=False)
class Model(OnDevice):
    """A loaded causal LM: the Hugging Face module, its tokenizer and what decoding needs to know."""

    hf: torch.nn.Module
    tokenizer: Any
    name: str
    cache_key: str | None = None  # stable identity (alias, path, hub id) for on-disk measurements; None: in-memory
    quantization: str | None = None  # "int8" | "int4" when loading quantized it
    quantized_layers: dict | None = None  # {module name: spec} of the quantized modules (what save_quantized writes)
    routes: dict | None = None  # the small-row linear routes' record (`small_rows.tune_routes`), when applied
    max_memory: int | None = None  # the budget its weights were offloaded under (`offload.py`), bytes; None: none
    has_layers: bool = field(init=False)  # its decoder layers are found (`layers.py`): early exit can run
    backend = "torch"
    startup_s = 0.0
    max_sequences = None  # each cache has buffers of its own

    def __post_init__(self):
        self.has_layers = layers.has_decoder_layers(self.hf)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(first_layers=self.has_layers, offloaded=self.max_memory is not None)

    @property
    def config(self):
        return self.hf.config

    @property
    def context_length(self) -> int | None:
        text = self.hf.config.get_text_config(decoder=True)
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(text, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the output embedding may be padded past the tokenizer)."""
        return self.hf.get_output_embeddings().weight.shape[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids as transformers' generate() uses them: generation config, else model config, else tokenizer."""
        for source in (getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                return tuple(int(i) for i in (value if isinstance(value, (list, tuple)) else [value]))
        return ()

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers (quantized weights are buffers, so they count as what they are)."""
        return sum(t.numel() * t.element_size() for t in (*self.hf.parameters(), *self.hf.buffers()))

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position over all layers, in the model's dtype (what `KVCache` buffers hold)."""
        text = self.hf.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self) -> KVCache:
        return KVCache(self)

    def feed_together(self, feeds: list[Feed]) -> list[torch.Tensor]:
        return feed_together(feeds)

    def clock(self) -> float:
        return clock(self.device)

    def set_up(self) -> tuple[str, ...]:
        """What timings depend on beyond the model and machine: quantization, linear routes, attention, KV layout, and
        the budget its weights are offloaded under."""
        from assistgen.backends.torch.attention import grouped_attention_applied
        from assistgen.backends.torch.small_rows import applied_routes

        padded = self.routes.get("padded") if self.routes else None
        budget = (f"max_memory={self.max_memory}",) if self.max_memory else ()  # (measured in the budget's conditions)
        return (f"quantization={self.quantization}", f"routes={applied_routes(self.hf)}|{padded}",
                f"attention={grouped_attention_applied(self.hf)}", "kv=ragged", *budget)

    def fingerprint(self, *extra: str) -> str:
        return measurement_key(self, *self.set_up(), *extra)

    def optimize(self, mode: str = "auto", refresh: bool = False) -> None:
        """The backend's optimization transforms (`transforms.optimize`); they change `fingerprint()`, so what was
        measured of the model before no longer applies."""
        from assistgen.backends.torch.transforms import optimize

        optimize(self, mode, refresh)

    def describe(self) -> dict[str, Any]:
        """What loading and the transforms chose (`backends.base`): dtype, quantization, and on the CPU, where the
        small-row linear routes are tuned, their record (None: not applied) and where it is cached."""
        from assistgen.backends.torch.small_rows import routes_path

        out = {"dtype": str(self.dtype).removeprefix("torch."), "quantization": self.quantization}
        if self.routes or self.device.type == "cpu":
            out.update(linear_routes=self.routes, routes_file=routes_path(self) if self.routes else None)
        return out

    # --- capabilities.first_layers ------------------------------------------------------------------------

    def truncated(self, n: int) -> Model:
        """The first `n` decoder layers + the final norm and head, sharing every weight (its own config)."""
        model = Model(layers.truncated_module(self.hf, n, self.name), self.tokenizer, f"{self.name}[:{n}]")
        if self.cache_key:  # on-disk measurements (costs) must not mix the two models
            model.cache_key = f"{self.cache_key}[:{n}]"
        return model

    def exit_agreement(self, ids: list[int], positions: int | None) -> list[float]:
        return layers.exit_agreement(self.hf, ids, positions)

    def layer_costs(self) -> list[float]:
        return layers.layer_costs(self.hf)
