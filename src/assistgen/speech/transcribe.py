"""Transcription: audio through a Whisper target, decoded by the one generation loop with any drafter.

Contract: `transcribe(model, audio, ...)` reads the audio (`audio.read_audio`) and decodes it as transformers'
`generate()` does: audio of at most 30 s in one window without timestamps (short-form), unless `timestamps` are
asked for; longer audio, or any with `timestamps`, by transformers' sequential long-form decoding (`split_segments`):
a 30 s window from the current frame, decoded with Whisper's timestamp rules (`whisper_rules.TimestampRules`), cut into
segments at each pair of timestamps, the next window starting at the last pair (or after the window, where it ends
on a single timestamp), each window's decoder prompt holding the `prompt` text (or, with `condition_on_previous`,
the segments so far). Each window runs the encoder once (`SpeechModel.listen`) and the generation loop
(`api.generate`) on the decoder conditioned on it, with the drafters asked for: prompt lookup, the n-gram cache,
early exit (the target's own first decoder layers, on the same encoder output), the self-draft (the target's own
decoder in quantized weights, on the same encoder output; the policy starts from its agreement with the target and
its pass time, measured once per model on the calibration text), or an assistant Whisper (its own encoder on the
same window's audio, run at its first draft and only over the audio itself and a second after it; another
tokenizer switches to universal mode, the assistant starting from its own decoder prompt without timestamps). A
drafting model runs in `draft_weights` (default: int8 on the CPU, `SpeechModel.for_drafting`); they change how many
drafts are accepted, never the output. The policy prices one-off costs (an assistant's encoder) against the
transcript's expected length (`expected_tokens`, from the window's audio). The `prompt` is kept as Whisper keeps it
(its last tokens only, half the decoder's context less one); a multilingual model given no language detects it from
the first window as `generate()` does (the most likely language token after <|startoftranscript|>). Greedy output is
the target's own (what `generate()` gives on the same features: short-form, or long-form with
`return_timestamps=True`); sampling follows its distribution; `logprobs=True` keeps each generated token's
log-probability (the target's). Names of speech models are resolved once per process (`as_speech_model`). Bad input
raises `ConfigError` or `AudioError` naming the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from assistgen.api import generate, resolved_once
from assistgen.backends.embedded import SPEECH
from assistgen.backends.torch.speech import (
    DRAFT_VOCABULARY,
    SAMPLE_RATE,
    WINDOW_S,
    HeardModel,
    SpeechModel,
    load_speech,
)
from assistgen.config import Cancelled, ConfigError, check_cancelled
from assistgen.drafters.assistant import AssistantDrafter, agreement, same_tokenizer
from assistgen.drafters.early_exit import calibrate_exit_layer
from assistgen.drafters.universal import UniversalDrafter
from assistgen.policy.costs import measured_costs
from assistgen.speech.audio import read_audio
from assistgen.stats import Stats

TASKS = ("transcribe", "translate")
HOP = 160  # samples per mel frame
FRAMES_PER_S = SAMPLE_RATE / HOP
FEATURE_S = 0.01  # a mel frame's time step (transformers' `time_precision_features`)
TIMESTAMP_S = 0.02  # a timestamp token's time step (`time_precision`)
FRAMES_PER_TIMESTAMP = 2  # the encoder's input stride: mel frames per timestamp step
DRAFT_WEIGHTS = ("auto", "int8", "int4", "float", None)
TAIL_FRAMES = 100  # mel frames of the window's padding an assistant's encoder also reads (1 s)
# The tokens a second of speech is expected to give (a brisk speaker: about 3 words a second, 1.3 tokens a word): the
# length the policy prices a drafter's one-off costs against (an assistant's encoder), never a limit.
SPOKEN_TOKENS_PER_S = 4.0


@dataclass
class Segment:
    """A stretch of speech between two timestamps the model predicted (or a window without timestamps)."""

    start_s: float
    end_s: float
    token_ids: list[int]  # its tokens, timestamps included, the end token not
    text: str


@dataclass
class Window:
    """One window's decoding: its time span, the decoder prompt, the generated ids and their statistics."""

    start_s: float
    end_s: float
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: Stats
    logprobs: list[float] | None = None  # each generated token's log-probability under the target (when asked for)
    language: str | None = None  # the language it was decoded in
    seek: int = 0  # its first mel frame
    frames: int = 0  # the mel frames it reads from `seek` (of audio, or of padding where the audio is shorter)
    segments: list[Segment] = field(default_factory=list)  # what it kept: with timestamps, the segments between
    # them (`split_segments`; `text` is theirs, `token_ids` all it generated); without, the window itself

    @property
    def avg_logprob(self) -> float | None:
        """The mean log-probability of the generated tokens, the end token included (Whisper's avg_logprob)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else None


@dataclass
class Transcription:
    text: str
    language: str | None  # the language decoded in (given or detected); None for an English-only model
    duration_s: float
    windows: list[Window] = field(default_factory=list)
    timestamps: bool = False  # decoded with timestamps (asked for, or audio over 30 s): its segments are the model's

    @property
    def stats(self) -> Stats:
        combined = Stats.combined([w.stats for w in self.windows])
        combined.finish_reason = self.windows[-1].stats.finish_reason if self.windows else ""
        return combined

    @property
    def segments(self) -> list[Segment]:
        """Every window's segments, in order."""
        return [s for w in self.windows for s in w.segments]


