"""`assistgen serve`'s app: an OpenAI-compatible HTTP server over a `BatchEngine`.

Contract: `create_app(engine, settings, make_drafter)` builds a FastAPI app (no model loading: tests pass
a loaded model's engine) serving `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `POST /v1/responses` (the Responses API, `wire/responses.py`; tool calls on
chat and responses: the `chat` layer), `POST /v1/audio/transcriptions` (`transcriptions.py`, with the speech model given
as `create_app(..., speech=SpeechService(...))`; without one it answers 404 saying how to serve one), `GET
/v1/models` (the speech model listed too), `GET /v1/models/{id}`, `GET /health` and `GET /metrics` (Prometheus text
from the app's own registry, `metrics.py`). The handlers are module-level functions over the app's `AppState`
(`app_state.py`: engine, settings, metrics, the speech model, whether it is closing); a request's way through the
engine is `jobs.py`, its answers `replies.py` (in the shapes of `wire/`). Every request is
checked in full before it reaches the engine (`wire/`, then the engine's admission on the handler's thread:
the prompt against the context, the grammar compiled, `BatchEngine.admit`): each field OpenAI's API defines is
honoured or, where this server does not do it, refused unless left at its "off" value; a prompt plus the new tokens
asked for must fit the context. A completion request with several prompts runs them as separate engine requests,
batched, n choices each (`index` in order, usage summed); `n` > 1 (and completions' `best_of`) runs a prompt's
candidates as sibling engine requests sharing its prefill (`jobs.submit`), the n best of best_of answered
(`jobs.ranked`); `echo` puts the prompt's text before each choice.
Before any handler, `gate.Gate` checks the API key (`ServerSettings.api_keys`: 401 without a known one, `/health`
open) and the body's size (413 past `ServerSettings.max_body`). A client mistake answers 4xx with OpenAI's error body
(400 bad input, 401 no known key, 404 unknown model, 413 body too large, 429 queue full, 503 shutting down), anything
else 500 with the same body. A client that goes away mid-generation (streamed or not)
has its engine requests cancelled. Responses carry, besides OpenAI's fields, `metrics.speculative_decoding`
(`metrics.spec_decode_metrics`, added up over the choices). The n-gram
cache across requests is off unless `ServerSettings.ngram_cache` (suffix drafting's history: `suffix`); then a
request draws on (and feeds) the cache of its API key (the bearer token; no key: a cache of its own), never another's.
`serve(engine, settings, host, port)` starts the engine and runs uvicorn until SIGINT/SIGTERM, then lets
running requests finish (`ServerSettings.shutdown_timeout`) and returns 0 (`assembly.build_server` loads the
model(s) and builds the engine, for `assistgen serve` and each Ray replica).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, contextmanager
from functools import partial

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from assistgen.api import encode_prompt
from assistgen.chat.grammar import ToolChoiceError, ToolSchemaError, call_structure, faulty_tool
from assistgen.chat.syntax import CallSyntax
from assistgen.chat.templates import encode_chat, template_prefix
from assistgen.config import ConfigError, Structure
from assistgen.policy.costs import costs_state
from assistgen.serving.app_state import AppState, ServerSettings, state_of
from assistgen.serving.batching import BatchEngine
from assistgen.serving.gate import Gate, openness
from assistgen.serving.jobs import Job, check_model, encoded, failure, fits_untokenized, merged, reply_metrics, submit
from assistgen.serving.metrics import Metrics
from assistgen.serving.replies import finished, respond
from assistgen.serving.speech_service import SpeechService
from assistgen.serving.transcriptions import openapi_form, transcriptions
from assistgen.serving.wire.chat import ChatRequest, message_dicts
from assistgen.serving.wire.common import refuse_unsupported
from assistgen.serving.wire.completions import CompletionRequest, completion_prompts
from assistgen.serving.wire.errors import APIError, install_error_handlers
from assistgen.serving.wire.responses import RESPONSES_REFUSED, Reply, ResponsesRequest
from assistgen.serving.wire.tools import ToolPlan, tool_plan
from assistgen.spec.drafts import Drafter

# --- the endpoints ------------------------------------------------------------------------------------------


async def completions(body: CompletionRequest, http: HTTPRequest):
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body)
    target = state.engine.target
    prompts = completion_prompts(body.prompt)
    for p in prompts:  # (each prompt its own sequence)
        if isinstance(p, str):
            fits_untokenized(state, [p], "prompt")
    ids = [encoded(lambda p=p: encode_prompt(target, p), "prompt") for p in prompts]
    jobs = submit(state, body, ids, http)
    echoes = [p if isinstance(p, str) else target.tokenizer.decode(p) for p in prompts] if body.echo else None
    return await respond(state, body, jobs, False, http, echoes)


async def chat_completions(body: ChatRequest, http: HTTPRequest):
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body)
    messages = message_dicts(body.messages)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    syntax, calls, specs = tools_for(state, plan)
    fits_untokenized(state, [m["content"] for m in messages if isinstance(m.get("content"), str)], "messages")
    ids = encoded(lambda: encode_chat(state.engine.target, messages, specs), "messages")
    with tool_schemas_named(plan, calls):
        jobs = submit(state, body, [ids], http, calls, "messages", template_prefix(state.engine.target, messages, ids),
                      predicted_tokens(state, body))
    for job in jobs:
        job.calls = syntax
    return await respond(state, body, jobs, True, http)


@contextmanager
def tool_schemas_named(plan: ToolPlan | None, calls: Structure | None):
    """Admission compiles the grammar of a request's calls once; where it does not compile, the 400 names the tool
    whose parameter schema made it fail (`chat.grammar.faulty_tool`)."""
    try:
        yield
    except APIError as e:
        faulty = faulty_tool(plan.tools) if calls is not None and e.status == 400 and e.param is None else None
        if faulty is None:
            raise
        raise APIError(400, str(faulty), param=f"tools.{faulty.index}.function.parameters") from e


def predicted_tokens(state: AppState, body: ChatRequest) -> list[int] | None:
    """The tokens of the request's predicted output (Predicted Outputs), checked against the context untokenized
    first; None without one."""
    if body.prediction is None:
        return None
    text = body.prediction.text()
    fits_untokenized(state, [text], "prediction")
    return list(state.engine.target.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def tools_for(state: AppState, plan: ToolPlan | None) -> tuple[CallSyntax | None, Structure | None, list | None]:
    """(the syntax calls are read in, calls only with "required" or a function; the structure they follow; the tools
    the template renders) for a request's tools; none for no tools or tool_choice "none" (the template then renders
    no tools: nothing to call)."""
    if plan is None or plan.choice == "none":
        return None, None, None
    syntax = state.call_syntax
    if syntax is None:
        raise APIError(400, f"tools: the chat template of {state.settings.model_name} renders no tools: serve a model "
                       "whose template does (e.g. qwen2.5-coder-1.5b) or start the server with --chat-template.",
                       param="tools")
    try:
        calls = call_structure(syntax, plan.tools, plan.choice, plan.parallel)
    except ToolSchemaError as e:
        raise APIError(400, str(e), param=f"tools.{e.index}.function.parameters") from e
    except ToolChoiceError as e:
        raise APIError(400, str(e), param="tool_choice") from e
    except ConfigError as e:  # (llguidance missing)
        raise APIError(400, str(e), param="tools") from e
    return syntax.for_tools([t.name for t in plan.tools], calls_only=plan.choice != "auto"), calls, plan.specs


async def responses(body: ResponsesRequest, http: HTTPRequest):
    """POST /v1/responses: the input as chat messages through the same checks, template, tools and engine as chat
    completions; the reply as the Responses API's items (`responses.Reply`), whole or streamed."""
    state = state_of(http)
    check_model(state, body.model)
    refuse_unsupported(body, RESPONSES_REFUSED)
    refuse_unsupported(body)
    body.checked_format()
    messages = body.messages()
    try:  # (chat's tools nest a function's fields under "function"; these tools are flat: errors name them so)
        plan = tool_plan(body.chat_tools(), body.tool_choice, body.parallel_tool_calls)
        syntax, calls, specs = tools_for(state, plan)
        fits_untokenized(state, [m["content"] for m in messages if isinstance(m.get("content"), str)], "input")
        ids = encoded(lambda: encode_chat(state.engine.target, messages, specs), "input")
        with tool_schemas_named(plan, calls):
            jobs = submit(state, body, [ids], http, calls, "input", template_prefix(state.engine.target, messages, ids))
    except APIError as e:
        raise APIError(e.status, flat_tool_names(e.message), e.type, flat_tool_names(e.param), e.code) from e
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


