"""POST /v1/audio/transcriptions: OpenAI's transcription endpoint over the served speech model (`SpeechService`).

Contract: the request is a multipart form as OpenAI defines it: `file` (the audio, required), `model` (required: the
served speech model's name, or "whisper-1"), `language` (ISO-639-1), `prompt`, `response_format` (json, text,
verbose_json, srt or vtt), `temperature` (0..1; 0 is greedy) and `timestamp_granularities[]` ("segment", with
verbose_json only, as OpenAI takes it). The fields OpenAI defines that this server does not do (word timestamps,
`include[]`, `chunking_strategy`, the diarization speakers, `stream` unless false) and any other field are a 400
naming them: a field accepted and ignored would be a silent wrong answer. A body or file over
`ServerSettings.max_upload_bytes` is a 413 naming the limit; an empty file, one that is not audio, and audio over
`max_audio_seconds` are 400s with `speech.audio`'s message; a server without a speech model answers 404 saying how to
start one. Everything is checked before the transcription queues, and the audio is decoded on a worker thread, never
on the event loop. verbose_json, srt and vtt are decoded with timestamps (`transcribe(timestamps=True)`), json and
text without them where the audio fits one 30 s window (longer audio always has them), as transformers decodes.
Replies: json `{"text", "usage", "assistgen"}`; text: the transcript as text/plain; srt and vtt: the segments as
cues; verbose_json: OpenAI's `{"task", "language" (its English name), "duration", "text", "segments"}`, the segments
between the model's timestamps (`avg_logprob` from the target's log-probabilities, `compression_ratio` as Whisper
computes it, `no_speech_prob` null: not computed), with `usage` and `assistgen`: the speculation statistics
(`statistics`, the names `assistgen transcribe --json` prints). A client that goes away while its transcription
waits or runs stops it (after its current decoding step), counted as status 499. A full queue is a 429. Every answer
is counted by status in the metrics, and each transcription's figures (`metrics.TranscriptionMetrics`);
`openapi_form` is the form in the app's OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from assistgen.config import Cancelled, ConfigError
from assistgen.serving.app_state import AppState, state_of
from assistgen.serving.speech_service import ALIASES, Busy, SpeechService
from assistgen.serving.wire.errors import APIError
from assistgen.speech.audio import FORMATS as AUDIO_FORMATS
from assistgen.speech.audio import AudioError, read_audio
from assistgen.speech.results import Transcription
from assistgen.stats import Stats

TAKEN = ("file", "model", "language", "prompt", "response_format", "temperature")
GRANULARITIES = ("timestamp_granularities[]", "timestamp_granularities")  # each may be given once per value
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMED = ("verbose_json", "srt", "vtt")  # the formats decoded with timestamps, into segments
NO_SPEAKERS = "speakers are not told apart (no diarization): leave it out."
# Fields OpenAI defines that this endpoint does not do: refused, with why (`stream` is taken as "false").
REFUSED = {
    "include[]": "token log-probabilities are not returned: leave it out.",
    "include": "token log-probabilities are not returned: leave it out.",
    "chunking_strategy": "the audio is decoded in 30 s windows that move on at the model's own timestamps, with no "
                         "separate voice detection: leave it out.",
    "known_speaker_names[]": NO_SPEAKERS, "known_speaker_references[]": NO_SPEAKERS,
    "stream": "streamed transcriptions are not supported: leave it out, or give false.",
}
FORM_ROOM = 2**20  # what the form may hold besides the file: the other fields and the multipart framing
FIELD_BYTES = 256 * 2**10  # the largest field besides the file (a long prompt)
CLIENT_GONE = 499  # the status a transcription whose client went away is counted under (nginx's)
DISCONNECT_POLL_S = 0.25  # how often a waiting transcription checks that its client is still there


def openapi_form(speech: SpeechService | None) -> dict:
    """The endpoint's request body for the app's OpenAPI schema (`model`: the served names, when there is one)."""
    model = {"type": "string"} if speech is None else {"type": "string", "enum": [speech.name, *ALIASES]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "model"], "properties": {
            "file": {"type": "string", "format": "binary"}, "model": model, "language": {"type": "string"},
            "prompt": {"type": "string"}, "response_format": {"type": "string", "enum": list(FORMATS)},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment"]}}}}}}}}


@dataclass(frozen=True)
class Asked:
    """A checked transcription request."""

    file: UploadFile
    language: str | None  # the code decoded in (None: detected, or an English-only model)
    prompt: str | None
    response_format: str
    temperature: float

    @property
    def timestamps(self) -> bool:
        return self.response_format in TIMED


async def transcriptions(http: HTTPRequest) -> Response:
    """The endpoint: every answer, refusals included, counted by status."""
    state = state_of(http)
    try:
        reply = await transcription(state, http)
    except APIError as e:
        state.metrics.transcriptions.answered(e.status)
        raise
    except Exception:
        state.metrics.transcriptions.answered(500)
        raise
    state.metrics.transcriptions.answered(reply.status_code)
    return reply


async def transcription(state: AppState, http: HTTPRequest) -> Response:
    service = served(state)
    if state.closing:
        raise APIError(503, "The server is shutting down.", "service_unavailable")
    settings = state.settings
    form = await read_form(http, settings.max_upload_bytes)
    try:
        asked = checked(form, service, settings.model_name)
        data = await file_bytes(asked.file, settings.max_upload_bytes)
    finally:
        await form.close()
    name = f"file ({asked.file.filename})" if asked.file.filename else "file"
    try:
        samples = await asyncio.to_thread(read_audio, data, settings.max_audio_seconds, name)
    except AudioError as e:
        raise APIError(400, str(e), param="file") from e
    except Exception as e:  # (a decoder's own error on odd data: still the upload's problem, not the server's)
        raise APIError(400, f"{name} cannot be decoded ({type(e).__name__}: {e}): send an audio file "
                       f"({AUDIO_FORMATS}).", param="file") from e
    started = time.perf_counter()
    stop = threading.Event()
    watcher = asyncio.create_task(stop_when_gone(http, stop))
    try:
        result = await service.run(samples, asked.language, asked.prompt, asked.temperature, stop,
                                   timestamps=asked.timestamps)
    except Busy as e:
        raise APIError(429, str(e), "rate_limit_error") from e
    except ConfigError as e:
        raise APIError(400, str(e)) from e
    except Cancelled as e:  # (nobody reads this answer; 499, as nginx logs a client that closed its request)
        raise APIError(CLIENT_GONE, "The client went away: its transcription was stopped.") from e
    finally:
        watcher.cancel()
    state.metrics.transcriptions.transcribed(result.stats, result.duration_s, time.perf_counter() - started)
    return reply(result, asked, service)


async def stop_when_gone(http: HTTPRequest, stop: threading.Event) -> None:
    """Set `stop` once the client has gone (its transcription then ends after its current step)."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    stop.set()