def load_speech_model(spec: str, device: str | None = None) -> SpeechModel:
    """Load a Whisper: an embedded alias (whisper-base, whisper-tiny-en), a transformers folder or a hub id."""
    return load_speech(spec, device)


def as_speech_model(model) -> SpeechModel:
    """A loaded `SpeechModel` as it is; a name (an embedded alias, a folder, a hub id) loaded once per process."""
    if isinstance(model, SpeechModel):
        return model
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"A speech model must be a loaded one (assistgen.load_speech_model) or its name "
                          f"({', '.join(SPEECH)}, a folder, a hub id), got {model!r}.")
    return resolved_once("speech", model, load_speech)


class Audio:
    """The audio as the models read it: the target's features (transformers' short-form: one window padded to 30 s;
    long-form, over 30 s: the whole audio's, uncut), and an assistant's when it extracts others (computed on its
    first use), each computed once per transcription."""

    def __init__(self, speech: SpeechModel, helper: SpeechModel | None, samples: np.ndarray):
        self.speech, self.helper, self.samples = speech, helper, samples
        self.long = len(samples) // HOP > speech.extractor.nb_max_frames  # (transformers' test: over 3000 frames)
        self.features = speech.long_features(samples) if self.long else \
            speech.features(samples[: SAMPLE_RATE * WINDOW_S])  # [1, mels, frames] (short: under a frame's samples cut)
        self.frames = self.features.shape[-1]  # what seeking covers (short-form: the padded window's 3000)
        self.spoken_frames = -(-len(samples) // HOP)  # the frames that hold audio
        self.duration_s = len(samples) / SAMPLE_RATE
        self.same = helper is None or helper.extractor.to_dict() == speech.extractor.to_dict()
        self.helper_features = None

    def helper_window(self, seek: int, window: torch.Tensor) -> torch.Tensor:
        """The assistant's features of the window from frame `seek` [1, mels, 3000] (`window`: the target's)."""
        helper = self.helper
        if self.same:
            return window.to(helper.device, helper.dtype)
        if self.helper_features is None:
            self.helper_features = helper.long_features(self.samples) if self.long else \
                helper.features(self.samples[: SAMPLE_RATE * WINDOW_S])
        return helper.window_of(self.helper_features, seek)[0]


@dataclass(frozen=True)
class Decoding:
    """One transcription's settings: how each of its windows is decoded (`window`)."""

    speech: SpeechModel
    helper: SpeechModel | None
    task: str
    lookup: bool
    early_exit: bool | int
    ngram_cache: bool | str
    self_draft: bool
    scheme: str | None
    schedule: object
    temperature: float
    seed: int | None
    max_new_tokens: int | None
    logprobs: bool
    cancelled: Callable[[], bool] | None

    def window(self, audio: Audio, seek: int, language: str | None, previous: list[int],
               timestamps: bool) -> Window:
        """The window of `audio` from frame `seek` through the encoder (once) and the generation loop, its decoder
        prompt holding `previous` as earlier text; a multilingual model given no language detects it here."""
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("The transcription was cancelled by its caller.")
        speech = self.speech
        features, frames = speech.window_of(audio.features, seek)
        heard = speech.listen(features, begin=0)  # the encoder runs here, once per window
        if speech.multilingual and language is None:
            language = detect_language(speech, heard)
        ids = speech.decoder_prompt(language, self.task, previous or None, timestamps)
        heard = replace(heard, begin=len(ids), timestamps=timestamps)  # the same input: begin suppression after this
        # decoder prompt, and the timestamp rules on the rows after it
        room = heard.context_length - len(ids)
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= room:
            raise ConfigError(f"max_new_tokens must be in 1..{room} for this decoder prompt, got "
                              f"{self.max_new_tokens}.")
        spoken = max(0, min(frames, audio.spoken_frames - seek))  # the frames of it that hold audio
        drafter = assistant_drafter(heard, self.helper, audio.helper_window(seek, features), spoken, language) \
            if self.helper is not None else self_drafter(heard, self.scheme) if self.self_draft else None
        exit_n = exit_layers(speech, heard, self.early_exit) if self.early_exit else False
        result = generate(heard, ids, assistant=drafter, lookup=self.lookup, early_exit=exit_n,
                          ngram_cache=self.ngram_cache, schedule=self.schedule,
                          max_new_tokens=self.max_new_tokens or room, temperature=self.temperature,
                          expected_new_tokens=expected_tokens(spoken), cancelled=self.cancelled, seed=self.seed,
                          logprobs=0 if self.logprobs else None)
        text = speech.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        kept = [lp.logprob for lp in result.logprobs] if self.logprobs else None
        start, end = seek / FRAMES_PER_S, min((seek + frames) / FRAMES_PER_S, audio.duration_s)
        window = Window(start, end, ids, result.token_ids, text, result.stats, kept, language, seek, frames)
        if not timestamps:
            window.segments = [Segment(start, end, [t for t in result.token_ids if t != speech.end_token], text)]
        return window


def split_segments(tokens: list[int], first: int, seek: int, frames: int, tokenizer,
                   eos: int) -> tuple[list[Segment], int]:
    """(the segments of a window decoded with timestamps, the frames to seek on by), as transformers' long-form
    decoding cuts them: at each pair of consecutive timestamps; a window that ends with a single timestamp holds no
    speech after it (all its frames are done), otherwise the text after the last pair is dropped and decoding
    seeks to that pair; without pairs the whole window is one segment, up to its last timestamp."""
    if tokens and tokens[-1] == eos:
        tokens = tokens[:-1]
    stamp = [t >= first for t in tokens]
    offset = seek * TIMESTAMP_S / FRAMES_PER_TIMESTAMP  # (transformers' arithmetic, to the last bit)
    single_ending = stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]

    def segment(begin: int, end: int, first_stamp: int | None, last_stamp: int) -> Segment:
        piece = tokens[begin:end]
        start = offset + (0.0 if first_stamp is None else (first_stamp - first) * TIMESTAMP_S)
        return Segment(start, offset + (last_stamp - first) * TIMESTAMP_S, piece,
                       tokenizer.decode(piece, skip_special_tokens=True))

    if not cuts:
        stamps = [t for t in tokens if t >= first]
        last = stamps[-1] if stamps and stamps[-1] != first else \
            first + int(torch.tensor(frames) * FEATURE_S / TIMESTAMP_S)  # (in float32, as transformers computes it)
        return [segment(0, len(tokens), None, last)], frames
    if single_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # (the pair's closing timestamp stays in the last segment)
    segments, begin = [], 0
    for i, cut in enumerate(cuts):
        closing = -1 if i < len(cuts) - 1 or single_ending else -2
        segments.append(segment(begin, cut, tokens[begin], tokens[begin:cut][closing]))
        begin = cut
    return segments, frames if single_ending else (tokens[begin - 2] - first) * FRAMES_PER_TIMESTAMP


