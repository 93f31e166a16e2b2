"""`assistgen serve`'s app: an OpenAI-compatible HTTP server over a `BatchEngine`.

Contract: `create_app(engine, settings, make_drafter)` builds a FastAPI app (no model loading: tests pass
a loaded model's engine) serving `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `POST /v1/responses` (the Responses API, `responses.py`; tool calls on
chat and responses: `core.tools`), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` and `GET /metrics`
(Prometheus text from the app's own registry, `metrics.py`). The handlers are module-level functions over the
app's `AppState` (engine, settings, metrics, whether it is closing). Every request is
checked in full before it reaches the engine (`protocol.py`): each field OpenAI's API defines is honoured or,
where this server does not do it, refused unless left at its "off" value; a prompt plus the new tokens asked
for must fit the context. A completion request with several prompts runs them as separate engine requests,
batched, one choice each (`index` in order, usage summed); `echo` puts the prompt's text before each choice.
A client mistake answers 4xx with OpenAI's error body (400 bad input, 404 unknown model, 429 queue full, 503
shutting down), anything else 500 with the same body. A client that goes away mid-generation (streamed or not)
has its engine requests cancelled. Responses carry, besides OpenAI's fields, `metrics.speculative_decoding`
(`metrics.spec_decode_metrics`, added up over the choices). The n-gram
cache across requests is off unless `ServerSettings.ngram_cache` (suffix drafting's history: `suffix`); then a
request draws on (and feeds) the cache of its API key (the bearer token; no key: a cache of its own), never another's.
`serve(engine, settings, host, port)` starts the engine and runs uvicorn until SIGINT/SIGTERM, then lets
running requests finish (`ServerSettings.shutdown_timeout`) and returns 0 (`assistgen serve`, in
`cli/main.py`, loads the model(s) and builds the engine).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from assistgen.api import encode_chat, encode_prompt
from assistgen.config import ConfigError, Structure
from assistgen.core.engine import check_prompt, context_limit
from assistgen.core.logprobs import TokenLogprob
from assistgen.core.state import Chunk
from assistgen.core.tools import (
    CallParser,
    CallStart,
    CallSyntax,
    Content,
    ToolSchemaError,
    call_structure,
    call_syntax,
    parse_calls,
)
from assistgen.drafters.ngram import NGramCache
from assistgen.policy.costs import costs_state
from assistgen.serving.batching import BatchEngine, QueueFull, Request
from assistgen.serving.metrics import Metrics, spec_decode_metrics
from assistgen.serving.protocol import (
    FINISH_REASONS,
    APIError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    ToolPlan,
    completion_prompts,
    error_body,
    generation_config,
    install_error_handlers,
    message_dicts,
    new_id,
    refuse_unsupported,
    tool_plan,
)
from assistgen.serving.responses import RESPONSES_REFUSED, Reply, ResponsesRequest
from assistgen.spec.drafts import Drafter
from assistgen.stats import Stats

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients give as "model" (requests naming another get 404)
    ngram_cache: bool = False  # an n-gram cache across requests, one per API key
    suffix: bool = False  # suffix drafting over the request and its API key's earlier requests
    share_prefix_cache: bool = False  # kept prefixes serve every request, whatever its key (default: its key's only)
    max_tokens_limit: int | None = None  # the most new tokens a request may ask for (None: no limit)
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown


@dataclass
class AppState:
    """What the handlers share: the engine and its model's context, the settings, the metrics."""

    engine: BatchEngine
    settings: ServerSettings
    make_drafter: Callable[..., Drafter] | None
    context: int  # the longest sequence the engine's target (and drafter) can take
    metrics: Metrics
    closing: bool = False


def state_of(http: HTTPRequest) -> AppState:
    return http.app.state.assistgen


# --- one request through the engine -------------------------------------------------------------------------