def speech_card(speech: SpeechService) -> dict:
    return {"id": speech.name, "object": "model", "created": 0, "owned_by": "assistgen",
            "max_model_len": speech.model.context_length}


async def models(http: HTTPRequest):
    state = state_of(http)
    speech = [speech_card(state.speech)] if state.speech is not None else []
    return {"object": "list", "data": [model_card(state), *speech]}


async def model(model_id: str, http: HTTPRequest):
    state = state_of(http)
    if state.speech is not None and model_id == state.speech.name:
        return speech_card(state.speech)
    check_model(state, model_id)
    return model_card(state)


async def health(http: HTTPRequest):
    state = state_of(http)
    capabilities = state.engine.target.capabilities
    body = {"status": "shutting down" if state.closing else "ok", "exact": capabilities.exact,
            "costs": costs_state(state.engine.target)}
    if not capabilities.exact:
        body["inexact_reason"] = capabilities.inexact_reason
    if state.speech is not None:
        body["speech_model"] = state.speech.name
    return body


async def prometheus(http: HTTPRequest):
    return Response(generate_latest(state_of(http).metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- the app ------------------------------------------------------------------------------------------------


def create_app(engine: BatchEngine, settings: ServerSettings, make_drafter: Callable[..., Drafter] | None = None,
               speech: SpeechService | None = None) -> FastAPI:
    """The app serving `engine`'s model as `settings.model_name`, and `speech` (if given) for transcriptions.

    `make_drafter(ngram_cache=..., prediction=...)` gives a fresh drafter drawing on that n-gram cache, or on a
    request's predicted output; it is needed with `settings.ngram_cache` (without it, the engine's own factory).
    """
    if (settings.ngram_cache or settings.suffix) and make_drafter is None:
        raise ConfigError("ngram_cache and suffix need make_drafter(ngram_cache=..., suffix=...) to give each API key "
                          "its own.")
    state = AppState(engine, settings, make_drafter or engine.make_drafter, engine.context, Metrics(engine), speech)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        state.closing = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=False, timeout=settings.shutdown_timeout))
        await loop.run_in_executor(None, partial(engine.shutdown, cancel=True, timeout=5.0))
        if speech is not None:
            await loop.run_in_executor(None, speech.close)

    app = FastAPI(title="assistgen", version="0.1.0", lifespan=lifespan)
    app.add_middleware(Gate, settings=settings)  # the API key and the body's size, before any handler
    if settings.allowed_origins:  # (outside the gate: a browser's preflight carries no key)
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    install_error_handlers(app)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/responses")(responses)
    app.post("/v1/audio/transcriptions", openapi_extra=openapi_form(speech))(transcriptions)
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
          make_drafter: Callable[..., Drafter] | None = None, speech: SpeechService | None = None) -> int:
    """Serve `engine` (and `speech`) on host:port until SIGINT/SIGTERM; 0 after a clean shutdown
    (`run_until_signal`)."""
    import uvicorn

    app = create_app(engine, settings, make_drafter, speech)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", root_path=settings.root_path,
                                           ssl_keyfile=settings.tls_keyfile, ssl_certfile=settings.tls_certfile))
    names = settings.model_name if speech is None else f"{settings.model_name} and {speech.name}"
    print(openness(settings, host, port), flush=True)
    state = app.state.assistgen
    scheme = "https" if settings.tls_certfile else "http"
    return run_until_signal(server, engine, f"{scheme}://{host}:{port}{settings.root_path}/v1", names,
                            partial(drain, state))


