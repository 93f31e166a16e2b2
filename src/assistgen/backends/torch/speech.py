"""Encoder-decoder speech targets (Whisper) behind the seam: the decoder, conditioned on one input, as a model.

Contract: `SpeechModel` (`load_speech(spec)`: an embedded alias, a transformers folder or a hub id of a
`WhisperForConditionalGeneration`) turns 16 kHz mono samples into log-mel features (`features`: one window of at most 30
s, transformers' `WhisperFeatureExtractor`; `long_features` and `window_of`: longer audio as transformers' long-form
reads it), builds the decoder prompt (`decoder_prompt`: an earlier text as <|startofprev|> ..., then
<|startoftranscript|>, the language, the task, and <|notimestamps|> unless timestamps are asked for) and names its
languages in English (`language_names`). `listen(features, begin)` runs the encoder once and returns a `HeardModel`: a
`backends.base.LanguageModel` whose caches start from that input (every cache, and every fork, reads the same
cross-attention keys and values, computed once per layer from the encoder's output), so the generation loop, the
drafters and the policy run on it unchanged. Its logits are those transformers' `generate()` decides on: the model's
`suppress_tokens` are -inf on every row, and its `begin_suppress_tokens` on the row that predicts token `begin` (the
first after the decoder prompt); with `timestamps`, Whisper's timestamp rules after them. The decoder's forward pass is
written here over the Hugging Face module's weights, with the same operations in the same order (pre-norm layers, the
query scaled before attention), and keys and values in preallocated buffers written by position (crop is free, fork
copies the self-attention buffers). `truncated(n)` runs the first n decoder layers (early exit); a heard model's
`cache_key` and `fingerprint` are the `SpeechModel`'s decoder's (with its layers and head), the same for every input
it hears, so what is measured of one holds for all. `for_drafting(scheme)` is a copy whose decoder runs in int8
or int4 weights (sharing every other tensor), for drafters only. The decoder's side (`HeardModel`, its caches and
forward pass) lives in `heard.py`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from assistgen.backends.embedded import ModelLoadError
from assistgen.backends.torch.devices import OnDevice, model_device
from assistgen.backends.torch.heard import DRAFT_VOCABULARY, HeardModel
from assistgen.backends.torch.quantize import quantized_linear
from assistgen.backends.torch.swap import replace_module
from assistgen.backends.torch.timing import clock
from assistgen.backends.torch.whisper_operations import HeadRows, heads

__all__ = ["DRAFT_VOCABULARY", "SAMPLE_RATE", "WINDOW_S", "Encoded", "HeardModel", "SpeechModel", "load_speech"]

SAMPLE_RATE = 16000
WINDOW_S = 30  # one encoder window
ROUTE_CONTEXT = 32  # the decoder positions before the passes route tuning times (a sentence's transcript)


@dataclass(eq=False)
class SpeechModel(OnDevice):
    """A loaded Whisper: the Hugging Face module, its tokenizer and feature extractor."""

    hf: torch.nn.Module
    tokenizer: Any
    extractor: Any
    name: str
    cache_key: str | None = None
    exit_layer: int | None = None  # the early-exit layer its calibration chose (`speech.transcribe`), once
    agreement: dict = field(default_factory=dict, repr=False)  # {scheme: how often its copy for drafting agrees}
    encoder_s_per_frame: float | None = None  # the encoder's time per mel frame, as last measured (`Encoded`)
    draft_heads: dict = field(default_factory=dict, repr=False)  # drafters' head rows (`draft_head`)
    quantization: str | None = None  # "int8" / "int4": a copy for drafting (`for_drafting`); None: as loaded
    drafting: dict = field(default_factory=dict, repr=False)  # {scheme: its copy for drafting}, made once
    routes: dict | None = None  # the small-row linear routes' record (`small_rows.tune_routes`), when applied
    backend = "torch"

    @property
    def generation(self):
        return self.hf.generation_config

    @property
    def multilingual(self) -> bool:
        return bool(getattr(self.generation, "is_multilingual", False))

    @property
    def languages(self) -> dict[str, int]:
        """{"en": 50259, ...}: the language codes this model takes."""
        return {k.strip("<|>"): v for k, v in (getattr(self.generation, "lang_to_id", None) or {}).items()}

    @property
    def language_names(self) -> dict[str, str]:
        """{"en": "english", ...}: the English name of each language code this model takes (transformers')."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        return {code: LANGUAGES.get(code, code) for code in self.languages}

    @property
    def context_length(self) -> int:
        """The decoder's positions (prompt and generated tokens together)."""
        return self.hf.config.max_target_positions

    @property
    def end_token(self) -> int:
        """<|endoftext|>: the end of a transcript; every id from it on is special (languages, tasks, timestamps)."""
        return int(self.generation.eos_token_id)

    @property
    def first_timestamp(self) -> int:
        """<|0.00|>: every id from it on is a timestamp (<|notimestamps|> + 1)."""
        return int(self.generation.no_timestamps_token_id) + 1

    def features(self, samples: np.ndarray) -> torch.Tensor:
        """[1, mels, 3000] log-mel features of at most 30 s of 16 kHz mono float samples (padded to 30 s)."""
        if len(samples) > SAMPLE_RATE * WINDOW_S:
            raise ValueError(f"one window holds at most {WINDOW_S} s; got {len(samples) / SAMPLE_RATE:.1f} s")
        out = self.extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        return out.input_features.to(self.device, self.dtype)

    def long_features(self, samples: np.ndarray) -> torch.Tensor:
        """[1, mels, frames] log-mel features of the whole audio, not cut nor padded (transformers' long-form input:
        its level is normalized over the whole audio, so a window's features differ from `features` of its samples)."""
        out = self.extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt", truncation=False,
                             padding="longest")
        return out.input_features.to(self.device, self.dtype)

    def window_of(self, features: torch.Tensor, seek: int) -> tuple[torch.Tensor, int]:
        """(the 30 s window of `long_features` from frame `seek`, padded with zeros as transformers' long-form pads
        it: [1, mels, 3000]; the frames of audio it holds)."""
        size = self.extractor.nb_max_frames
        window = features[:, :, seek: seek + size]
        return F.pad(window, (0, size - window.shape[-1])), window.shape[-1]

    def decoder_prompt(self, language: str | None = None, task: str = "transcribe",
                       previous: list[int] | None = None, timestamps: bool = False) -> list[int]:
        """The decoder's first tokens, as `generate()` builds them (<|notimestamps|> last unless `timestamps`)."""
        g = self.generation
        ids = [] if not previous else [g.prev_sot_token_id, *previous]
        ids.append(g.decoder_start_token_id)
        if self.multilingual:
            if language is not None:
                ids.append(self.languages[language])
            ids.append(g.task_to_id[task])
        if not timestamps:
            ids.append(g.no_timestamps_token_id)
        return ids

    def optimize(self, mode: str = "auto") -> None:
        """The CPU's small-row linear routes (`small_rows.small_rows_linear`) on every linear layer, the route for
        each row count tuned on this machine by timing the decoder on a second of silence (`small_rows.tune_routes`:
        MKL's product of W with the rows' transpose for one or two rows, oneDNN's packed weights where they measure
        faster; remembered on disk): a verification pass over a few rows then costs little more than one row
        (PyTorch's own linear costs about twice as much for two rows as for one here). Prompts and the encoder (more
        rows than the routes take) keep PyTorch's linear. transformers' `generate()` on this module runs the same
        layers. Its heard models' fingerprints name the routes: what was measured of them before no longer applies."""
        from assistgen.backends.torch.small_rows import small_rows_linear, tune_routes

        if self.device.type == "cpu" and mode and \
                small_rows_linear(self.hf, mode="on" if mode == "on" else "auto", routes="mkl"):
            tune_routes(self, timed=self.silence, context=ROUTE_CONTEXT)
        self.agreement.clear()

    def silence(self) -> HeardModel:
        """The decoder conditioned on a second of silence (what route tuning times)."""
        return self.listen(self.features(np.zeros(SAMPLE_RATE, dtype=np.float32)), begin=len(self.decoder_prompt()))

    def listen(self, features: torch.Tensor, begin: int, draft_vocabulary: int | None = None,
               lazy: bool = False, frames: int | None = None, timestamps: bool = False) -> HeardModel:
        """The decoder conditioned on `features` (the encoder runs once: here, or with `lazy` on the first pass that
        needs it, so that an assistant the policy never switches on costs nothing); `begin`: the decoder prompt's
        length (where `begin_suppress_tokens` apply); `draft_vocabulary`: for a drafter, see `HeardModel`;
        `frames`: for a drafter, encode only the first `frames` mel frames instead of the whole 30 s (whisper.cpp's
        reduced audio context: the encoder's cost falls with the audio's length; its drafts may be worse, and the
        target, which always hears the whole window, still decides); `timestamps`: Whisper's timestamp rules apply
        (`whisper_rules.TimestampRules`)."""
        encoded = Encoded(self, features, frames)
        if not lazy:
            encoded.layers()
        return HeardModel(self, encoded, begin, draft_vocabulary=draft_vocabulary, timestamps=timestamps)

    def draft_head(self, rows: int, timestamps: bool = False) -> tuple[torch.nn.Module, torch.Tensor]:
        """(a layer computing the logits of the head's first `rows` rows and the end token's, and with `timestamps`
        the timestamp tokens' [n, d] -> [n, rows + extra], the extra ids): its rows copied once (quantized in a copy
        for drafting)."""
        if (rows, timestamps) not in self.draft_heads:
            weight = self.hf.get_output_embeddings().weight  # [vocab, d]
            extra = [int(self.generation.eos_token_id)]
            if timestamps:
                extra += range(self.first_timestamp, weight.shape[0])
            extra = torch.tensor(sorted(set(extra)), device=weight.device)
            kept = torch.cat([weight[:rows], weight[extra]]).detach()  # [rows + extra, d]
            self.draft_heads[rows, timestamps] = (HeadRows(kept) if self.quantization is None
                                                  else quantized_linear(kept, None, self.quantization), extra)
        return self.draft_heads[rows, timestamps]

    def for_drafting(self, scheme: str = "int8") -> SpeechModel:
        """A copy of this model whose decoder's per-token layers (self-attention, the cross-attention's query and
        output, the feed-forward; and its drafters' head rows) hold `scheme` weights (`quantize_for_drafting`; CPU
        only): it drafts only, so its weights change its drafts' acceptance, never the output. Every other tensor
        (the encoder, the embeddings, the norms, the cross-attention's keys and values, which run once per window
        over many rows) is this model's own, shared, not copied. Made once per scheme."""
        if self.quantization is not None:
            raise ValueError(f"{self.name} is already a {self.quantization} copy for drafting")
        if scheme not in self.drafting:
            shared = {id(t): t for t in (*self.hf.parameters(), *self.hf.buffers())}
            hf = copy.deepcopy(self.hf, memo=shared)  # a new module tree over the same tensors
            for layer in hf.model.decoder.layers:
                quantize_for_drafting(layer, scheme)
            self.drafting[scheme] = SpeechModel(hf, self.tokenizer, self.extractor, name=f"{self.name}:{scheme}",
                                                cache_key=None if self.cache_key is None
                                                else f"{self.cache_key}:{scheme}", quantization=scheme)
        return self.drafting[scheme]


