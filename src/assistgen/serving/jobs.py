"""One HTTP request through the batched engine: `Job` (the engine's handle, the queue its chunks arrive on, its
timings), the request's drafter and prefix namespace from its API key, `submit` (every prompt admitted by the engine,
`BatchEngine.admit`: its prompt checked against the context and its grammar compiled, a refusal a 400 naming the
prompt's field when the prompt is at fault; then queued; a full queue is 429), `follow`/`merged` (the chunks of one
job or several, in order, as they arrive), `failure`, `usage` and `reply_metrics` (what a finished job reports), and
`cancel_when_gone` (a client that disconnects has its engine requests cancelled)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import Request as HTTPRequest

from assistgen.chat.syntax import CallSyntax
from assistgen.config import ConfigError, GenerationConfig, Structure
from assistgen.core.admission import Admission, PromptError
from assistgen.core.logprobs import TokenLogprob
from assistgen.core.prefix import NOBODY
from assistgen.core.state import Chunk
from assistgen.drafters.ngram import NGramCache
from assistgen.drafters.prediction import Prediction, prediction_usage
from assistgen.serving.app_state import AppState
from assistgen.serving.batching import QueueFull, Request
from assistgen.serving.metrics import spec_decode_metrics
from assistgen.serving.wire.common import FINISH_REASONS, Sampling
from assistgen.serving.wire.errors import APIError
from assistgen.serving.wire.generation import generation_config
from assistgen.spec.drafts import Drafter
from assistgen.stats import Stats

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


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
    deadline: asyncio.TimerHandle | None = None  # ends it with finish reason "timeout" (`request_timeout`)
    predicted: list[int] | None = None  # the predicted output's tokens (Predicted Outputs)
    tokens: list[int] = field(default_factory=list)  # the output's tokens (kept only with a prediction)

    @property
    def usage(self) -> dict:
        n = len(self.prompt_ids)
        stats = self.last.stats if self.last is not None else None
        out = {"prompt_tokens": n, "completion_tokens": self.completion_tokens,
               "total_tokens": n + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats is not None else 0}}
        if self.predicted is not None:  # (OpenAI's counts: the predicted tokens that appear in the answer, and not)
            accepted, rejected = prediction_usage(self.predicted, self.tokens)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                "rejected_prediction_tokens": rejected}
        return out


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


def drafter_for(state: AppState, key: str | None, prediction: Prediction | None = None) -> Drafter | None:
    """A request's own drafter when what it drafts from depends on its API key (the n-gram cache, suffix drafting's
    history: the key's, nothing shared without one) or on the request (its predicted output); None: the engine's."""
    given: dict = {} if prediction is None else {"prediction": prediction}
    if state.settings.ngram_cache:
        given["ngram_cache"] = ngram_namespace(key)
    if state.settings.suffix and key is not None:
        given["suffix"] = key_namespace(key)
    return state.make_drafter(**given) if given else None


def key_namespace(key: str) -> str:
    return "api-key:" + hashlib.sha256(key.encode()).hexdigest()


def prefix_namespace(state: AppState, key: str | None) -> str:
    """Whose kept prefixes a request reuses and feeds: its API key's (hashed); without a key `NOBODY`'s (nothing of
    its own kept: only the chat template's opening, which every request shares); one namespace for all when the
    operator shares the prefix cache."""
    if state.settings.share_prefix_cache:
        return "shared"
    return NOBODY if key is None else key_namespace(key)


def check_model(state: AppState, name: str | None) -> None:
    served = state.settings.model_name
    if name is not None and name != served:
        raise APIError(404, f"The model '{name}' does not exist: this server serves '{served}'.",
                       "not_found_error", "model", "model_not_found")


def fits_untokenized(state: AppState, texts: list[str], param: str) -> None:
    """Refuse text that cannot fit the context whatever its tokenization, before the tokenizer runs on it: no token
    of the model is longer than `AppState.longest_token` bytes, so n bytes are at least n / that many tokens."""
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    least = -(-size // state.longest_token)
    if least >= state.context:
        raise APIError(400, f"{param}: {size:,} bytes of text are at least {least:,} tokens in any tokenization (no "
                       f"token of this model is longer than {state.longest_token} bytes), more than the context of "
                       f"{state.context:,} tokens: send a shorter text.", param=param, code="context_length_exceeded")


def encoded(encode: Callable[[], list[int]], param: str) -> list[int]:
    """The prompt's ids (`encode()`); what cannot be encoded is a 400 naming `param`, the field it came in."""
    try:
        return encode()
    except ConfigError as e:
        raise APIError(400, str(e), param=param) from e


def submit(state: AppState, body: Sampling, prompts: list[list[int]], http: HTTPRequest,
           calls: Structure | None = None, param: str = "prompt", public: int = 0,
           predicted: list[int] | None = None) -> list[Job]:
    """The engine requests of a body: per prompt, its candidates (`Sampling.choices`: n, or best_of), prompt by
    prompt; each prompt admitted once (its grammar compiled once) before any is queued, a refusal cancelling the ones
    already queued. A prompt's candidates are siblings in the engine (one feeds the prompt, the others start from its
    cache) and candidate j draws with seed + j (as vLLM: each equals a single request with that seed). `calls`: the
    structure tool calls follow; `param`: the field the prompts came in; `public`: how many of each prompt's first
    tokens its chat template renders from no content (`chat.templates.template_prefix`); `predicted`: the predicted
    output's tokens (Predicted Outputs), drafted from by each candidate's drafter."""
    n, candidates = body.choices()
    check_queue(state, len(prompts) * candidates, n, candidates, param)
    configs = [generation_config(body, state.settings.max_tokens_limit, state.context - len(ids), calls,
                                 state.engine.target.tokenizer) for ids in prompts]
    if candidates > n:  # (ranked by their tokens' log-probabilities, listed only when asked for)
        configs = [config if config.logprobs is not None else replace(config, logprobs=0) for config in configs]
    if state.closing:
        raise APIError(503, "The server is shutting down.", "service_unavailable")
    key, started = api_key(http), time.perf_counter()
    admitted = [admission(state, ids, config, drafter_for(state, key, prediction_of(predicted, ids)), param)
                for ids, config in zip(prompts, configs, strict=True)]
    jobs: list[Job] = []
    try:
        for (one, drafter), ids in zip(admitted, prompts, strict=True):
            first = None
            for j in range(candidates):
                if j:
                    drafter = drafter_for(state, key, prediction_of(predicted, ids))
                jobs.append(submit_one(state, replace(one, config=candidate_config(one.config, j)), drafter, key,
                                       started, public, first))
                jobs[-1].predicted = predicted
                if first is None:
                    first = jobs[-1].request
    except APIError:
        for job in jobs:
            job.request.cancel()
        raise
    return jobs


def candidate_config(config: GenerationConfig, j: int) -> GenerationConfig:
    """Candidate j's config: seed + j (wrapped into torch's seed range) when a seed is given."""
    if config.seed is None:
        return config
    seed = config.seed + j
    return replace(config, seed=seed - 2**64 if seed >= 2**64 else seed)


def check_queue(state: AppState, count: int, n: int, candidates: int, param: str) -> None:
    """A body asking for more engine requests than the engine queues is a 400 (a 429 would say: retry)."""
    limit = state.engine.settings.max_queue
    if count > limit:
        field = "best_of" if candidates > n else "n" if n > 1 else param
        raise APIError(400, f"{field}: this request asks for {count} generations (prompts × candidates), more than "
                       f"this server queues at once ({limit}, --max-queue): ask for fewer.", param=field)


def ranked(jobs: list[Job], n: int, candidates: int) -> list[int]:
    """best_of: of each prompt's finished candidates (consecutive in `jobs`), the indices of the n with the highest
    log-probability per token, best first (OpenAI's "best"); with n candidates, every index in order."""
    if candidates == n:
        return list(range(len(jobs)))
    out = []
    for start in range(0, len(jobs), candidates):
        group = range(start, start + candidates)
        out += sorted(group, key=lambda i: mean_logprob(jobs[i]), reverse=True)[:n]
    return out


def mean_logprob(job: Job) -> float:
    return sum(lp.logprob for lp in job.logprobs) / len(job.logprobs) if job.logprobs else float("-inf")


def prediction_of(predicted: list[int] | None, prompt: list[int]) -> Prediction | None:
    return None if predicted is None else Prediction(tuple(predicted), len(prompt))


def admission(state: AppState, ids: list[int], config: GenerationConfig, drafter: Drafter | None,
              param: str) -> tuple[Admission, Drafter | None]:
    """(the request's admission by the engine, the drafter it was admitted for); a refusal is a 400, naming `param`
    when the prompt is at fault."""
    try:
        return state.engine.admit(ids, config, drafter), drafter
    except PromptError as e:
        raise APIError(400, str(e), param=param) from e
    except ConfigError as e:
        raise APIError(400, str(e)) from e


def submit_one(state: AppState, admitted: Admission, drafter: Drafter | None, key: str | None,
               started: float, public: int = 0, sibling: Request | None = None) -> Job:
    job = Job(admitted.prompt_ids, asyncio.Queue(), started)
    try:
        job.request = state.engine.submit(admitted, None, chunk_sink(asyncio.get_running_loop(), job.queue),
                                          drafter=drafter, namespace=prefix_namespace(state, key), public=public,
                                          sibling=sibling)
    except QueueFull as e:
        if state.closing:
            raise APIError(503, "The server is shutting down.", "service_unavailable") from e
        raise APIError(429, str(e), "rate_limit_error") from e
    if state.settings.request_timeout is not None:
        job.deadline = asyncio.get_running_loop().call_later(state.settings.request_timeout, job.request.cancel,
                                                             "timeout")
    return job


async def follow(state: AppState, job: Job) -> AsyncIterator[Chunk]:
    """The job's chunks as they come; leaving early (a client gone) cancels the engine request."""
    try:
        while job.last is None or job.last.finish_reason is None:
            chunk, at = await job.queue.get()
            job.last = chunk
            job.completion_tokens += len(chunk.tokens)
            if job.predicted is not None:
                job.tokens += chunk.tokens
            job.texts.append(chunk.text)
            job.logprobs += chunk.logprobs or []
            if chunk.prompt_logprobs is not None:
                job.prompt_logprobs = chunk.prompt_logprobs
            state.metrics.step(job, chunk, at)
            if chunk.finish_reason is not None:
                state.metrics.finished(job, chunk.stats, FINISH_REASONS.get(chunk.finish_reason, "error"), at)
            yield chunk
    finally:
        if job.deadline is not None:
            job.deadline.cancel()
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
    details = [p["completion_tokens_details"] for p in parts if "completion_tokens_details" in p]
    if details:
        total["completion_tokens_details"] = {k: sum(d[k] for d in details) for k in details[0]}
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
