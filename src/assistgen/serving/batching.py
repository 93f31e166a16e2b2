"""The serving engine: one thread steps every running request together through the generation loop.

Contract: `BatchEngine(target, make_drafter, schedule, settings)` owns a target model and the thread
its loop runs on: its own (`start`) or the caller's (`run_forever`). `make_drafter` is a `drafters.factory.
DrafterFactory` (a plain callable is taken too: `DrafterFactory.of`), whose declared context bounds every request
(`context`) and whose declared models are the ones the engine measures while idle.
`admit(prompt_ids, config, drafter=None)` is a request's admission (`core.admission`: the context, the prompt's
check, the grammar compiled), run on the caller's thread: a bad prompt or a grammar that does not compile raises
`ConfigError` there (`admission.PromptError` for the prompt). `submit(prompt_ids, config, on_chunk, drafter=None)`
admits a request so (or takes an `Admission` made by `admit`) and queues it (raises `QueueFull` past
`settings.max_queue` waiting requests) and returns its `Request` handle; the engine thread starts waiting requests
between steps from their admissions (at most `settings.max_batch` run at once; nothing is checked or compiled
again) and delivers each request's `engine.Chunk`s, in order, to `on_chunk` (called on the engine thread, each
chunk's `stats` a snapshot: the engine thread keeps updating its own; by default they go to a queue that iterating
the `Request` reads). The last chunk of a request has its
`finish_reason` set: length | eos | stop | context, or "cancelled" (`Request.cancel()`, e.g. a client
that went away: its rows are freed before the next step; the reason it was given, e.g. "timeout" for a server's
deadline), or "error" (`Request.error` says what).
`shutdown()` stops admitting requests, lets the running ones finish (or cancels them) and waits for
the loop to return. Each request gets its own drafter: the one given to `submit`, else a fresh one from
`make_drafter()` (drafters hold per-request state: caches, estimates), its own sampler and schedule
run; only the target and its weights are shared. Greedy output of a request is the output
`engine.stream` gives for it alone. While no request runs or waits, the engine times the passes of its models
(its target, its drafters' models) whose cost measurement was left for later (`policy.costs.pending`), one pass
at a time; a request that arrives drops the stage half done (to be timed again from its start), so a request
waits at most one pass, and holds the measurement off while the engine serves (`Calibration.hold`): another
engine sharing the model never times a pass of it then.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from assistgen.backends.base import Cache, LanguageModel
from assistgen.config import ConfigError, GenerationConfig
from assistgen.core.admission import Admission, admit, context_limit
from assistgen.core.engine import begin, step
from assistgen.core.prefix import PrefixCache, check_capacity, default_capacity, fork_or_none, give_back, take_for
from assistgen.core.state import Chunk, GenerationState
from assistgen.drafters.factory import DrafterFactory
from assistgen.policy.costs import Calibration, pending
from assistgen.spec.drafts import Drafter
from assistgen.spec.steps import Schedule


class QueueFull(RuntimeError):
    """More requests are waiting than the engine accepts (`EngineSettings.max_queue`)."""


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int = 8  # requests stepped together
    max_queue: int = 64  # requests waiting to join; one more is refused with QueueFull
    prefill_budget: int = 256  # prompt tokens fed per step over all joining requests, so running streams keep flowing
    # Bytes of finished requests' keys and values kept for prefix reuse (`core.prefix`); 0: none kept; None: the
    # default (`prefix.default_capacity`). On llama.cpp the model's pool must have been loaded with as many cells beyond
    # its context (`LlamaSettings.kept_bytes`, whose "auto" is the same default).
    prefix_cache: int | None = 0

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "prefill_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        value = self.prefix_cache
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"prefix_cache must be a number of bytes >= 0 (or None: the default), got {value!r}")


_ids = itertools.count(1)


class Request:
    """One submitted request: its chunks arrive in order; the last one has `finish_reason` set."""

    def __init__(self, admitted: Admission, on_chunk: Callable[[Chunk], None] | None,
                 drafter: Drafter | None = None, namespace: str | None = None, public: int = 0,
                 siblings: list[Request] | None = None):
        self.id = f"req-{next(_ids)}"
        self.siblings = siblings if siblings is not None else []  # the choices of one prompt (n > 1), itself among
        # them: one feeds the prompt, the others start from a fork of its cache
        self.siblings.append(self)
        self.admitted = admitted
        self.prompt_ids = admitted.prompt_ids
        self.config = admitted.config
        self.drafter = drafter  # None: the engine's make_drafter() makes one
        self.namespace = namespace  # whose kept prefixes it may reuse and feed (None: none)
        self.public = public  # its prompt's first tokens that hold no one's content (`core.prefix`: shared by all)
        self.error: str | None = None
        self.cancelled = threading.Event()
        self.cancel_reason = "cancelled"  # the finish reason its last chunk gives once cancelled ("timeout", ...)
        self.done = threading.Event()
        self._queue: queue.Queue[Chunk] | None = None if on_chunk is not None else queue.Queue()
        self._on_chunk = on_chunk if on_chunk is not None else self._queue.put

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating for this request; the engine frees its rows before the next step, and its last chunk
        gives `reason` as its finish reason (the first reason given)."""
        if not self.cancelled.is_set():
            self.cancel_reason = reason
        self.cancelled.set()

    def deliver(self, chunk: Chunk) -> None:
        """Hand a chunk to the request's consumer, on another thread: its stats a snapshot, not the engine's own."""
        if chunk.stats is not None:
            chunk = replace(chunk, stats=chunk.stats.snapshot())
        if chunk.finish_reason is not None:
            self.done.set()
        self._on_chunk(chunk)

    def __iter__(self) -> Iterator[Chunk]:
        if self._queue is None:
            raise RuntimeError("this request delivers its chunks to on_chunk")
        while True:
            chunk = self._queue.get()
            yield chunk
            if chunk.finish_reason is not None:
                return