@dataclass
class Job:
    """A request as the server follows it: the engine's handle, the queue its chunks arrive on, timings."""

    prompt_ids: list[int]
    queue: asyncio.Queue
    started: float
    request: Request | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # (when asked for)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (when asked for, with the first chunk)
    last: Chunk | None = None
    calls: CallSyntax | None = None  # the tool-call syntax its text is read in (None: no tools)

    @property
    def usage(self) -> dict:
        n = len(self.prompt_ids)
        stats = self.last.stats if self.last is not None else None
        return {"prompt_tokens": n, "completion_tokens": self.completion_tokens,
                "total_tokens": n + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats is not None else 0}}


def chunk_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Chunk], None]:
    """The engine's on_chunk: hands (chunk, arrival time) to the event loop's queue from the engine thread."""

    def on_chunk(chunk: Chunk) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (chunk, time.perf_counter()))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    return on_chunk


def api_key(http: HTTPRequest) -> str | None:
    scheme, _, key = http.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def ngram_namespace(key: str | None) -> str | NGramCache:
    """The n-gram cache namespace of an API key (hashed: no key is kept); no key: a throwaway cache."""
    if key is None:
        return NGramCache()
    return key_namespace(key)


def drafter_for(state: AppState, key: str | None) -> Drafter | None:
    """A request's own drafter when what it drafts from depends on its API key (the n-gram cache, suffix drafting's
    history: the key's, nothing shared without one); None: the engine's."""
    given: dict = {}
    if state.settings.ngram_cache:
        given["ngram_cache"] = ngram_namespace(key)
    if state.settings.suffix and key is not None:
        given["suffix"] = key_namespace(key)
    return state.make_drafter(**given) if given else None


def key_namespace(key: str) -> str:
    return "api-key:" + hashlib.sha256(key.encode()).hexdigest()


def prefix_namespace(state: AppState, key: str | None) -> str | None:
    """Whose kept prefixes a request reuses and feeds: its API key's (hashed); None without a key (nothing kept);
    one namespace for all when the operator shares the prefix cache."""
    if state.settings.share_prefix_cache:
        return "shared"
    return None if key is None else key_namespace(key)


def check_model(state: AppState, name: str | None) -> None:
    served = state.settings.model_name
    if name is not None and name != served:
        raise APIError(404, f"The model '{name}' does not exist: this server serves '{served}'.",
                       "not_found_error", "model", "model_not_found")


def encoded(state: AppState, encode: Callable[[], list[int]], param: str) -> list[int]:
    try:
        ids = encode()
        check_prompt(ids, state.engine.target, state.context)
    except ConfigError as e:
        raise APIError(400, str(e), param=param) from e
    return ids


def submit(state: AppState, body: Sampling, prompts: list[list[int]], http: HTTPRequest,
           calls: Structure | None = None) -> list[Job]:
    """One engine request per prompt (each checked in full before any is queued); a refusal cancels the ones
    already queued. `calls`: the structure tool calls follow."""
    configs = [generation_config(body, state.settings.max_tokens_limit, state.context - len(ids), calls)
               for ids in prompts]
    if state.closing:
        raise APIError(503, "The server is shutting down.", "service_unavailable")
    jobs: list[Job] = []
    try:
        for ids, config in zip(prompts, configs, strict=True):
            jobs.append(submit_one(state, ids, config, http))
    except APIError:
        for job in jobs:
            job.request.cancel()
        raise
    return jobs


def submit_one(state: AppState, prompt_ids: list[int], config, http: HTTPRequest) -> Job:
    job = Job(prompt_ids, asyncio.Queue(), time.perf_counter())
    key = api_key(http)
    drafter = drafter_for(state, key)
    try:
        job.request = state.engine.submit(prompt_ids, config, chunk_sink(asyncio.get_running_loop(), job.queue),
                                          drafter=drafter, namespace=prefix_namespace(state, key))
    except QueueFull as e:
        if state.closing:
            raise APIError(503, "The server is shutting down.", "service_unavailable") from e
        raise APIError(429, str(e), "rate_limit_error") from e
    except ConfigError as e:
        raise APIError(400, str(e)) from e
    return job


