"""Whisper's decoder conditioned on one input (`HeardModel`), its caches and its forward pass.

Contract: `HeardModel` is a `backends.base.LanguageModel` over a `speech.SpeechModel`'s decoder and one input's
cross-attention keys and values (`speech.Encoded`); `SpeechCache` holds one decoder sequence's self-attention keys
and values in preallocated buffers written by position (crop is free, fork copies them). The forward pass is
written here over the Hugging Face module's weights (`decoder_layer`, and `drafting_layer` for a copy for drafting,
from the operations of `whisper_operations.py`), with transformers' operations in its order (pre-norm layers,
the query scaled before attention), and its logits carry Whisper's token suppression as `generate()` applies it and,
with `timestamps`, Whisper's timestamp rules after it (`whisper_rules.py`: each row judged on the tokens before it, so
a verification pass's rows are those a one-token-at-a-time decoding would have seen). `speech.py` states the whole
contract.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from assistgen.backends.base import Capabilities, synced
from assistgen.backends.torch.timing import clock, measurement_key
from assistgen.backends.torch.whisper_operations import attention, heads, norm, product
from assistgen.backends.torch.whisper_rules import TimestampRules, suppression

DRAFTING_FORWARD = "2"  # a copy for drafting's forward pass (`drafting_layer`): its measured costs are keyed by it
DRAFT_VOCABULARY = 16384  # the token ids a drafter's head computes (`HeardModel.draft_vocabulary`)


@dataclass(eq=False)
class HeardModel:
    """Whisper's decoder conditioned on one input: a `LanguageModel` (see the module's contract)."""

    speech: Any  # the `speech.SpeechModel` it belongs to (not imported: speech.py builds heard models)
    encoded: Any  # the input's cross-attention keys and values (`speech.Encoded`)
    begin: int  # the index of the first generated token (the decoder prompt's length)
    layers: int | None = None  # run only the first `layers` decoder layers (early exit); None: all
    # A drafter's output head over the first `draft_vocabulary` token ids only (byte-level BPE numbers its tokens in
    # the order of their merges, so these are the most frequent ones) and the end token; every other logit is -inf.
    # The head is the larger part of a Whisper decoder pass; a draft of a rarer token is left to the target.
    draft_vocabulary: int | None = None
    timestamps: bool = False  # Whisper's timestamp rules on every generated row (`TimestampRules`; a drafter's head
    # then also computes the timestamp tokens' rows)
    backend = "torch"
    max_sequences = None
    masks: tuple = field(init=False)
    rules: TimestampRules | None = field(init=False)
    head: tuple = field(init=False)  # (the head: a layer [n, d] -> [n, rows], the ids of rows beyond the first ones
    # or None for the whole head)

    def __post_init__(self):
        self.masks = suppression(self.speech, self.vocab_size, self.device)
        self.rules = TimestampRules.of(self.speech) if self.timestamps else None
        if self.draft_vocabulary is None or self.draft_vocabulary >= self.vocab_size:
            self.head = (self.speech.hf.get_output_embeddings(), None)
        else:
            self.head = self.speech.draft_head(self.draft_vocabulary, self.timestamps)

    # --- what the loop reads ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.speech.name if self.layers is None else f"{self.speech.name}[:{self.layers}]"

    @property
    def cache_key(self) -> str | None:
        key = self.speech.cache_key
        return None if key is None else (key if self.layers is None else f"{key}[:{self.layers}]")

    @property
    def tokenizer(self):
        return self.speech.tokenizer

    @property
    def startup_s(self) -> float:
        """What encoding the input still costs before the first pass (lazily encoded: `speech.Encoded`)."""
        return self.encoded.pending_s()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(first_layers=self.layers is None)

    @property
    def decoder(self):
        return self.speech.hf.model.decoder

    @property
    def blocks(self):
        layers = self.decoder.layers
        return layers if self.layers is None else layers[: self.layers]

    @property
    def vocab_size(self) -> int:
        return self.speech.hf.get_output_embeddings().weight.shape[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        value = self.speech.generation.eos_token_id
        return tuple(int(i) for i in (value if isinstance(value, (list, tuple)) else [value]))

    @property
    def context_length(self) -> int:
        return self.speech.context_length

    @property
    def device(self) -> torch.device:
        return self.speech.device

    @property
    def dtype(self) -> torch.dtype:
        return self.speech.dtype

    @property
    def weight_bytes(self) -> int:
        """What one decoder pass reads: its layers, final norm and output head (tied to the token embeddings)."""
        parts = [*self.blocks.parameters(), *self.blocks.buffers(), *self.decoder.layer_norm.parameters(),
                 *self.head[0].parameters(), *self.head[0].buffers()]  # (quantized layers hold buffers)
        return sum(p.numel() * p.element_size() for p in parts)

    @property
    def kv_bytes_per_token(self) -> int:
        d = self.speech.hf.config.d_model
        return 2 * len(self.blocks) * d * torch.finfo(self.dtype).bits // 8

    def new_cache(self) -> SpeechCache:
        return SpeechCache(self)

    def feed_together(self, feeds) -> list[torch.Tensor]:
        """Each cache's pass in turn (the inputs differ, so their cross-attention does)."""
        if any(cache.model is not self for cache, _, _ in feeds):
            raise ValueError("feed_together needs caches of one model")
        return [cache.feed(ids, keep) for cache, ids, keep in feeds]

    def clock(self) -> float:
        return clock(self.device)

    def fingerprint(self, *extra: str) -> str:
        from assistgen.backends.torch.small_rows import applied_routes

        return measurement_key(self.speech, f"decoder_layers={len(self.blocks)}", "kind=speech",
                               f"routes={applied_routes(self.speech.hf)}", f"head={self.head_rows}",
                               f"weights={self.speech.quantization or 'float'}",
                               *([f"drafting={DRAFTING_FORWARD}"] if self.speech.quantization else []), *extra)

    @property
    def head_rows(self) -> int:
        return self.vocab_size if self.head[1] is None else self.draft_vocabulary + len(self.head[1])

    def optimize(self, mode: str = "auto", refresh: bool = False) -> None:
        """No speed transforms for speech targets yet: the decoder runs as loaded."""

    def describe(self) -> dict[str, Any]:
        """What loading chose (`backends.base`): the decoder's dtype and weights (a copy for drafting's scheme)."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "quantization": self.speech.quantization}

    # --- the decoder's forward pass -----------------------------------------------------------------------
    def forward(self, cache: SpeechCache, ids: list[int], keep: int) -> torch.Tensor:
        """Append `ids` to `cache`; the logits [keep, vocab] float32 of its last `keep` rows, suppression applied."""
        start, n = cache.length, len(ids)
        if start + n > self.context_length:
            raise ValueError(f"{self.name} holds {self.context_length} decoder positions; this pass would reach "
                             f"{start + n}")
        dec = self.decoder
        device = cache.device
        tokens = torch.tensor([ids], device=device)
        positions = torch.arange(start, start + n, device=device)
        h = dec.embed_tokens(tokens) + dec.embed_positions.weight[positions]  # [1, n, d]
        mask = None
        if n > 1:  # the new rows attend causally to each other and to every cached position
            mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
        cross = self.encoded.layers()
        if self.speech.quantization is None:
            for i, layer in enumerate(self.blocks):
                h = decoder_layer(layer, h, cache, i, start, mask, cross[i])
            last = dec.layer_norm(h[:, -keep:])[0]  # [keep, d]
        else:  # a copy for drafting
            h = h[0]  # [n, d]
            for i, layer in enumerate(self.blocks):
                h = drafting_layer(layer, h, cache, i, start, mask, cross[i])
            last = dec.layer_norm(h[-keep:])
        logits = self.project(last)  # [keep, vocab]
        always, first = self.masks
        logits = logits.masked_fill(always, float("-inf"))
        row = self.begin - (start + n - keep) - 1  # the kept row that predicts token `begin`, if any
        if 0 <= row < keep:
            logits[row] = logits[row].masked_fill(first, float("-inf"))
        if self.rules is not None:
            tokens, before = cache.tokens + ids, start + n - keep + 1  # row i predicts tokens[before + i]
            self.rules.apply(logits, [tokens[self.begin: before + i] if before + i >= self.begin else None
                                      for i in range(keep)])
        cache.length = start + n
        return logits

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """[keep, d] -> [keep, vocab] float32 logits: the whole head, or a drafter's rows of it (-inf elsewhere)."""
        head, extra = self.head
        if extra is None:
            return head(h).float()  # the model's own head (its route, if optimized)
        logits = head(h).float()  # [keep, rows + ends]
        full = logits.new_full((h.shape[0], self.vocab_size), float("-inf"))
        n = self.draft_vocabulary
        full[:, :n] = logits[:, :n]
        full[:, extra] = logits[:, n:]
        return full

    # --- capabilities.first_layers ------------------------------------------------------------------------
    def truncated(self, n: int) -> HeardModel:
        if not 1 <= n < len(self.decoder.layers):
            raise ValueError(f"{self.name} has {len(self.decoder.layers)} decoder layers; early exit needs 1..."
                             f"{len(self.decoder.layers) - 1}")
        return HeardModel(self.speech, self.encoded, self.begin, layers=n,
                          draft_vocabulary=self.draft_vocabulary or DRAFT_VOCABULARY, timestamps=self.timestamps)

    def exit_agreement(self, ids: list[int], positions: int | None) -> list[float]:
        """alpha_N, N = 1..L-1: how often exit N's argmax equals the full decoder's over `ids` (teacher-forced, on
        this input), scored at the last `positions` of them (all: None)."""
        ids = list(ids)[: self.context_length]
        full = self.new_cache().feed(ids, len(ids)).argmax(-1)
        score = slice(None) if positions is None else slice(-positions, None)
        out = []
        for n in range(1, len(self.decoder.layers)):
            exit_tokens = self.truncated(n).new_cache().feed(ids, len(ids)).argmax(-1)
            out.append(float((exit_tokens[score] == full[score]).float().mean()))
        return out

    def layer_costs(self) -> list[float]:
        """c_N: the parameters a draft token of exit N touches (its layers and its head's rows) over a full pass's."""
        per_layer = [sum(p.numel() for p in layer.parameters()) for layer in self.decoder.layers]
        head = self.head_rows * self.speech.hf.config.d_model
        drafts = self.truncated(1).head_rows * self.speech.hf.config.d_model
        total = sum(per_layer) + head
        return [(sum(per_layer[:n]) + drafts) / total for n in range(1, len(per_layer))]

