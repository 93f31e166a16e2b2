"""Transcription: audio through a Whisper target, decoded by the one generation loop with any drafter.

Contract: `transcribe(model, audio, ...)` reads the audio (`audio.read_audio`), cuts it into consecutive windows of
at most 30 s, and for each one runs the encoder once (`SpeechModel.listen`) and the generation loop (`api.generate`)
on the decoder conditioned on it, with the drafters asked for: prompt lookup, the n-gram cache, early exit (the
target's own first decoder layers, on the same encoder output), the self-draft (the target's own decoder in
quantized weights, on the same encoder output; the policy starts from its agreement with the target and its pass
time, measured once per model on the calibration text), or an assistant Whisper (its own encoder on the same
window's audio, run at its first draft and only over the audio itself and a second after it; another tokenizer
switches to universal mode, the assistant starting from its own decoder prompt). A drafting model runs in
`draft_weights` (default: int8 on the CPU, `SpeechModel.for_drafting`); they change how many drafts are accepted,
never the output. The policy prices one-off costs (an assistant's encoder) against the transcript's expected length
(`expected_tokens`, from the window's duration). The decoder prompt is transformers' short-form one
(`SpeechModel.decoder_prompt`: the `prompt` text as earlier context, its last tokens only, half the decoder's
context less one, as Whisper keeps them; the language, the task, no timestamps); a multilingual model given no
language detects it from the first window as `generate()` does (the most likely language token after
<|startoftranscript|>). Each later window gets the text of the one before as its earlier context. Greedy output per
window is the target's own (what `generate()` gives on the same features and decoder prompt); sampling follows its
distribution; `logprobs=True` keeps each generated token's log-probability (the target's). Names of speech models
are resolved once per process (`as_speech_model`). Bad input raises `ConfigError` or `AudioError` naming the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

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
from assistgen.policy.costs import pass_costs
from assistgen.speech.audio import read_audio
from assistgen.stats import Stats

TASKS = ("transcribe", "translate")
HOP = 160  # samples per mel frame
DRAFT_WEIGHTS = ("auto", "int8", "int4", "float", None)
TAIL_FRAMES = 100  # mel frames of the window's padding an assistant's encoder also reads (1 s)
# The tokens a second of speech is expected to give (a brisk speaker: about 3 words a second, 1.3 tokens a word): the
# length the policy prices a drafter's one-off costs against (an assistant's encoder), never a limit.
SPOKEN_TOKENS_PER_S = 4.0


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

    @property
    def stats(self) -> Stats:
        combined = Stats.combined([w.stats for w in self.windows])
        combined.finish_reason = self.windows[-1].stats.finish_reason if self.windows else ""
        return combined


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


def windows(samples: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive [start, end) sample ranges of at most 30 s covering `samples`."""
    size = SAMPLE_RATE * WINDOW_S
    return [(i, min(i + size, len(samples))) for i in range(0, len(samples), size)]


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
    if speech.exit_layer is None:
        speech.exit_layer = calibrate_exit_layer(heard, calibration_ids(speech))[0]
    return speech.exit_layer


def calibration_ids(speech: SpeechModel) -> list[int]:
    """A decoder prompt and the package's sample article (256 tokens): the text drafters are calibrated on."""
    from importlib.resources import files

    text = files("assistgen").joinpath("data/article.txt").read_text()
    return heard_prompt(speech) + list(speech.tokenizer(text, add_special_tokens=False)["input_ids"])[:252]


def heard_prompt(speech: SpeechModel) -> list[int]:
    return speech.decoder_prompt("en" if speech.multilingual else None)


def expected_tokens(window: np.ndarray) -> int:
    """The tokens a window's transcript is expected to take (`SPOKEN_TOKENS_PER_S`), its end token included."""
    return int(len(window) / SAMPLE_RATE * SPOKEN_TOKENS_PER_S) + 1


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
    heard = HeardModel(copy, target.encoded, target.begin, draft_vocabulary=DRAFT_VOCABULARY)
    if scheme not in speech.agreement:  # once per model: on its first input, over the calibration text
        ids, begin = calibration_ids(speech), len(heard_prompt(speech))
        speech.agreement[scheme] = agreement(replace(target, begin=begin), replace(heard, begin=begin), ids,
                                             positions=len(ids) - begin)
        pass_costs(heard)  # its passes timed once (kept on disk): the policy's prior for its cost per token
    return AssistantDrafter(heard, target, acceptance_prior=speech.agreement[scheme])