def drain(state: AppState, grace: float | None = None) -> None:
    """The first half of a shutdown, while the server still listens: new requests are answered 503, the running and
    waiting ones get `grace` seconds (None: `shutdown_timeout`) to finish, and the rest are ended (each stream with
    its final chunk, finish reason "abort", and [DONE])."""
    state.closing = True
    state.engine.shutdown(cancel=False, timeout=state.settings.shutdown_timeout if grace is None else grace)
    state.engine.shutdown(cancel=True, timeout=5.0)


def run_until_signal(server, engine: BatchEngine, url: str, name: str,
                     drain: Callable[[], None] | None = None) -> int:
    """Run uvicorn on a thread and the engine's loop on this (the main) thread, where PyTorch's CPU kernels run
    fastest (`BatchEngine.run_forever`). The first SIGINT/SIGTERM runs `drain` on a thread (new requests 503, the
    running ones finished within the grace, the rest ended), then asks uvicorn to stop, which waits for the streams'
    last bytes; a second signal asks at once (a second SIGINT forces it). uvicorn's lifespan then shuts the engine
    down, which ends the loop. Prints the URL once the socket is bound; 0 after a clean stop, 1 when it never started
    (e.g. the port is taken)."""
    thread = threading.Thread(target=server.run, name="uvicorn")
    announced = threading.Event()
    stopping = threading.Event()

    def drained():
        if drain is not None:
            drain()
        server.should_exit = True

    def stop(signum, _frame):
        if stopping.is_set() or drain is None:
            server.force_exit = server.should_exit and signum == signal.SIGINT
            server.should_exit = True
            return
        stopping.set()
        threading.Thread(target=drained, name="assistgen-drain", daemon=True).start()

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