@torch.no_grad()
def quantize_for_drafting(layer, scheme: str) -> None:
    """A decoder layer of a copy for drafting, in `scheme` weights (`quantize.quantized_linear`), in place: its
    self-attention's query, key and value products fused into one (`qkv`), the attention scale folded into the query
    weights of both attentions (their `scaling` then 1.0), the outputs and the feed-forward quantized."""
    attn, cross = layer.self_attn, layer.encoder_attn

    def bias(linear) -> torch.Tensor:
        return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)

    weight = torch.cat([attn.q_proj.weight * attn.scaling, attn.k_proj.weight, attn.v_proj.weight])  # [3d, d]
    fused = torch.cat([bias(attn.q_proj) * attn.scaling, bias(attn.k_proj), bias(attn.v_proj)])
    attn.qkv = quantized_linear(weight, fused, scheme)
    attn.q_proj = attn.k_proj = attn.v_proj = None
    cross.q_proj = quantized_linear(cross.q_proj.weight * cross.scaling, bias(cross.q_proj) * cross.scaling, scheme)
    attn.scaling = cross.scaling = 1.0
    for name in ("self_attn.out_proj", "encoder_attn.out_proj", "fc1", "fc2"):
        old = layer.get_submodule(name)
        replace_module(layer, name, quantized_linear(old.weight, old.bias, scheme))


