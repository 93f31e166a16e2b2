"""`assistgen serve`: an OpenAI-compatible HTTP server over a `BatchEngine`.

Contract: `create_app(engine, settings, make_drafter)` builds a FastAPI app (no model loading: tests pass
a loaded model's engine) serving `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus
text from the app's own registry). Every request is checked in full before it reaches the engine; a
client mistake answers 4xx with OpenAI's error body `{"error": {"message", "type", "param", "code"}}`
(400 bad input, 404 unknown model, 429 queue full, 503 shutting down), anything else 500 with the same
body. A client that goes away mid-generation (streamed or not) has its engine request cancelled.
Responses carry, besides OpenAI's fields, `metrics.speculative_decoding` with vLLM's names, from the
request's final `Stats`:
  num_spec_steps            = stats.draft_steps (verification steps that checked >= 1 draft token)
  num_draft_tokens          = stats.drafted_tokens
  num_accepted_draft_tokens = stats.accepted_tokens
  acceptance_histogram      = stats.accept_histogram ([i]: steps, drafting or not, that accepted i)
  mean_acceptance_length    = stats.mean_accepted_length (tokens per verification step)
  draft_acceptance_rate     = stats.acceptance_rate (accepted / drafted)
The n-gram cache across requests is off unless `ServerSettings.ngram_cache`; then a request draws on
(and feeds) the cache of its API key (the bearer token; no key: a cache of its own), never another's.
`serve(args)` loads the model(s), starts the engine and runs uvicorn until SIGINT/SIGTERM, then lets
running requests finish (`ServerSettings.shutdown_timeout`) and exits 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from assistgen.api import encode_chat, encode_prompt
from assistgen.batching import BatchEngine, QueueFull, Request
from assistgen.config import ConfigError, GenerationConfig
from assistgen.drafters import Drafter
from assistgen.engine import Chunk, check_prompt, context_limit
from assistgen.ngram import NGramCache
from assistgen.stats import Stats

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
FINISH_REASONS = {"length": "length", "context": "length", "eos": "stop", "stop": "stop", "cancelled": "abort"}


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients give as "model" (requests naming another get 404)
    ngram_cache: bool = False  # an n-gram cache across requests, one per API key
    max_tokens_limit: int | None = None  # the most new tokens a request may ask for (None: no limit)
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown


# --- requests -----------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints take; unknown fields (clients send some) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, strict=True)  # None: GenerationConfig's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, strict=True)  # an extension of OpenAI's API
    seed: int | None = Field(None, strict=True, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, strict=True)  # only 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


# --- errors -------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as (message, the field it names)."""
    errors = e.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        message, param = validation_message(e)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        return error_response(APIError(500, f"Internal error: {type(e).__name__}: {e}", "server_error"))


# --- metrics ------------------------------------------------------------------------------------------------


class EngineGauges:
    """Requests running and waiting, read from the engine at scrape time."""

    def __init__(self, engine: BatchEngine):
        self.engine = engine

    def collect(self):
        yield GaugeMetricFamily("assistgen:num_requests_running", "Requests being generated.",
                                value=self.engine.num_running)
        yield GaugeMetricFamily("assistgen:num_requests_waiting", "Requests waiting to join.",
                                value=self.engine.num_waiting)


class Metrics:
    """The app's Prometheus metrics (names mirror vLLM's; counters gain `_total` in the exposition).

    Inter-token latency: each token of a step is observed with the time since the previous step divided
    by the step's token count, so the observations sum to the decoding time after the first token.
    """

    def __init__(self, engine: BatchEngine):
        self.registry = registry = CollectorRegistry()
        registry.register(EngineGauges(engine))

        def counter(name, doc, labels=()):
            return Counter(f"assistgen:{name}", doc, labels, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(f"assistgen:{name}", doc, buckets=buckets, registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Verification steps that checked draft tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and checked.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Steps that accepted the draft token at each position.", ["position"])
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens read.")
        self.success = counter("request_success", "Requests finished, by finish reason.", ["finished_reason"])
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", latency)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", latency)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to its last token.", latency)

    def step(self, job: Job, chunk: Chunk, at: float) -> None:
        if not chunk.tokens:
            return
        if job.first_token_at is None:
            job.first_token_at = at
            self.ttft.observe(at - job.started)
        else:
            gap = (at - job.last_token_at) / len(chunk.tokens)
            for _ in chunk.tokens:
                self.itl.observe(gap)
        job.last_token_at = at

    def finished(self, job: Job, stats: Stats | None, finish_reason: str, at: float) -> None:
        self.e2e.observe(at - job.started)
        self.success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(len(job.prompt_ids))
        if stats is None:
            return
        self.generation_tokens.inc(stats.new_tokens)
        self.drafts.inc(stats.draft_steps)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        histogram = stats.accept_histogram
        for i in range(len(histogram) - 1):
            accepted = sum(histogram[i + 1:])  # steps that accepted more than i draft tokens
            if accepted:
                self.accepted_per_pos.labels(position=str(i)).inc(accepted)


def spec_decode_metrics(stats: Stats | None) -> dict:
    if stats is None:
        return {}
    return {"speculative_decoding": {
        "num_spec_steps": stats.draft_steps,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_draft_tokens": stats.accepted_tokens,
        "acceptance_histogram": list(stats.accept_histogram),
        "mean_acceptance_length": stats.mean_accepted_length,
        "draft_acceptance_rate": stats.acceptance_rate,
    }}


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
    last: Chunk | None = None

    @property
    def usage(self) -> dict:
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": self.completion_tokens,
                "total_tokens": n + self.completion_tokens}