def assistant_drafter(target: HeardModel, assistant: SpeechModel, window: np.ndarray, language: str | None):
    """The assistant Whisper on the same window (its copy for drafting, when `assistant` is one): same tokenizer, it
    drafts token ids directly; another, in universal mode from its own decoder prompt. Its decoder's passes are timed
    on its first window (`policy.costs.pass_costs`), so that the policy prices it by time, not by weight bytes. Where
    both extract the same features (Whisper's 80 mel bins), it reads the target's."""
    own_language = language if assistant.multilingual else None
    prompt = assistant.decoder_prompt(own_language)
    frames = -(-len(window) // HOP) + TAIL_FRAMES  # the audio's own frames, and a second of the padding after it
    same = assistant.extractor.to_dict() == target.speech.extractor.to_dict()
    features = target.encoded.features.to(assistant.device, assistant.dtype) if same else assistant.features(window)
    heard = assistant.listen(features, begin=len(prompt), draft_vocabulary=DRAFT_VOCABULARY,
                             lazy=True, frames=frames)  # its encoder runs only if the policy lets it draft
    if assistant.costs is None:  # its passes timed once per model (kept on disk; on this first window, the encoder
        pass_costs(heard)  # runs for it): the policy's prior for its cost per token
    if same_tokenizer(target, heard):
        return AssistantDrafter(heard, target)
    return UniversalDrafter(heard, target, prefix=prompt)


def transcribe(model, audio, assistant=None, language: str | None = None, prompt: str | None = None,
               task: str = "transcribe", lookup: bool = False, early_exit: bool | int = False, ngram_cache=False,
               self_draft: bool = False, draft_weights: str | None = "auto", schedule=None, temperature: float = 0.0,
               seed: int | None = None, max_new_tokens: int | None = None, max_seconds: float | None = None,
               logprobs: bool = False, cancelled: Callable[[], bool] | None = None) -> Transcription:
    """Transcribe `audio` (a path, bytes, a binary file, or 16 kHz mono samples) with `model` (see the contract);
    `self_draft`: the target's own decoder in quantized weights drafts; `draft_weights` ("auto", "int8", "int4",
    "float"): the weights of a drafting model (the assistant, the self-draft); `logprobs`: keep each window's token
    log-probabilities (`Window.logprobs`); `cancelled`: asked before each window and after each decoding step; once
    it answers True the transcription stops and raises `config.Cancelled` (a server's client gone)."""
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
    previous = list(speech.tokenizer(" " + prompt.strip(), add_special_tokens=False)["input_ids"]) \
        if prompt and prompt.strip() else None
    previous = previous[-(speech.context_length // 2 - 1):] if previous else None  # (Whisper keeps the prompt's end)
    out = Transcription("", language, len(samples) / SAMPLE_RATE)
    texts = []
    for start, end in windows(samples):
        if cancelled is not None and cancelled():
            raise Cancelled("The transcription was cancelled by its caller.")
        window = samples[start:end]
        heard = speech.listen(speech.features(window), begin=0)  # the encoder runs here, once per window
        if speech.multilingual and language is None:
            language = detect_language(speech, heard)
            out.language = language
        ids = speech.decoder_prompt(language, task, previous)
        heard = replace(heard, begin=len(ids))  # the same input: begin suppression after this decoder prompt
        room = heard.context_length - len(ids)
        if max_new_tokens is not None and not 1 <= max_new_tokens <= room:
            raise ConfigError(f"max_new_tokens must be in 1..{room} for this decoder prompt, got {max_new_tokens}.")
        drafter = assistant_drafter(heard, helper, window, language) if helper is not None else \
            self_drafter(heard, scheme) if self_draft else None
        exit_n = exit_layers(speech, heard, early_exit) if early_exit else False
        result = generate(heard, ids, assistant=drafter, lookup=lookup, early_exit=exit_n, ngram_cache=ngram_cache,
                          schedule=schedule, max_new_tokens=max_new_tokens or room, temperature=temperature,
                          expected_new_tokens=expected_tokens(window), cancelled=cancelled,
                          seed=seed, logprobs=0 if logprobs else None)
        text = speech.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        kept = [lp.logprob for lp in result.logprobs] if logprobs else None
        out.windows.append(Window(start / SAMPLE_RATE, end / SAMPLE_RATE, ids, result.token_ids, text, result.stats,
                                  kept))
        texts.append(text.strip())
        spoken = [t for t in result.token_ids if t < min(heard.eos_token_ids)]  # text tokens only
        previous = spoken[-(heard.context_length // 2 - 1):] or previous  # the next window's earlier context
    out.text = " ".join(t for t in texts if t)
    return out