class Encoded:
    """One input's cross-attention keys and values, per decoder layer, computed from the encoder's output once."""

    def __init__(self, speech: SpeechModel, features: torch.Tensor, frames: int | None = None):
        self.speech, self.features, self.frames = speech, features, frames
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def frames_read(self) -> int:
        """The mel frames the encoder reads for this input."""
        whole = self.features.shape[-1]
        return whole if self.frames is None else min(whole, self.frames)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(keys, values) [1, heads, frames, d_h]] for every decoder layer (the encoder's time per frame kept on
        the model: `pending_s` prices the next input's)."""
        if self.cross is None:
            hf = self.speech.hf
            start = clock(model_device(hf))
            with torch.inference_mode():
                encoded = encode(hf.model.encoder, self.features, self.frames)  # [1, frames / 2, d]
                self.cross = [(heads(layer.encoder_attn.k_proj(encoded), layer.encoder_attn.num_heads),
                               heads(layer.encoder_attn.v_proj(encoded), layer.encoder_attn.num_heads))
                              for layer in hf.model.decoder.layers]
            self.speech.encoder_s_per_frame = (clock(model_device(hf)) - start) / self.frames_read
        return self.cross

    def pending_s(self) -> float:
        """The seconds encoding this input still costs: 0.0 once encoded, or before the model's encoder was ever
        timed."""
        if self.cross is not None or self.speech.encoder_s_per_frame is None:
            return 0.0
        return self.speech.encoder_s_per_frame * self.frames_read


def encode(encoder, features: torch.Tensor, frames: int | None) -> torch.Tensor:
    """The encoder's output [1, positions, d] for features [1, mels, 3000]: transformers' own forward over the whole
    window, or its operations over the first `frames` mel frames only (positions = frames / 2)."""
    if frames is None or frames >= features.shape[-1]:
        return encoder(features).last_hidden_state
    x = features[..., : max(2, frames + frames % 2)]
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(x)))).permute(0, 2, 1)  # [1, positions, d]
    x = x + encoder.embed_positions.weight[: x.shape[1]]
    for layer in encoder.layers:
        out = layer(x, None)
        x = out[0] if isinstance(out, tuple) else out
    return encoder.layer_norm(x)