class BatchEngine:
    def __init__(self, target: LanguageModel, make_drafter: DrafterFactory | Callable[[], Drafter],
                 schedule: Schedule, settings: EngineSettings | None = None):
        self.target = target
        self.make_drafter = DrafterFactory.of(make_drafter)
        self.context = context_limit(target, self.make_drafter.context_length)  # the longest a request may grow
        self.schedule = schedule
        self.settings = settings or EngineSettings()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.accepting = True
        self.thread: threading.Thread | None = None
        self.largest_batch = 0  # the most requests stepped together so far
        self.finished = threading.Event()  # set when the loop has returned
        self.prefix = prefix_cache_for(target, self.settings)  # touched by the engine thread only
        self.models = served_models(target, self.make_drafter)  # whose left-for-later cost measurements it runs

    # --- the client side ----------------------------------------------------------------------------------

    def start(self) -> BatchEngine:
        """Run the loop on a thread of its own (no-op when it already runs, e.g. in `run_forever`)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="assistgen-engine", daemon=True)
            self.thread.start()
        return self

    def run_forever(self, claimed: Callable[[], None] | None = None) -> None:
        """Run the loop in the calling thread until `shutdown` (from another thread) has drained it; `claimed` is
        called once the engine belongs to this thread (e.g. to start the HTTP server, whose `start` is then a
        no-op). The command line server runs it in the main thread, where PyTorch's multi-threaded CPU kernels
        (attention) run faster than from a second Python thread (docs/benchmarks.md, serving)."""
        if self.thread is not None:
            raise RuntimeError("the engine already runs")
        self.thread = threading.current_thread()
        if claimed is not None:
            claimed()
        self._run()

    def admit(self, prompt_ids: list[int], config: GenerationConfig, drafter: Drafter | None = None) -> Admission:
        """A request's admission, on the caller's thread, for its own drafter or (None) the engine's
        (`admission.admit`: ConfigError for a bad prompt or a grammar that does not compile)."""
        limit = drafter.context_length if drafter is not None else self.make_drafter.context_length
        return admit(self.target, prompt_ids, config, limit)

    def submit(self, prompt: list[int] | Admission, config: GenerationConfig | None = None,
               on_chunk: Callable[[Chunk], None] | None = None, drafter: Drafter | None = None,
               namespace: str | None = None, public: int = 0, sibling: Request | None = None) -> Request:
        """Queue a request: `prompt` its ids, admitted here with `config`, or an `Admission` that `admit` made (for
        the same `drafter`; `config` then None). `namespace`: whose kept prefixes it reuses and whose it feeds
        (None: it neither reuses nor leaves any); `public`: how many of its first tokens hold no one's content (a chat
        template's opening, `chat.templates.template_prefix`): kept rows of those may come from any request.
        `sibling`: a request queued before for the same prompt (another choice of it, n > 1): this one waits while
        they are feeding the prompt and starts from a fork of the cache of one that has fed it (`sibling_fork`)."""
        if isinstance(prompt, Admission):
            if config is not None:
                raise ValueError("submit: an admitted request carries its config: give config=None")
            admitted = prompt
        else:
            admitted = self.admit(prompt, config, drafter)
        if sibling is not None and sibling.prompt_ids != admitted.prompt_ids:
            raise ValueError("submit: a sibling request must have the same prompt")
        request = Request(admitted, on_chunk, drafter, namespace, public,
                          sibling.siblings if sibling is not None else None)
        with self.lock:
            if not self.accepting:
                raise QueueFull("The server is shutting down and accepts no new requests.")
            if len(self.waiting) >= self.settings.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue "
                                f"{self.settings.max_queue}): retry later.")
            self.waiting.append(request)
            self.lock.notify_all()
        return request

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests; finish the running and waiting ones (or cancel them); join the thread."""
        with self.lock:
            self.accepting = False
            if cancel:
                for request in [*self.running, *self.waiting]:
                    request.cancel()
            self.lock.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.finished.wait(timeout)

    def _measurable(self) -> list[Calibration]:
        """The cost measurements of its models it may run now (no other engine serves requests on them)."""
        return [c for c in pending(self.models) if c.free_for(self)]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- the engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            for calibration in pending(self.models):  # (it serves them no more)
                calibration.release(self)
            self.finished.set()

    def _loop(self) -> None:
        active: list[tuple[Request, GenerationState]] = []
        while True:
            if not active and not self.waiting:
                for calibration in pending(self.models):  # (idle: it serves none of them now)
                    calibration.release(self)
            with self.lock:
                while not self.waiting and not active and self.accepting and not self._measurable():
                    self.lock.wait(0.5)  # with a timeout: a main thread waiting here still takes signals
                if not self.waiting and not active:
                    if not self.accepting:
                        return  # shut down and drained
                    joining = None  # idle, with costs left to measure
                else:
                    joining = self._joining(active)
            if joining is None:
                for calibration in self._measurable()[:1]:
                    measure_a_pass(calibration, self)
                continue
            if joining:
                for calibration in pending(self.models):  # (its half-done stage's caches freed for the requests)
                    calibration.hold(self)
            active += [(r, s) for r in joining if (s := self._begin(r, sibling_fork(r, active))) is not None]
            active = [(r, s) for r, s in active if not self._cancelled(r, s)]
            self.running = [r for r, _ in active]
            if not active:
                continue
            self.largest_batch = max(self.largest_batch, len(active))
            try:
                chunks = step([s for _, s in active], self.settings.prefill_budget)
            except Exception as e:  # noqa: BLE001 - a failed step ends its requests, not the engine
                for request, s in active:
                    request.error = f"{type(e).__name__}: {e}"
                    request.deliver(Chunk([], "", "error"))
                    free_rows(s)
                active = []
                self.running = []
                continue
            for (request, _), chunk in zip(active, chunks, strict=True):
                if chunk is not None:
                    request.deliver(chunk)
            for request, s in active:
                if s.finish is not None:
                    self._release(request, s)
            active = [(r, s) for r, s in active if s.finish is None]
            self.running = [r for r, _ in active]

    def _joining(self, active: list[tuple[Request, GenerationState]]) -> list[Request]:
        """The waiting requests that start now, in order, up to `max_batch` running: all but those whose sibling is
        feeding their prompt or starts now (they start from its cache once it has fed it), which keep their place."""
        joining, held = [], []
        while self.waiting and len(active) + len(joining) < self.settings.max_batch:
            request = self.waiting.popleft()
            feeding = sibling_feeding(request, active) or any(r in request.siblings for r in joining)
            (held if feeding else joining).append(request)
        self.waiting.extendleft(reversed(held))
        return joining

    def _begin(self, request: Request, shared: Cache | None = None) -> GenerationState | None:
        """The request's sequence in the loop, from its admission and `shared` (a sibling's cache holding the prompt
        but its last token) or the longest prefix kept for its namespace; None (its error delivered) when it cannot
        start."""
        cache = shared
        try:
            drafter = request.drafter if request.drafter is not None else self.make_drafter()
            if cache is None:
                cache = take_for(self._prefix(request), request.prompt_ids, request.namespace, request.config,
                                 request.public)
            return begin(self.target, request.prompt_ids, drafter, self.schedule, request.config, cache,
                         request.admitted)
        except Exception as e:  # noqa: BLE001
            if cache is not None:
                cache.crop(0)
            request.error = f"{type(e).__name__}: {e}"
            request.deliver(Chunk([], "", "error"))
            return None

    def _release(self, request: Request, sequence: GenerationState) -> None:
        """A finished request's cache: kept for its namespace's next requests, or its rows given back now."""
        give_back(self._prefix(request), sequence.cache, request.namespace, request.public)

    def _prefix(self, request: Request) -> PrefixCache | None:
        """The prefix cache a request reuses and feeds: the engine's, when the request names a namespace."""
        return self.prefix if request.namespace is not None else None

    def _cancelled(self, request: Request, sequence: GenerationState) -> bool:
        """Whether the request was cancelled; its last chunk is then delivered and its rows are released."""
        if not request.cancelled.is_set():
            return False
        self._release(request, sequence)
        sequence.stats.finish_reason = request.cancel_reason
        request.deliver(Chunk([], "", request.cancel_reason, sequence.stats))
        return True


