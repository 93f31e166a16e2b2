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

from assistgen.api.names import resolved_once
from assistgen.backends.embedded import SPEECH
from assistgen.backends.torch.speech import SAMPLE_RATE, SpeechModel, load_speech
from assistgen.config import ConfigError, check_cancelled
from assistgen.speech.audio import read_audio
from assistgen.speech.drafting import drafting_weights
from assistgen.speech.languages import check_language
from assistgen.speech.longform import sequential
from assistgen.speech.results import Transcription
from assistgen.speech.windows import Audio, Decoding

TASKS = ("transcribe", "translate")


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