def previous_tokens(kept: list[list[int]], first: int, limit: int) -> list[int]:
    """The earlier text a window is conditioned on: the segments so far (of a segment that ends with a pair of
    timestamps, all but the last), their last `limit` tokens."""
    joined = [t for tokens in kept for t in (tokens[:-1] if len(tokens) > 2 and tokens[-2] >= first else tokens)]
    return joined[-limit:]


def check_language(speech: SpeechModel, language: str | None) -> str | None:
    if language is None:
        return None
    if not speech.multilingual:
        if language.strip().lower() in ("en", "english"):
            return None
        raise ConfigError(f"{speech.name} is English-only: it cannot take language={language!r}. Leave it out, or use "
                          "a multilingual model (whisper-base).")
    code = language.strip().lower()
    if code not in speech.languages:
        raise ConfigError(f"{speech.name} does not know the language {language!r}: give an ISO 639-1 code it knows "
                          f"({', '.join(sorted(speech.languages)[:12])}, ...).")
    return code


def detect_language(speech: SpeechModel, heard: HeardModel) -> str:
    """The most likely language token after <|startoftranscript|> (transformers' `detect_language`)."""
    logits = heard.new_cache().feed([speech.generation.decoder_start_token_id])[-1]
    codes = list(speech.languages)
    ids = [speech.languages[c] for c in codes]
    return codes[int(logits[ids].argmax())]


