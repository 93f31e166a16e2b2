"""The speech model a server transcribes with (`SpeechService`): the name clients give, the drafters every
transcription uses, and the one thread transcriptions run on, one at a time, off the event loop.

Contract: `SpeechService(name, model, assistant=, lookup=, early_exit=, self_draft=, draft_weights=, schedule=)`
(refused at construction, with a `ConfigError`, where the drafters or their weights cannot run) answers to its name and
to OpenAI's default "whisper-1" (`answers_to`). `checked_language(code)` is the ISO-639-1 code the model decodes in
(None: detected, or an English-only model) or a `ConfigError` naming the fix; `language_name` is a code's English name
("english"), as OpenAI's verbose replies give it. `await run(samples, language, prompt, temperature, stop, timestamps)`
queues a transcription on the service's own worker thread (in order, one at a time; more than `max_waiting` behind the
one running raise `Busy`) and returns its `speech.results.Transcription`, with the target's log-probabilities.
Setting its `stop` event (a client gone), or leaving the await early, cancels it: one not yet started never starts, one
running stops after its current decoding step (`config.Cancelled` is raised to a caller still waiting). `close()` lets
queued transcriptions finish and stops the thread. Nothing here speaks HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from assistgen.backends.torch.speech import SpeechModel
from assistgen.config import ConfigError
from assistgen.spec.steps import Schedule
from assistgen.speech.drafting import drafting_weights
from assistgen.speech.languages import check_language
from assistgen.speech.results import Transcription
from assistgen.speech.transcribe import transcribe

ALIASES = ("whisper-1",)  # names OpenAI's clients send by default, answered by the served speech model


class Busy(Exception):
    """More transcriptions wait than the service queues."""


@dataclass(eq=False)
class SpeechService:
    name: str  # what clients give as "model" (besides ALIASES)
    model: SpeechModel
    assistant: SpeechModel | None = None  # an assistant Whisper (another tokenizer: universal mode)
    lookup: bool = False  # prompt lookup over the transcript so far
    early_exit: bool | int = False  # the target's first decoder layers draft (True: calibrated)
    self_draft: bool = False  # the target's own decoder in quantized weights drafts
    draft_weights: str | None = "auto"  # a drafting model's weights (`speech.transcribe`)
    schedule: Schedule | None = None  # None: transcribe's default (cost-aware adaptive)
    max_waiting: int = 8  # transcriptions queued behind the running one; more are refused (`Busy`)
    pending: int = field(default=0, init=False)  # queued or running (read and written on the event loop only)
    worker: ThreadPoolExecutor = field(init=False)

    def __post_init__(self):
        if sum(map(bool, (self.assistant is not None, self.early_exit, self.self_draft))) > 1:
            raise ConfigError("Choose one speech drafter: a speech assistant, speech early exit or speech self-draft.")
        scheme = drafting_weights(self.assistant or self.model, self.draft_weights)
        if self.self_draft and scheme is None:
            raise ConfigError("The speech self-draft needs quantized drafting weights: leave --speech-draft-weights at "
                              "auto (int8 on the CPU), or give int8 or int4.")
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="transcribe")

    def answers_to(self, name: str) -> bool:
        return name == self.name or name in ALIASES

    def checked_language(self, language: str | None) -> str | None:
        return check_language(self.model, language)

    def language_name(self, code: str | None) -> str:
        """The English name of the language decoded in (an English-only model's: "english")."""
        return "english" if code is None else self.model.language_names.get(code, code)

    @property
    def end_token(self) -> int:
        """The end-of-transcript id; every id from it on is special (languages, tasks, timestamps)."""
        return self.model.end_token

    async def run(self, samples: np.ndarray, language: str | None, prompt: str | None, temperature: float,
                  stop: threading.Event | None = None, timestamps: bool = False) -> Transcription:
        if self.pending > self.max_waiting:
            raise Busy(f"{self.pending} transcriptions are queued or running on this server: try again shortly.")
        stop = stop if stop is not None else threading.Event()
        self.pending += 1
        try:
            future = self.worker.submit(self.transcribe, samples, language, prompt, temperature, stop, timestamps)
            try:
                return await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                stop.set()
                raise
        finally:
            self.pending -= 1

    def transcribe(self, samples: np.ndarray, language: str | None, prompt: str | None, temperature: float,
                   stop: threading.Event | None = None, timestamps: bool = False) -> Transcription:
        return transcribe(self.model, samples, assistant=self.assistant, language=language, prompt=prompt,
                          lookup=self.lookup, early_exit=self.early_exit, self_draft=self.self_draft,
                          draft_weights=self.draft_weights, schedule=self.schedule, temperature=temperature,
                          logprobs=True, timestamps=timestamps, cancelled=None if stop is None else stop.is_set)

    def close(self) -> None:
        self.worker.shutdown(wait=True)