async def follow(state: AppState, job: Job) -> AsyncIterator[Chunk]:
    """The job's chunks as they come; leaving early (a client gone) cancels the engine request."""
    try:
        while job.last is None or job.last.finish_reason is None:
            chunk, at = await job.queue.get()
            job.last = chunk
            job.completion_tokens += len(chunk.tokens)
            job.texts.append(chunk.text)
            job.logprobs += chunk.logprobs or []
            if chunk.prompt_logprobs is not None:
                job.prompt_logprobs = chunk.prompt_logprobs
            state.metrics.step(job, chunk, at)
            if chunk.finish_reason is not None:
                state.metrics.finished(job, chunk.stats, FINISH_REASONS.get(chunk.finish_reason, "error"), at)
            yield chunk
    finally:
        if job.last is None or job.last.finish_reason is None:
            job.request.cancel()


async def merged(state: AppState, jobs: list[Job]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) of every job as they come; leaving early cancels every job still running."""
    if len(jobs) == 1:
        async for chunk in follow(state, jobs[0]):
            yield 0, chunk
        return
    out: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        async for chunk in follow(state, job):
            await out.put((i, chunk))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        for _ in jobs:  # each job ends with one finishing chunk
            while True:
                i, chunk = await out.get()
                yield i, chunk
                if chunk.finish_reason is not None:
                    break
    finally:
        for task in tasks:
            task.cancel()


def failure(job: Job) -> APIError | None:
    if job.last is None or job.last.finish_reason != "error":
        return None
    return APIError(500, f"Generation failed: {job.request.error}", "server_error")


def usage(jobs: list[Job]) -> dict:
    parts = [job.usage for job in jobs]
    total = {k: sum(p[k] for p in parts) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(p["prompt_tokens_details"]["cached_tokens"]
                                                           for p in parts)}
    return total


def reply_metrics(jobs: list[Job]) -> dict:
    stats = [job.last.stats for job in jobs if job.last is not None and job.last.stats is not None]
    return spec_decode_metrics(stats[0] if len(stats) == 1 else Stats.combined(stats) if stats else None)


async def cancel_when_gone(jobs: list[Job], http: HTTPRequest) -> None:
    """A client waiting for a whole reply that goes away cancels its engine requests (streams: `merged`)."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    for job in jobs:
        job.request.cancel()