def running_siblings(request: Request, active: list[tuple[Request, GenerationState]]) -> list[GenerationState]:
    return [s for r, s in active if r is not request and r in request.siblings]


def sibling_feeding(request: Request, active: list[tuple[Request, GenerationState]]) -> bool:
    """Whether a running sibling of `request` is still feeding their prompt (and none has fed it yet)."""
    running = running_siblings(request, active)
    return any(s.prefilling for s in running) and not any(not s.prefilling for s in running)


def sibling_fork(request: Request, active: list[tuple[Request, GenerationState]]) -> Cache | None:
    """A fork of a running sibling's cache cut to `request`'s prompt but its last token (what the loop feeds first),
    or None: no sibling has fed the prompt, prompt logprobs are asked for (they need every row fed), or the backend
    has no sequence left to fork into."""
    if len(request.siblings) < 2 or request.config.prompt_logprobs is not None:
        return None
    length = len(request.prompt_ids) - 1
    for state in running_siblings(request, active):
        if not state.prefilling and state.finish is None and len(state.cache) >= length > 0:
            cache = fork_or_none(state.cache)
            if cache is not None:
                cache.crop(length)
                return cache
    return None


def prefix_cache_for(target: LanguageModel, settings: EngineSettings) -> PrefixCache | None:
    """The engine's prefix cache (None when `settings.prefix_cache` is 0): at most `prefix_cache` bytes, and on a
    backend with a bounded number of sequences as many entries as leave room for a full batch and its forks."""
    capacity = default_capacity(target) if settings.prefix_cache is None else settings.prefix_cache
    if not capacity:
        return None
    check_capacity(target, capacity)
    limit = target.max_sequences
    entries = None if limit is None else max(1, limit - 2 * settings.max_batch)
    return PrefixCache(target, capacity, entries)


def served_models(target: LanguageModel, make_drafter: DrafterFactory) -> list:
    """The models an engine runs: its target and the models its drafter factory declares."""
    return [target] + [m for m in make_drafter.models if m is not target]


def measure_a_pass(calibration: Calibration, engine: object = None) -> None:
    """One timed pass of a model's cost measurement, run while the engine is idle; a measurement that fails (its
    model's sequences taken by kept prefixes, say) is given up, the provisional costs kept."""
    try:
        calibration.advance(engine)
    except Exception as e:  # noqa: BLE001 - the server serves on the provisional costs
        calibration.abandon()
        print(f"assistgen: measuring {calibration.model.name}'s pass costs failed ({type(e).__name__}: {e}); the "
              "policy keeps its provisional costs (`assistgen calibrate` measures them).", file=sys.stderr)


def free_rows(sequence: GenerationState) -> None:
    """Give back a finished sequence's cache rows now, not when it is garbage collected (on llama.cpp its cells and
    its sequence id go back to the pool)."""
    sequence.cache.crop(0)