def served(state: AppState) -> SpeechService:
    if state.speech is None:
        raise APIError(404, "This server serves no speech model: start it with `assistgen serve --speech-model "
                       "whisper-base` (and e.g. `--speech-assistant whisper-tiny-en` to draft) to transcribe.",
                       "not_found_error", "model", "model_not_found")
    return state.speech


# --- the form -----------------------------------------------------------------------------------------------


async def read_form(http: HTTPRequest, limit: int) -> FormData:
    """The multipart form, read through `capped` (a body over the limit is a 413 before it is all read)."""
    kind = http.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "multipart/form-data":
        raise APIError(400, "Send the audio as multipart/form-data, with a `file` part and a `model` field (as "
                       f"OpenAI's clients do), not {kind or 'a body without a content type'}.", param="file")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_ROOM:
        raise too_large(int(declared), limit, "the request")
    parser = MultiPartParser(http.headers, capped(http.stream(), limit + FORM_ROOM, limit), max_files=1,
                             max_fields=len(TAKEN) + len(REFUSED) + 2 * len(GRANULARITIES), max_part_size=FIELD_BYTES)
    try:
        return await parser.parse()
    except MultiPartException as e:
        raise APIError(400, f"The multipart form cannot be read: {e.message}") from e
    except ClientDisconnect as e:  # (nobody reads this answer: it keeps a client gone out of the 5xx count)
        raise APIError(400, "The upload ended before its form was complete.") from e