async def respond(state: AppState, body: Sampling, jobs: list[Job], chat: bool, http: HTTPRequest,
                  echoes: list[str] | None = None) -> Response:
    reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": reply_id, "created": int(time.time()), "model": state.settings.model_name}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(events(state, jobs, head, chat, include_usage, echoes),
                                 media_type="text/event-stream")
    return await reply(state, jobs, head, chat, http, echoes)


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
                echoes: list[str] | None) -> JSONResponse:
    await finished(state, jobs, http)
    tokenizer = state.engine.target.tokenizer
    choices = []
    for i, job in enumerate(jobs):
        text = (echoes[i] if echoes else "") + "".join(job.texts)
        choice = {"index": i, "finish_reason": FINISH_REASONS.get(job.last.finish_reason)}
        asked = job.request.config.logprobs is not None
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

    if chat:
        yield sse({**head, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
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


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], offset: int,
                        echoed: tuple[list[int], list[TokenLogprob] | None] | None = None) -> dict:
    """A completion choice's `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}) for these tokens,
    whose text starts at character `offset`; `echoed`: the prompt's ids and logprobs, listed first (its first
    token has none)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token: int, logprob: float | None, top: dict | None) -> None:
        nonlocal offset
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)

    if echoed is not None:
        ids, prompt = echoed
        add(ids[0], None, None)
        logprobs = (prompt or []) + logprobs
    for lp in logprobs:
        add(lp.token, lp.logprob, {token_text(tokenizer, t): v for t, v in lp.top})
    return out


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# --- the endpoints ------------------------------------------------------------------------------------------


async def completions(body: CompletionRequest, http: HTTPRequest):
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body)
    target = state.engine.target
    prompts = completion_prompts(body.prompt)
    ids = [encoded(state, lambda p=p: encode_prompt(target, p), "prompt") for p in prompts]
    jobs = submit(state, body, ids, http)
    echoes = [p if isinstance(p, str) else target.tokenizer.decode(p) for p in prompts] if body.echo else None
    return await respond(state, body, jobs, False, http, echoes)


async def chat_completions(body: ChatRequest, http: HTTPRequest):
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body)
    messages = message_dicts(body.messages)
    syntax, calls, specs = tools_for(state, tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls))
    ids = encoded(state, lambda: encode_chat(state.engine.target, messages, specs), "messages")
    jobs = submit(state, body, [ids], http, calls)
    jobs[0].calls = syntax
    return await respond(state, body, jobs, True, http)


def tools_for(state: AppState, plan: ToolPlan | None) -> tuple[CallSyntax | None, Structure | None, list | None]:
    """(the syntax calls are read in, the structure they follow, the tools the template renders) for a request's
    tools; none for no tools or tool_choice "none" (the template then renders no tools: nothing to call)."""
    if plan is None or plan.choice == "none":
        return None, None, None
    syntax = call_syntax(state.engine.target.tokenizer)
    if syntax is None:
        raise APIError(400, f"tools: the chat template of {state.settings.model_name} renders no tools: serve a model "
                       "whose template does (e.g. qwen2.5-coder-1.5b) or start the server with --chat-template.",
                       param="tools")
    try:
        calls = call_structure(syntax, plan.tools, plan.choice, plan.parallel)
    except ToolSchemaError as e:
        raise APIError(400, str(e), param=f"tools.{e.index}.function.parameters") from e
    except ConfigError as e:  # (llguidance missing)
        raise APIError(400, str(e), param="tools") from e
    return syntax.for_tools([t.name for t in plan.tools]), calls, plan.specs


async def responses(body: ResponsesRequest, http: HTTPRequest):
    """POST /v1/responses: the input as chat messages through the same checks, template, tools and engine as chat
    completions; the reply as the Responses API's items (`responses.Reply`), whole or streamed."""
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body, RESPONSES_REFUSED)
    refuse_unsupported(body)
    body.checked_format()
    messages = body.messages()
    try:
        plan = tool_plan(body.chat_tools(), body.tool_choice, body.parallel_tool_calls)
        syntax, calls, specs = tools_for(state, plan)
    except APIError as e:  # (chat's tools nest a function's fields under "function"; these tools are flat)
        raise APIError(e.status, flat_tool_names(e.message), e.type, flat_tool_names(e.param)) from e
    ids = encoded(state, lambda: encode_chat(state.engine.target, messages, specs), "input")
    jobs = submit(state, body, [ids], http, calls)
    out = Reply(body, state.settings.model_name, syntax)
    if body.stream:
        return StreamingResponse(response_events(state, jobs[0], out), media_type="text/event-stream")
    await finished(state, jobs, http)
    job = jobs[0]
    out.read("".join(job.texts), job.last.finish_reason, job.usage, reply_metrics(jobs))
    return JSONResponse(out.response())


def flat_tool_names(text: str | None) -> str | None:
    return None if text is None else re.sub(r"(tools(?:\.|\[)\d+\]?)\.function\.", r"\1.", text)


async def response_events(state: AppState, job: Job, out: Reply) -> AsyncIterator[str]:
    """A streamed Responses reply: `event: TYPE` and its JSON per event, ending with the finished response."""
    def sent(events: list[dict]) -> str:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)

    yield sent(out.start())
    async for _, chunk in merged(state, [job]):
        if chunk.finish_reason is None:
            yield sent(out.read(chunk.text))
        else:
            error = failure(job)
            yield sent(out.read(chunk.text, chunk.finish_reason, job.usage, reply_metrics([job]),
                                error.message if error is not None else None))