def exit_layers(speech: SpeechModel, heard: HeardModel, early_exit: bool | int) -> int:
    """The exit layer: the given one, or the calibrated one (once per model: on its first input, over the decoder
    prompt and the package's sample article)."""
    if early_exit is not True:
        return int(early_exit)
    if speech.exit_layer is None:  # (on the text without timestamps, whatever this window decodes)
        speech.exit_layer = calibrate_exit_layer(replace(heard, timestamps=False), calibration_ids(speech))[0]
    return speech.exit_layer


def calibration_ids(speech: SpeechModel) -> list[int]:
    """A decoder prompt and the package's sample article (256 tokens): the text drafters are calibrated on."""
    from importlib.resources import files

    text = files("assistgen").joinpath("data/article.txt").read_text()
    return heard_prompt(speech) + list(speech.tokenizer(text, add_special_tokens=False)["input_ids"])[:252]


def heard_prompt(speech: SpeechModel) -> list[int]:
    return speech.decoder_prompt("en" if speech.multilingual else None)


def expected_tokens(frames: int) -> int:
    """The tokens a window's transcript is expected to take (`SPOKEN_TOKENS_PER_S`) from the frames of audio it
    holds, its end token included."""
    return int(frames / FRAMES_PER_S * SPOKEN_TOKENS_PER_S) + 1