def chunk_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Chunk], None]:
    """The engine's on_chunk: hands (chunk, arrival time) to the event loop's queue from the engine thread."""

    def on_chunk(chunk: Chunk) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (chunk, time.perf_counter()))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    return on_chunk


def generation_config(body: Sampling, limit: int | None) -> GenerationConfig:
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}.", param="n")
    given = {"max_new_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
             "top_k": body.top_k, "seed": body.seed}
    settings = {k: v for k, v in given.items() if v is not None}
    if body.stop is not None:
        settings["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    config = GenerationConfig(**settings)
    if limit is not None and config.max_new_tokens > limit:
        if body.max_tokens is not None:
            raise APIError(400, f"max_tokens is {body.max_tokens}, above this server's limit {limit}.",
                           param="max_tokens")
        config = GenerationConfig(**{**settings, "max_new_tokens": limit})
    try:
        return config.validate()
    except ConfigError as e:
        message = str(e).replace("max_new_tokens", "max_tokens")  # GenerationConfig's name -> the API's
        param = next((f for f in Sampling.model_fields if message.startswith(f)), None)
        raise APIError(400, message, param=param) from e


def completion_prompt(prompt: str | list[str] | list[int]) -> str | list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: give one prompt per request, got {len(prompt)}.", param="prompt")
        return prompt[0]
    return prompt


def message_dicts(messages: list[Message]) -> list[dict]:
    def content(m: Message) -> str:
        if isinstance(m.content, list):
            return "".join(part.text for part in m.content)
        return m.content or ""

    return [{"role": m.role, "content": content(m)} for m in messages]


def api_key(http: HTTPRequest) -> str | None:
    scheme, _, key = http.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def ngram_namespace(key: str | None) -> str | NGramCache:
    """The n-gram cache namespace of an API key (hashed: no key is kept); no key: a throwaway cache."""
    if key is None:
        return NGramCache()
    return "api-key:" + hashlib.sha256(key.encode()).hexdigest()


# --- the app ------------------------------------------------------------------------------------------------


def create_app(engine: BatchEngine, settings: ServerSettings,
               make_drafter: Callable[..., Drafter] | None = None) -> FastAPI:
    """The app serving `engine`'s model as `settings.model_name`.

    `make_drafter(ngram_cache=...)` gives a fresh drafter drawing on that n-gram cache; it is needed only
    with `settings.ngram_cache` (without it every request gets the engine's own drafter).
    """
    if settings.ngram_cache and make_drafter is None:
        raise ConfigError("ngram_cache needs make_drafter(ngram_cache=...) to give each API key its cache.")
    target = engine.target
    context = context_limit(target, engine.make_drafter())
    metrics = Metrics(engine)
    state = {"closing": False}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        state["closing"] = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=False, timeout=settings.shutdown_timeout))
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=True, timeout=5.0))

    app = FastAPI(title="assistgen", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(404, f"The model '{name}' does not exist: this server serves '{settings.model_name}'.",
                           "not_found_error", "model", "model_not_found")

    def encoded(encode: Callable[[], list[int]], param: str) -> list[int]:
        try:
            ids = encode()
            check_prompt(ids, target, context)
        except ConfigError as e:
            raise APIError(400, str(e), param=param) from e
        return ids

    def submit(body: Sampling, prompt_ids: list[int], http: HTTPRequest) -> Job:
        config = generation_config(body, settings.max_tokens_limit)
        if state["closing"]:
            raise APIError(503, "The server is shutting down.", "service_unavailable")
        job = Job(prompt_ids, asyncio.Queue(), time.perf_counter())
        drafter = make_drafter(ngram_cache=ngram_namespace(api_key(http))) if settings.ngram_cache else None
        try:
            job.request = engine.submit(prompt_ids, config, chunk_sink(asyncio.get_running_loop(), job.queue),
                                        drafter=drafter)
        except QueueFull as e:
            if state["closing"]:
                raise APIError(503, "The server is shutting down.", "service_unavailable") from e
            raise APIError(429, str(e), "rate_limit_error") from e
        except ConfigError as e:
            raise APIError(400, str(e)) from e
        return job

    async def follow(job: Job) -> AsyncIterator[Chunk]:
        """The job's chunks as they come; leaving early (a client gone) cancels the engine request."""
        try:
            while job.last is None or job.last.finish_reason is None:
                chunk, at = await job.queue.get()
                job.last = chunk
                job.completion_tokens += len(chunk.tokens)
                job.texts.append(chunk.text)
                metrics.step(job, chunk, at)
                if chunk.finish_reason is not None:
                    metrics.finished(job, chunk.stats, FINISH_REASONS.get(chunk.finish_reason, "error"), at)
                yield chunk
        finally:
            if job.last is None or job.last.finish_reason is None:
                job.request.cancel()

    def failure(job: Job) -> APIError | None:
        if job.last.finish_reason != "error":
            return None
        return APIError(500, f"Generation failed: {job.request.error}", "server_error")

    async def complete(job: Job) -> Job:
        async for _ in follow(job):
            pass
        error = failure(job)
        if error is not None:
            raise error
        return job

    async def cancel_when_gone(job: Job, http: HTTPRequest) -> None:
        """A client waiting for a whole reply that goes away cancels its engine request (streams: `follow`)."""
        while not await http.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        job.request.cancel()

    async def respond(body: Sampling, job: Job, chat: bool, http: HTTPRequest) -> Response:
        reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": reply_id, "created": int(time.time()), "model": settings.model_name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(events(job, head, chat, usage), media_type="text/event-stream")
        return await reply(job, head, chat, http)

    async def reply(job: Job, head: dict, chat: bool, http: HTTPRequest) -> JSONResponse:
        watcher = asyncio.create_task(cancel_when_gone(job, http))
        try:
            await complete(job)
        finally:
            watcher.cancel()
        text = "".join(job.texts)
        choice = {"index": 0, "finish_reason": FINISH_REASONS.get(job.last.finish_reason)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": job.usage, "metrics": spec_decode_metrics(job.last.stats)})

    async def events(job: Job, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta: dict | str, finish_reason: str | None = None, **extra) -> str:
            choice = {"index": 0, "finish_reason": finish_reason}
            if chat:
                choice["delta"] = delta
            else:
                choice.update(text=delta, logprobs=None)
            return sse({**head, "object": kind, "choices": [choice], **extra})

        if chat:
            yield event({"role": "assistant", "content": ""})
        async for chunk in follow(job):
            if chunk.finish_reason == "error":
                yield sse(error_body(failure(job).message, "server_error"))
            elif chunk.finish_reason is not None:
                yield event({"content": chunk.text} if chat else chunk.text,
                            FINISH_REASONS.get(chunk.finish_reason), metrics=spec_decode_metrics(chunk.stats))
            elif chunk.text:
                yield event({"content": chunk.text} if chat else chunk.text)
        if include_usage:
            yield sse({**head, "object": kind, "choices": [], "usage": job.usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        prompt = completion_prompt(body.prompt)
        job = submit(body, encoded(lambda: encode_prompt(target, prompt), "prompt"), http)
        return await respond(body, job, False, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        check_model(body.model)
        job = submit(body, encoded(lambda: encode_chat(target, message_dicts(body.messages)), "messages"), http)
        return await respond(body, job, True, http)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "assistgen"}]}

    @app.get("/health")
    async def health():
        return {"status": "shutting down" if state["closing"] else "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.engine = engine
    app.state.metrics = metrics
    return app


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# --- the command --------------------------------------------------------------------------------------------


def serve(args) -> int:
    """`assistgen serve`: load, start the engine, serve until SIGINT/SIGTERM; 0 after a clean shutdown."""
    import uvicorn

    from assistgen.api import as_schedule, default_schedule, make_drafter
    from assistgen.batching import EngineSettings
    from assistgen.cli import placement
    from assistgen.models import load_model

    target = load_model(args.model, quantize=args.quantize, **placement(args))
    assistant = load_model(args.assistant, quantize=args.quantize, **placement(args)) if args.assistant else None
    drafters = partial(make_drafter, target, assistant, args.lookup, args.early_exit or False)
    drafters()  # bad drafter options fail here, before the server starts
    schedule = as_schedule(args.schedule) if args.schedule is not None else default_schedule()
    given = {n: getattr(args, n) for n in ("max_batch", "max_queue", "prefill_budget") if getattr(args, n) is not None}
    engine = BatchEngine(target, drafters, schedule, EngineSettings(**given))
    app = create_app(engine, ServerSettings(model_name=args.model, ngram_cache=args.ngram_cache), drafters)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    return run_until_signal(server, engine, f"http://{args.host}:{args.port}/v1", args.model)


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
