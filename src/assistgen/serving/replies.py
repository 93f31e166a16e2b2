"""Answers in OpenAI's shapes from finished or running jobs: `respond` (one JSON body, or server-sent events with
`stream: true`; the log-probabilities in `wire.chat`'s and `wire.completions`' shapes), the chat message with its
tool calls (`tool_message`, read from the text in the call syntax of `chat.parser`; `CallStream` while streaming:
text until a call starts, then the call's arguments as they come), and `sse` (one event)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from assistgen.chat.parser import CallParser, CallStart, Content, parse_calls
from assistgen.core.state import Chunk
from assistgen.serving.app_state import AppState
from assistgen.serving.jobs import Job, cancel_when_gone, failure, merged, ranked, reply_metrics, usage
from assistgen.serving.metrics import spec_decode_metrics
from assistgen.serving.wire.chat import chat_logprobs
from assistgen.serving.wire.common import FINISH_REASONS, Sampling, new_id
from assistgen.serving.wire.completions import completion_logprobs
from assistgen.serving.wire.errors import error_body


async def respond(state: AppState, body: Sampling, jobs: list[Job], chat: bool, http: HTTPRequest,
                  echoes: list[str] | None = None) -> Response:
    """The reply to `jobs` (`jobs.submit`'s: each prompt's candidates in turn); `echoes`: each prompt's text, put
    before each of its choices."""
    reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": reply_id, "created": int(time.time()), "model": state.settings.model_name}
    n, candidates = body.choices()
    if echoes is not None:  # (one per job)
        echoes = [echoes[i // candidates] for i in range(len(jobs))]
    if body.stream:  # (never with candidates > n: `CompletionRequest.choices`)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(events(state, jobs, head, chat, include_usage, echoes),
                                 media_type="text/event-stream")
    return await reply(state, jobs, head, chat, http, echoes, (n, candidates), body.asked_logprobs() is not None)


async def finished(state: AppState, jobs: list[Job], http: HTTPRequest) -> None:
    """Wait for every job to finish (a client gone meanwhile cancels them); a failed one raises its 500."""
    watcher = asyncio.create_task(cancel_when_gone(jobs, http))
    try:
        async for _ in merged(state, jobs):
            pass
    finally:
        watcher.cancel()
    for job in jobs:
        error = failure(job)
        if error is not None:
            raise error


async def reply(state: AppState, jobs: list[Job], head: dict, chat: bool, http: HTTPRequest,
                echoes: list[str] | None, choices_of: tuple[int, int], asked: bool) -> JSONResponse:
    """One JSON body: per prompt, the n best of its candidates (`choices_of`: n, candidates; `jobs.ranked`), with
    their logprobs when `asked`; usage and metrics over every job."""
    await finished(state, jobs, http)
    tokenizer = state.engine.target.tokenizer
    choices = []
    for index, i in enumerate(ranked(jobs, *choices_of)):
        job = jobs[i]
        text = (echoes[i] if echoes else "") + "".join(job.texts)
        choice = {"index": index, "finish_reason": FINISH_REASONS.get(job.last.finish_reason)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if job.calls is not None:
                choice["message"], choice["finish_reason"] = tool_message(job, choice["finish_reason"])
            choice["logprobs"] = chat_logprobs(tokenizer, job.logprobs) if asked else None
        else:
            echoed = (job.prompt_ids, job.prompt_logprobs) if echoes and asked else None
            choice.update(text=text, logprobs=completion_logprobs(tokenizer, job.logprobs, 0, echoed)
                          if asked else None)
        choices.append(choice)
    return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": usage(jobs), "metrics": reply_metrics(jobs)})


async def events(state: AppState, jobs: list[Job], head: dict, chat: bool, include_usage: bool,
                 echoes: list[str] | None) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    tokenizer = state.engine.target.tokenizer
    offsets = [0] * len(jobs)  # each choice's text so far (completions' text_offset)
    started = [False] * len(jobs)
    readers = [CallStream(job) if job.calls is not None else None for job in jobs]

    def event(i: int, text: str, logprobs: dict | None, finish_reason: str | None = None, delta: dict | None = None,
              **extra) -> str:
        offsets[i] += len(text)
        choice = {"index": i, "finish_reason": finish_reason, "logprobs": logprobs}
        if chat:
            choice["delta"] = {"content": text} if delta is None else delta
        else:
            choice["text"] = text
        return sse({**head, "object": kind, "choices": [choice], **extra})

    def logprobs_of(i: int, chunk: Chunk, echoed=None) -> dict | None:
        if chunk.logprobs is None and echoed is None:
            return None
        if chat:
            return chat_logprobs(tokenizer, chunk.logprobs)
        return completion_logprobs(tokenizer, chunk.logprobs or [], offsets[i], echoed)

    if chat:  # (each choice's role first)
        for i in range(len(jobs)):
            yield sse({**head, "object": kind, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]})
    async for i, chunk in merged(state, jobs):
        if echoes and not started[i]:  # the prompt's text (and its logprobs) before the choice's first tokens
            echoed = (jobs[i].prompt_ids, chunk.prompt_logprobs) if chunk.prompt_logprobs is not None else None
            yield event(i, echoes[i], logprobs_of(i, Chunk([], ""), echoed) if echoed else None)
        started[i] = True
        if chunk.finish_reason == "error":
            yield sse(error_body(failure(jobs[i]).message, "server_error"))
        elif jobs[i].calls is not None:
            for delta, finish in readers[i].read(chunk):
                yield event(i, "", logprobs_of(i, chunk) if delta is readers[i].first else None, finish, delta,
                            **({"metrics": spec_decode_metrics(chunk.stats)} if finish else {}))
        elif chunk.finish_reason is not None:
            yield event(i, chunk.text, logprobs_of(i, chunk), FINISH_REASONS.get(chunk.finish_reason),
                        metrics=spec_decode_metrics(chunk.stats))
        elif chunk.text or chunk.logprobs:
            yield event(i, chunk.text, logprobs_of(i, chunk))
    if include_usage:
        yield sse({**head, "object": kind, "choices": [], "usage": usage(jobs)})
    yield "data: [DONE]\n\n"


# --- tool calls ---------------------------------------------------------------------------------------------


def tool_message(job: Job, finish_reason: str | None) -> tuple[dict, str | None]:
    """A finished chat choice's message read in its tool-call syntax, and its finish reason ("tool_calls" where
    it ended after calling)."""
    parsed = parse_calls(job.calls, job.texts)
    message = {"role": "assistant", "content": parsed.content.strip() or None}
    if parsed.calls:
        message["tool_calls"] = [{"id": new_id("call"), "type": "function", "function": {"name": n, "arguments": a}}
                                 for n, a in parsed.calls]
        finish_reason = chat_finish(finish_reason, True, parsed.unfinished)
    return message, finish_reason


def chat_finish(reason: str | None, called: bool, unfinished: bool) -> str | None:
    """A chat choice's finish reason: "tool_calls" where it stopped after calling (not inside a call: a stop
    string that cut a call leaves "stop")."""
    return "tool_calls" if called and reason == "stop" and not unfinished else reason


class CallStream:
    """A streamed chat choice's chunks as OpenAI's deltas: content, then per call its index, id and name, then
    fragments of its arguments, however many tokens a step accepted; the last delta carries the finish reason."""

    def __init__(self, job: Job):
        self.parser = CallParser(job.calls)
        self.called = False
        self.first: dict | None = None  # the first delta of the chunk being read (it carries the chunk's logprobs)

    def read(self, chunk: Chunk) -> list[tuple[dict, str | None]]:
        """(delta, finish reason) pairs for one chunk."""
        events = self.parser.read(chunk.text, last=chunk.finish_reason is not None)
        out = [(self.delta(e), None) for e in events]
        if chunk.finish_reason is not None:
            finish = FINISH_REASONS.get(chunk.finish_reason)
            out.append(({}, chat_finish(finish, self.called, self.parser.ended_in_call)))
        elif not out and chunk.logprobs:
            out = [({"content": ""}, None)]
        self.first = out[0][0] if out else None
        return out

    def delta(self, event) -> dict:
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.called = True
            return {"tool_calls": [{"index": event.index, "id": new_id("call"), "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