async def capped(stream: AsyncIterator[bytes], most: int, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks; past `most` bytes, a 413 naming the file's `limit`."""
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen > most:
            raise too_large(seen, limit, "the request", at_least=True)
        yield chunk


def too_large(size: int, limit: int, what: str, at_least: bool = False) -> APIError:
    return APIError(413, f"{what} is {'more than ' if at_least else ''}{size:,} bytes; this server takes audio files "
                    f"of at most {limit:,} bytes ({limit / 2**20:.3g} MiB): send a shorter or more compressed "
                    "recording, or split it.", param="file")


def checked(form: FormData, service: SpeechService, text_model: str) -> Asked:
    """The request's fields, each checked (see the module's contract); the first problem is a 4xx naming it."""
    refuse_fields(form)
    model = text_field(form, "model")
    if model is None:
        raise APIError(400, f"model: give the speech model's name, {service.name} (or whisper-1).", param="model")
    if not service.answers_to(model):
        what = " is this server's text model" if model == text_model else " does not exist"
        raise APIError(404, f"The model '{model}'{what}: this server transcribes with '{service.name}' (also "
                       f"called {', '.join(ALIASES)}).", "not_found_error", "model", "model_not_found")
    response_format = text_field(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise APIError(400, f"response_format: give one of {', '.join(FORMATS)}, not {response_format!r}.",
                       param="response_format")
    check_granularities(form, response_format)
    try:
        language = service.checked_language(text_field(form, "language"))
    except ConfigError as e:
        raise APIError(400, f"language: {e}", param="language") from e
    upload = form.get("file")
    if upload is None:
        raise APIError(400, "file: upload the audio to transcribe in a `file` part.", param="file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "file: send the audio as a file part (with a filename), as OpenAI's clients do, not as "
                       "a text field.", param="file")
    return Asked(upload, language, text_field(form, "prompt"), response_format, temperature_of(form))


def check_granularities(form: FormData, response_format: str) -> None:
    """`timestamp_granularities[]`: "segment" (verbose_json's segments, always given) and only with verbose_json, as
    OpenAI takes it; "word" is a 400 (no word timestamps here)."""
    for name in GRANULARITIES:
        for value in form.getlist(name):
            if not isinstance(value, str) or value not in ("segment", "word"):
                raise APIError(400, f"{name}: give segment, not {value!r}.", param=name)
            if response_format != "verbose_json":
                raise APIError(400, f"{name} needs response_format=verbose_json (got {response_format}).", param=name)
            if value == "word":
                raise APIError(400, f"{name}: word timestamps are not computed (segments are): give segment, or "
                               "leave it out.", param=name)


def refuse_fields(form: FormData) -> None:
    """A 400 naming the first field given twice, refused (REFUSED) or unknown."""
    names = [name for name, _ in form.multi_items()]
    for name, value in form.multi_items():
        if name in GRANULARITIES:
            if form.getlist(name).count(value) > 1:
                raise APIError(400, f"{name} gives {value!r} more than once: give each value once.", param=name)
        elif name in TAKEN:
            if names.count(name) > 1:
                raise APIError(400, f"{name} is given {names.count(name)} times: give it once.", param=name)
        elif name == "stream" and isinstance(value, str) and value.strip().lower() == "false":
            continue
        elif name in REFUSED:
            raise APIError(400, f"{name}: {REFUSED[name]}", param=name)
        else:
            raise APIError(400, f"{name} is not a field of this endpoint, which takes "
                           f"{', '.join((*TAKEN, GRANULARITIES[0]))}.",
                           param=name)


def text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if isinstance(value, UploadFile):
        raise APIError(400, f"{name}: give it as a text field, not a file.", param=name)
    return value


def temperature_of(form: FormData) -> float:
    text = text_field(form, "temperature")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise APIError(400, f"temperature: give a number from 0 (greedy) to 1, not {text!r}.", param="temperature")
    return value


async def file_bytes(upload: UploadFile, limit: int) -> bytes:
    if upload.size is not None and upload.size > limit:
        raise too_large(upload.size, limit, "file")
    return await upload.read()


# --- the reply ----------------------------------------------------------------------------------------------


def reply(result: Transcription, asked: Asked, service: SpeechService) -> Response:
    if asked.response_format == "text":
        return PlainTextResponse(result.text)
    if asked.response_format in ("srt", "vtt"):
        return PlainTextResponse(subtitles(result, asked.response_format))
    usage = {"type": "duration", "seconds": round(result.duration_s, 3)}
    if asked.response_format == "json":
        return JSONResponse({"text": result.text, "usage": usage, "assistgen": statistics(result.stats)})
    return JSONResponse({"task": "transcribe", "language": service.language_name(result.language),
                         "duration": round(result.duration_s, 3), "text": result.text,
                         "segments": segments(result, asked.temperature, service.end_token), "usage": usage,
                         "assistgen": statistics(result.stats)})


def segments(result: Transcription, temperature: float, end_token: int) -> list[dict]:
    """verbose_json's segments: the model's own, between its timestamps (`seek`: the first mel frame of the window
    each was decoded in; its tokens: the text's, timestamps left out). As Whisper gives them, `avg_logprob` and
    `compression_ratio` are their window's (its decoding's: every token it generated, the end token included)."""
    out = []
    for window in result.windows:
        ratio = compression_ratio(window.text)
        for segment in window.segments:
            out.append({"id": len(out), "seek": window.seek, "start": round(segment.start_s, 3),
                        "end": round(segment.end_s, 3), "text": segment.text,
                        "tokens": [t for t in segment.token_ids if t < end_token], "temperature": temperature,
                        "avg_logprob": window.avg_logprob, "compression_ratio": ratio, "no_speech_prob": None})
    return out


def subtitles(result: Transcription, kind: str) -> str:
    """The segments as SubRip (srt) or WebVTT (vtt) cues."""
    separator = "," if kind == "srt" else "."

    def clock(seconds: float) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"

    cues = [f"{clock(s.start_s)} --> {clock(s.end_s)}\n{s.text.strip().replace('-->', '->')}\n"
            for s in result.segments if s.text.strip()]  # (a segment without text is no cue)
    if kind == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)


def compression_ratio(text: str) -> float:
    """Whisper's: the text's UTF-8 bytes over their zlib-compressed bytes (high: a repeating, likely looping text)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def statistics(stats: Stats) -> dict:
    """The transcription's speculation figures (all windows together)."""
    return {"steps": stats.steps, "draft_steps": stats.draft_steps, "drafted": stats.drafted_tokens,
            "accepted": stats.accepted_tokens, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length, "new_tokens": stats.new_tokens,
            "decoder_s": round(stats.total_s, 4), "mode": stats.mode, "exact": stats.exact}
