"""One 30 s window through the encoder (once) and the generation loop.

Contract: `Audio` holds the features the models read (the target's: one window padded to 30 s, or the whole audio's
for long-form; an assistant's where it extracts others, computed on first use), each computed once per
transcription; `Decoding` is one transcription's settings, and `Decoding.window` decodes the window from a frame:
the encoder once, the decoder prompt, the model drafter asked for (`speech.drafting`), then `api.generate` on the
decoder conditioned on it, priced against the transcript's expected length (`expected_tokens`). A caller's
`cancelled` stops it with `Cancelled`; a `max_new_tokens` beyond the decoder's room is a `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from assistgen.api.generation import generate
from assistgen.backends.torch.speech import SAMPLE_RATE, WINDOW_S, SpeechModel
from assistgen.config import Cancelled, ConfigError
from assistgen.speech.drafting import assistant_drafter, exit_layers, self_drafter
from assistgen.speech.languages import detect_language
from assistgen.speech.results import Segment, Window

HOP = 160  # samples per mel frame
FRAMES_PER_S = SAMPLE_RATE / HOP
# The tokens a second of speech is expected to give (a brisk speaker: about 3 words a second, 1.3 tokens a word): the
# length the policy prices a drafter's one-off costs against (an assistant's encoder), never a limit.
SPOKEN_TOKENS_PER_S = 4.0


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



def expected_tokens(frames: int) -> int:
    """The tokens a window's transcript is expected to take (`SPOKEN_TOKENS_PER_S`) from the frames of audio it
    holds, its end token included."""
    return int(frames / FRAMES_PER_S * SPOKEN_TOKENS_PER_S) + 1