def drafting_weights(speech: SpeechModel, draft_weights: str | None) -> str | None:
    """The scheme a drafter's copy of `speech` holds its weights in: "auto" is int8 on the CPU (PyTorch's quantized
    kernels are CPU kernels), float elsewhere; "float" or None: as loaded."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft_weights must be one of {', '.join(map(str, DRAFT_WEIGHTS))}, got {draft_weights!r}.")
    if draft_weights == "auto":
        return "int8" if speech.device.type == "cpu" else None
    if draft_weights in ("int8", "int4") and speech.device.type != "cpu":
        raise ConfigError(f"draft_weights={draft_weights!r} runs on the CPU only; {speech.name} is on "
                          f"{speech.device}: use draft_weights='float'.")
    return None if draft_weights == "float" else draft_weights


def self_drafter(target: HeardModel, scheme: str | None) -> AssistantDrafter:
    """The target's own decoder with quantized weights (`SpeechModel.for_drafting`) on the target's encoder output:
    the same tokenizer and the same input, so it agrees with the target on most tokens, at a fraction of its cost."""
    if scheme is None:
        raise ConfigError("self_draft needs quantized drafting weights (draft_weights='int8' or 'int4', on the CPU): "
                          "the target's own float decoder would cost as much as it saves.")
    speech, copy = target.speech, target.speech.for_drafting(scheme)
    heard = HeardModel(copy, target.encoded, target.begin, draft_vocabulary=DRAFT_VOCABULARY,
                       timestamps=target.timestamps)
    if scheme not in speech.agreement:  # once per model: on its first input, over the calibration text
        ids, begin = calibration_ids(speech), len(heard_prompt(speech))
        speech.agreement[scheme] = agreement(replace(target, begin=begin, timestamps=False),
                                             replace(heard, begin=begin, timestamps=False), ids,
                                             positions=len(ids) - begin)
        measured_costs(heard)  # its passes timed once (kept on disk): the policy's prior for its cost per token
    return AssistantDrafter(heard, target, acceptance_prior=speech.agreement[scheme])


def assistant_drafter(target: HeardModel, assistant: SpeechModel, features: torch.Tensor, spoken: int,
                      language: str | None):
    """The assistant Whisper on the same window (its copy for drafting, when `assistant` is one): same tokenizer, it
    drafts token ids directly; another, in universal mode from its own decoder prompt. Its decoder's passes are timed
    on its first window (`policy.costs.measured_costs`), so that the policy prices it by time, not by weight bytes.
    Where both extract the same features (Whisper's 80 mel bins), `features` [1, mels, 3000] are the target's;
    `spoken`: the window's frames that hold audio. With timestamps, a same-tokenizer assistant decodes with them
    too."""
    same = same_tokenizer(target, assistant)  # then it reads the target's decoder prompt, timestamps and all
    prompt = assistant.decoder_prompt(language if assistant.multilingual else None)  # (universal mode's own)
    frames = spoken + TAIL_FRAMES  # the audio's own frames, and a second of the padding after it
    heard = assistant.listen(features, begin=target.begin if same else len(prompt), draft_vocabulary=DRAFT_VOCABULARY,
                             lazy=True, frames=frames, timestamps=target.timestamps and same)  # its encoder runs
    measured_costs(heard)  # its passes timed once per model (kept on disk; on this first window, the encoder runs for
    # it): the policy's prior for its cost per token
    if same:
        return AssistantDrafter(heard, target)
    return UniversalDrafter(heard, target, prefix=prompt)


def transcribe(model, audio, assistant=None, language: str | None = None, prompt: str | None = None,
               task: str = "transcribe", lookup: bool = False, early_exit: bool | int = False, ngram_cache=False,
               self_draft: bool = False, draft_weights: str | None = "auto", schedule=None, temperature: float = 0.0,
               seed: int | None = None, max_new_tokens: int | None = None, max_seconds: float | None = None,
               logprobs: bool = False, timestamps: bool = False, condition_on_previous: bool = False,
               cancelled: Callable[[], bool] | None = None) -> Transcription:
    """Transcribe `audio` (a path, bytes, a binary file, or 16 kHz mono samples) with `model` (see the contract);
    `self_draft`: the target's own decoder in quantized weights drafts; `draft_weights` ("auto", "int8", "int4",
    "float"): the weights of a drafting model (the assistant, the self-draft); `logprobs`: keep each window's token
    log-probabilities (`Window.logprobs`); `timestamps`: decode with timestamps into segments (always, for audio over 30
    s); `condition_on_previous`: with timestamps, each window's decoder prompt holds the text before it (transformers'
    `condition_on_prev_tokens`; at temperatures below 0.5, a ConfigError above); `cancelled`: asked before each window
    and after each decoding step; once it answers True the transcription stops and raises `config.Cancelled` (a server's
    client gone)."""
    check_cancelled(cancelled)
    samples = read_audio(audio, max_seconds, name=str(audio) if isinstance(audio, (str, os.PathLike)) else "the audio")
    speech = as_speech_model(model)
    helper = None if assistant is None else as_speech_model(assistant)
    if sum(map(bool, (helper is not None, early_exit, self_draft))) > 1:
        raise ConfigError("Choose one model drafter: an assistant model, early exit or self_draft, not several.")
    scheme = drafting_weights(helper or speech, draft_weights)
    if helper is not None and scheme and helper.quantization is None:
        helper = helper.for_drafting(scheme)
    if task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}.")
    if task == "translate" and not speech.multilingual:
        raise ConfigError(f"{speech.name} is English-only: it cannot translate. Use task='transcribe'.")
    language = check_language(speech, language)
    if ngram_cache is True or isinstance(ngram_cache, str):  # a namespace of this model's own: token ids differ
        ngram_cache = f"speech:{speech.name}" + ("" if ngram_cache is True else f":{ngram_cache}")
    earlier = list(speech.tokenizer(" " + prompt.strip(), add_special_tokens=False)["input_ids"]) \
        if prompt and prompt.strip() else []
    earlier = earlier[-(speech.context_length // 2 - 1):]  # (Whisper keeps the prompt's end)
    source = Audio(speech, helper, samples)
    if condition_on_previous and not (timestamps or source.long):
        raise ConfigError("condition_on_previous gives each 30 s window the text before it: it needs timestamp "
                          "decoding (timestamps=True; audio over 30 s always has it). Leave it out for one window.")
    if condition_on_previous and temperature >= 0.5:
        raise ConfigError(f"condition_on_previous holds at temperatures below 0.5 only (as transformers' "
                          f"condition_on_prev_tokens: a high temperature's text is not kept as context); got "
                          f"temperature={temperature}. Lower it, or leave condition_on_previous out.")
    decoding = Decoding(speech, helper, task, lookup, early_exit, ngram_cache, self_draft, scheme, schedule,
                        temperature, seed, max_new_tokens, logprobs, cancelled)
    out = Transcription("", language, len(samples) / SAMPLE_RATE, timestamps=bool(timestamps) or source.long)
    if out.timestamps:
        out.windows = sequential(decoding, source, language, earlier, condition_on_previous)
        spoken = [t for segment in out.segments for t in segment.token_ids]
        out.text = speech.tokenizer.decode(spoken, skip_special_tokens=True).strip()
    else:  # transformers' short-form: one window, no timestamps
        out.windows = [decoding.window(source, 0, language, earlier, timestamps=False)]
        out.text = out.windows[0].text.strip()
    out.language = out.windows[-1].language
    return out


def sequential(decoding: Decoding, source: Audio, language: str | None, earlier: list[int],
               conditioned: bool) -> list[Window]:
    """transformers' sequential long-form decoding (see the contract): the windows, each with its segments."""
    speech = decoding.speech
    first = speech.first_timestamp
    kept: list[list[int]] = [earlier] if earlier else []  # the segments' tokens so far (the prompt first)
    windows, seek = [], 0
    while seek < source.frames:
        previous = previous_tokens(kept, first, speech.context_length // 2 - 1) if conditioned and kept else earlier
        window = decoding.window(source, seek, language, previous, timestamps=True)
        language = window.language
        window.segments, advance = split_segments(window.token_ids, first, seek, window.frames, speech.tokenizer,
                                                  speech.end_token)
        window.text = "".join(segment.text for segment in window.segments)
        kept.extend(segment.token_ids for segment in window.segments)
        windows.append(window)
        seek += max(advance, 1)  # (a window always moves on)
    return windows