def decoder_layer(layer, h: torch.Tensor, cache: SpeechCache, i: int, start: int, mask, cross) -> torch.Tensor:
    """One pre-norm decoder layer: self-attention over the cache, cross-attention over the input, feed-forward."""
    x = layer.self_attn_layer_norm(h)
    attn = layer.self_attn
    keys, values = cache.write(i, heads(attn.k_proj(x), attn.num_heads), heads(attn.v_proj(x), attn.num_heads), start)
    h = h + attention(attn, x, keys, values, mask)
    x = layer.encoder_attn_layer_norm(h)
    h = h + attention(layer.encoder_attn, x, cross[0], cross[1], None)
    x = layer.final_layer_norm(h)
    return h + layer.fc2(layer.activation_fn(layer.fc1(x)))


def drafting_layer(layer, h: torch.Tensor, cache: SpeechCache, i: int, start: int, mask, cross) -> torch.Tensor:
    """`decoder_layer` for a copy for drafting (`speech.quantize_for_drafting`: quantized products, the
    self-attention's query, key and value in one, the scales folded in) over rows h [n, d]: the same operations,
    each product run by its layer's kernel directly (`product`; a draft pass is many small operations, and module
    dispatch and reshaping were a fifth of its time)."""
    attn, cross_attn = layer.self_attn, layer.encoder_attn
    n, d = h.shape
    split = (n, attn.num_heads, d // attn.num_heads)
    x = norm(layer.self_attn_layer_norm, h)
    q, k, v = product(attn.qkv, x).view(n, 3, *split[1:]).permute(1, 2, 0, 3)  # [heads, n, d_h] each
    keys, values = cache.write(i, k[None], v[None], start)
    out = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, scale=1.0)[0]  # [heads, n, d_h]
    h = h + product(attn.out_proj, out.transpose(0, 1).reshape(n, d))
    x = norm(layer.encoder_attn_layer_norm, h)
    q = product(cross_attn.q_proj, x).view(split).transpose(0, 1)  # [heads, n, d_h]
    out = F.scaled_dot_product_attention(q[None], cross[0], cross[1], scale=1.0)[0]
    h = h + product(cross_attn.out_proj, out.transpose(0, 1).reshape(n, d))
    x = norm(layer.final_layer_norm, h)
    return h + product(layer.fc2, layer.activation_fn(product(layer.fc1, x)))

