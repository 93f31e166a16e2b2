"""Whisper's decoder conditioned on one input (`HeardModel`), its caches and its forward pass.

Contract: `HeardModel` is a `backends.base.LanguageModel` over a `speech.SpeechModel`'s decoder and one input's
cross-attention keys and values (`speech.Encoded`); `SpeechCache` holds one decoder sequence's self-attention keys
and values in preallocated buffers written by position (crop is free, fork copies them). The forward pass is
written here over the Hugging Face module's weights, with transformers' operations in its order (pre-norm layers,
the query scaled before attention), and its logits carry Whisper's token suppression as `generate()` applies it and,
with `timestamps`, Whisper's timestamp rules after it (`TimestampRules`: each row judged on the tokens before it, so
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
from assistgen.backends.torch.quantization_schemes import COMPUTE
from assistgen.backends.torch.quantized_layers import KERNEL_ROWS
from assistgen.backends.torch.timing import clock, measurement_key

DRAFTING_FORWARD = "2"  # a copy for drafting's forward pass (`drafting_layer`): its measured costs are keyed by it
DRAFT_VOCABULARY = 16384  # the token ids a drafter's head computes (`HeardModel.draft_vocabulary`)


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, t, d] -> [1, n, t, d/n]."""
    return x.view(1, x.shape[1], n, -1).transpose(1, 2).contiguous()


def suppression(speech, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [vocab] masks of the tokens suppressed everywhere and at the first generated position."""
    always, first = torch.zeros(vocab, dtype=torch.bool), torch.zeros(vocab, dtype=torch.bool)
    always[[t for t in (speech.generation.suppress_tokens or []) if t < vocab]] = True
    first[[t for t in (speech.generation.begin_suppress_tokens or []) if t < vocab]] = True
    return always.to(device), first.to(device)


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp rules, as transformers' `WhisperTimeStampLogitsProcessor` applies them to a row of logits
    (after the suppression) given the generated tokens before it: <|notimestamps|> never; timestamps come in pairs
    (after one timestamp that follows text, only a timestamp or the end; after two, no timestamp); they never decrease,
    and one that closes a pair may repeat the opening one but no other may repeat; the first token is a timestamp, at
    most `max_initial` steps in; and where the timestamps together are more likely than the likeliest text token, only a
    timestamp."""

    first: int  # the first timestamp token, <|0.00|> (<|notimestamps|> + 1); every later id is a timestamp
    eos: int  # the end token: the text tokens are the ids below it
    max_initial: int | None  # the latest timestamp the first generated token may be (None: any)

    @classmethod
    def of(cls, speech) -> TimestampRules:
        """A `speech.SpeechModel`'s rules (its generation config's)."""
        generation = speech.generation
        return cls(speech.first_timestamp, int(generation.eos_token_id),
                   getattr(generation, "max_initial_timestamp_index", None))

    def apply(self, logits: torch.Tensor, generated: list[list[int] | None]) -> torch.Tensor:
        """logits [rows, vocab] float32, in place; generated[i]: the generated tokens before row i (None: a row of the
        decoder prompt, left as it is: those come first)."""
        judged = next((i for i, seq in enumerate(generated) if seq is not None), len(generated))
        if judged == len(generated):
            return logits
        view, inf = logits[judged:], float("-inf")  # [rows judged, vocab]
        for row, seq in zip(view, generated[judged:], strict=True):
            text, other, lowest, highest = self.bounds(seq, row.shape[-1])
            if not text:
                row[: self.eos if other else self.first] = inf
            row[self.first - 1] = inf  # <|notimestamps|>
            row[self.first: lowest] = inf
            row[highest:] = inf
        logprobs = torch.log_softmax(view, dim=-1)
        timestamp = logprobs[:, self.first:].logsumexp(-1) > logprobs[:, : self.first].amax(-1)  # [rows judged]
        for i in timestamp.nonzero().flatten().tolist():  # (the rows where only a timestamp may come)
            view[i, : self.first] = inf
        return logits

    def bounds(self, seq: list[int], vocab: int) -> tuple[bool, bool, int, int]:
        """(text allowed, the other ids below the timestamps allowed, the lowest timestamp allowed, the one after the
        highest) for the row after `seq`."""
        first = self.first
        if not seq:  # the first token: a timestamp, at most `max_initial` steps in
            return False, False, first, vocab if self.max_initial is None else min(vocab, first + self.max_initial + 1)
        last = seq[-1] >= first
        penultimate = len(seq) < 2 or seq[-2] >= first
        if last and penultimate:  # a pair just closed (or the first token was a timestamp): text or the end next
            return True, True, first, first
        latest = next((t for t in reversed(seq) if t >= first), None)
        if last:  # a pair just opened: its closing timestamp (the same time, or later) or the end next
            return False, True, latest, vocab
        return True, True, first if latest is None else latest + 1, vocab  # (no timestamp earlier than the last one)


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


def norm(layer_norm, h: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, layer_norm.normalized_shape, layer_norm.weight, layer_norm.bias, layer_norm.eps)


def product(layer, x: torch.Tensor) -> torch.Tensor:
    """A quantized layer's x W^T + b for rows x [n, in] float32 -> [n, out] float32: its kernel called directly (its
    own forward beyond the kernel's rows)."""
    if x.shape[0] > KERNEL_ROWS:
        return layer(x)
    out = layer.matmul(x.to(COMPUTE)).float()
    return out if layer.bias is None else out + layer.bias


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