def model_card(state: AppState) -> dict:
    return {"id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "assistgen",
            "max_model_len": state.context}


async def models(http: HTTPRequest):
    return {"object": "list", "data": [model_card(state_of(http))]}


async def model(model_id: str, http: HTTPRequest):
    state = state_of(http)
    check_model(state, model_id)
    return model_card(state)


async def health(http: HTTPRequest):
    state = state_of(http)
    capabilities = state.engine.target.capabilities
    body = {"status": "shutting down" if state.closing else "ok", "exact": capabilities.exact,
            "costs": costs_state(state.engine.target)}
    if not capabilities.exact:
        body["inexact_reason"] = capabilities.inexact_reason
    return body


async def prometheus(http: HTTPRequest):
    return Response(generate_latest(state_of(http).metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- the app ------------------------------------------------------------------------------------------------


def create_app(engine: BatchEngine, settings: ServerSettings,
               make_drafter: Callable[..., Drafter] | None = None) -> FastAPI:
    """The app serving `engine`'s model as `settings.model_name`.

    `make_drafter(ngram_cache=...)` gives a fresh drafter drawing on that n-gram cache; it is needed only
    with `settings.ngram_cache` (without it every request gets the engine's own drafter).
    """
    if (settings.ngram_cache or settings.suffix) and make_drafter is None:
        raise ConfigError("ngram_cache and suffix need make_drafter(ngram_cache=..., suffix=...) to give each API key "
                          "its own.")
    state = AppState(engine, settings, make_drafter, context_limit(engine.target, engine.make_drafter()),
                     Metrics(engine))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        state.closing = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=False, timeout=settings.shutdown_timeout))
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=True, timeout=5.0))

    app = FastAPI(title="assistgen", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/responses")(responses)
    app.get("/v1/models")(models)
    app.get("/v1/models/{model_id:path}")(model)
    app.get("/health")(health)
    app.get("/metrics")(prometheus)
    app.state.assistgen = state
    app.state.engine = engine
    app.state.metrics = state.metrics
    return app


# --- the command --------------------------------------------------------------------------------------------


def serve(engine: BatchEngine, settings: ServerSettings, host: str, port: int,
          make_drafter: Callable[..., Drafter] | None = None) -> int:
    """Serve `engine` on host:port until SIGINT/SIGTERM; 0 after a clean shutdown (`run_until_signal`)."""
    import uvicorn

    app = create_app(engine, settings, make_drafter)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    return run_until_signal(server, engine, f"http://{host}:{port}/v1", settings.model_name)


def run_until_signal(server, engine: BatchEngine, url: str, name: str) -> int:
    """Run uvicorn on a thread and the engine's loop on this (the main) thread, where PyTorch's CPU kernels run
    fastest (`BatchEngine.run_forever`). SIGINT/SIGTERM ask uvicorn to stop (a second SIGINT forces it); its
    lifespan then shuts the engine down, which ends the loop. Prints the URL once the socket is bound; 0 after a
    clean stop, 1 when it never started (e.g. the port is taken)."""
    thread = threading.Thread(target=server.run, name="uvicorn")
    announced = threading.Event()

    def stop(signum, _frame):
        server.force_exit = server.should_exit and signum == signal.SIGINT
        server.should_exit = True

    def watch():
        while thread.is_alive():
            thread.join(0.1)
            if server.started and not announced.is_set():
                print(f"assistgen: serving {name} at {url}", flush=True)
                announced.set()
        engine.shutdown(cancel=True, timeout=5.0)  # uvicorn is gone (or never started): end the loop

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        def begin_http():
            thread.start()
            threading.Thread(target=watch, name="uvicorn-watch", daemon=True).start()

        engine.run_forever(claimed=begin_http)
        thread.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0 if announced.is_set() else 1