class SpeechCache:
    """One decoder sequence's self-attention keys and values ([1, heads, capacity, d_h] per layer, written by
    position); the cross-attention ones are its model's, shared."""

    def __init__(self, model: HeardModel):
        self.model = model
        self.device = model.device
        self.keys: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.length = 0
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int):
        """Store [1, heads, n, d_h] at positions start.. of `layer`; the layer's keys and values up to them."""
        end = start + key.shape[2]
        buf = self.keys[layer]
        if buf is None or buf.shape[2] < end:
            capacity = max(end, 2 * (0 if buf is None else buf.shape[2]), 64)
            grown_k = key.new_empty(1, key.shape[1], capacity, key.shape[3])
            grown_v = torch.empty_like(grown_k)
            if buf is not None:
                grown_k[:, :, :start] = buf[:, :, :start]
                grown_v[:, :, :start] = self.values[layer][:, :, :start]
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.keys[layer][:, :, start:end] = key
        self.values[layer][:, :, start:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def feed(self, ids: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        if not ids:
            raise ValueError("feed() needs at least one token")
        if not 1 <= logits_to_keep <= len(ids):
            raise ValueError(f"logits_to_keep must be in 1..{len(ids)}, got {logits_to_keep}")
        with torch.inference_mode():
            logits = self.model.forward(self, ids, logits_to_keep)
        self.tokens.extend(ids)
        return logits

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot crop a cache of {len(self.tokens)} positions to {length}")
        self.length = length
        del self.tokens[length:]

    def fork(self) -> SpeechCache:
        other = copy.copy(self)
        other.keys = [None if t is None else t.clone() for t in self.keys]
        other.values = [None if t is None else t.clone() for t in self.values]
        other.tokens = list(self.tokens)
        return other

    def sync(self, ids: list[int], keep_last: int = 1) -> list[int]:
        return synced(self, ids, keep_last)

    def clock(self) -> float:
        return clock(self.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