def load_speech(spec: str, device: str | None = None, fast_linear: bool | str = "auto") -> SpeechModel:
    """A Whisper from an embedded alias (`embedded.SPEECH`, converted from CTranslate2 on first use and cached), a
    transformers folder or a hub id; `fast_linear` ("auto", True, False): `SpeechModel.optimize` after loading."""
    from pathlib import Path

    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperTokenizerFast

    from assistgen.backends.embedded import SPEECH

    key = spec.strip()
    folder = SPEECH[key].folder() if key in SPEECH else key
    local = Path(folder).expanduser().is_dir()
    try:
        hf = WhisperForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32,
                                                             local_files_only=local)
        tokenizer = WhisperTokenizerFast.from_pretrained(str(folder), local_files_only=local)
        extractor = WhisperFeatureExtractor.from_pretrained(str(folder), local_files_only=local)
    except (OSError, ValueError) as e:
        known = ", ".join(SPEECH)
        raise ModelLoadError(f"Cannot load the speech model {spec!r}: {e}. Give an embedded speech model ({known}), "
                             "a folder with a transformers Whisper, or its hub id.") from e
    hf.eval()
    if device is not None:
        hf.to(device)
    model = SpeechModel(hf, tokenizer, extractor, name=key, cache_key=key)
    if fast_linear:
        model.optimize("on" if fast_linear is True else "auto")
    return model
