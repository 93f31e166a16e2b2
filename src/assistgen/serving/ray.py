"""`assistgen serve --replicas N`: the OpenAI-compatible server as replicas on Ray Serve.

Contract: `application(spec, options)` builds a Ray Serve application of two deployments:
- `Replica` (N of them, or autoscaled on ongoing requests): each wires the single-process server from the same
  `assembly.ServerSpec` as `assistgen serve` does (`assembly.build_server`) and runs its app, called in-process
  as an ASGI app
  (`call_app`), so that every endpoint, check, error body and stream is the single-process server's;
- `Ingress` (one, behind Ray Serve's HTTP proxy): takes each HTTP request and hands its method, path, headers
  and body to a replica through a streaming deployment handle, and relays status, headers and body chunks.
Routing: a request with an API key (the bearer token) goes out with a multiplexed model id derived from the key
(`route_key`): Ray Serve's model-multiplexing router sends it to a replica that has served that key before
(the replica's `namespace` loader marks it), so that its n-gram cache namespace, which lives per replica,
keeps drafting from the key's earlier requests; a request without a key goes to the least loaded replica
(Serve's default router), as every request does with `ReplicaOptions.route_by_key` False. A replica that
dies mid-stream ends the stream with an error event and `[DONE]` (an HTTP 503 when it dies before answering);
Ray Serve's controller starts a replacement.
`/metrics` on the ingress is each replica's own Prometheus registry merged: every replica pushes its samples
to the ingress every `METRICS_PUSH_S` seconds; counters and histograms are added up over the replicas,
gauges over the replicas heard from in the last `STALE_S` seconds. Per request nothing is kept; per replica
live the model, the engine, the n-gram caches of the keys routed there and the metrics.
The ingress checks API keys and body sizes (`gate.Gate`, the replicas' settings) before it forwards anything.
`run(spec, options, host, port, address)` starts (or joins) Ray, runs the application until SIGINT/SIGTERM
and shuts Serve down; `assistgen serve` without --replicas never imports Ray.
Shutdown (`drain`) as on one process: the first signal tells the ingress to answer new requests 503; each replica
hears of it with its next metrics push (within `METRICS_PUSH_S`) and drains as one process does (`server.drain`:
what is running gets the grace left, `ServerSettings.shutdown_timeout`, and the rest ends with its final chunk);
Serve is shut down once the ingress relays no stream (or the grace and two pushes are over).
"""

# (no `from __future__ import annotations`: Serve's ingress hands FastAPI the handlers' annotations as they are)

import asyncio
import hashlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest  # (at module level: FastAPI resolves the handlers' annotations here)

from assistgen.config import ConfigError
from assistgen.serving.app_state import ServerSettings
from assistgen.serving.assembly import ServerSpec, build_server
from assistgen.serving.gate import Gate, openness
from assistgen.serving.server import drain as drain_server

METRICS_PUSH_S = 1.0
STALE_S = 10.0
NO_KEY = ""  # the multiplexed model id of a request without an API key: no affinity


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas and what each may use; `max_replicas` above `replicas` turns autoscaling on."""

    replicas: int = 2
    max_replicas: int | None = None  # autoscaling between `replicas` and this many
    target_ongoing_requests: float = 4.0  # autoscaling's target of ongoing requests per replica
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 64  # per replica (the engine's own queue bounds it further)
    route_by_key: bool = True  # False: every request goes to the least loaded replica (to measure what keys bring)

    def __post_init__(self):
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.replicas}.")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(f"--max-replicas ({self.max_replicas}) is below --replicas ({self.replicas}).")
        if self.cpus_per_replica <= 0:
            raise ConfigError(f"--cpus-per-replica must be above 0, got {self.cpus_per_replica}.")

    def deployment_options(self) -> dict:
        options = {"ray_actor_options": {"num_cpus": self.cpus_per_replica},
                   "max_ongoing_requests": self.max_ongoing_requests}
        if self.max_replicas is not None and self.max_replicas > self.replicas:
            options["autoscaling_config"] = {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing_requests}
        else:
            options["num_replicas"] = self.replicas
        return options


def route_key(authorization: str | None) -> str:
    """The multiplexed model id of a request: a hash of its bearer token (the key itself never leaves the
    ingress), or NO_KEY."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return NO_KEY
    return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:32]


# --- calling an ASGI app in-process --------------------------------------------------------------------------


async def call_app(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                   gone: asyncio.Event) -> AsyncIterator[tuple[int, list[tuple[str, str]]] | bytes]:
    """Run one HTTP request through an ASGI app: yields (status, headers) first, then the body's chunks.
    Setting `gone` tells the app its client disconnected."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run_app() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run_app())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                          for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        await task


# --- the deployments ------------------------------------------------------------------------------------------


def deployments(options: ReplicaOptions, settings: ServerSettings):
    """The two deployment classes (made here: Ray is imported only when replicas are asked for); the ingress checks
    keys and body sizes as one process does (`gate.Gate`, with the replicas' `settings`)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve

    from assistgen.serving.wire.errors import error_body

    @serve.deployment(**options.deployment_options())
    class Replica:
        def __init__(self, spec: ServerSpec, ingress_name: str, app_name: str):
            # (Ray sets OMP_NUM_THREADS to the replica's CPUs, which PyTorch's and llama.cpp's threads follow)
            server = build_server(spec)  # (the CLI's own wiring: the same models, drafters, engine and app)
            self.app, self.engine = server.app(), server.engine
            self.engine.start()
            self.pid = os.getpid()
            self.ingress = serve.get_deployment_handle(ingress_name, app_name)
            self.draining = False
            threading.Thread(target=self.push_metrics, name="assistgen-metrics", daemon=True).start()

        @serve.multiplexed(max_num_models_per_replica=4096)
        async def namespace(self, key: str) -> str:
            return key  # ("loading" a key only marks this replica as the one its requests go to)

        async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes):
            key = serve.get_multiplexed_model_id()
            if key:
                await self.namespace(key)
            gone = asyncio.Event()
            first = True
            try:
                async for item in call_app(self.app, method, path, headers, body, gone):
                    if first:
                        status, out_headers = item
                        item = (status, out_headers + [("x-assistgen-replica", str(self.pid))])
                        first = False
                    yield item
            finally:
                gone.set()  # (a caller that stopped reading: the app cancels the engine request)

        def push_metrics(self) -> None:
            """Every METRICS_PUSH_S: this replica's metrics to the ingress, which answers with the grace left when
            the server is shutting down (then this replica drains as one process does)."""
            from prometheus_client import generate_latest

            while True:
                try:
                    text = generate_latest(self.app.state.metrics.registry).decode()
                    grace = self.ingress.report.remote(str(self.pid), text).result(timeout_s=METRICS_PUSH_S * 5)
                except Exception:  # noqa: BLE001 - the ingress may be starting or gone: try again later
                    grace = None
                if grace is not None and not self.draining:
                    self.draining = True
                    threading.Thread(target=drain_server, args=(self.app.state.assistgen, grace),
                                     name="assistgen-drain", daemon=True).start()
                time.sleep(METRICS_PUSH_S)

        def __del__(self):
            self.engine.shutdown(cancel=True, timeout=5.0)

    http = FastAPI(title="assistgen (Ray Serve)")
    http.add_middleware(Gate, settings=settings)
    if settings.allowed_origins:  # (outside the gate, as on one process)
        from fastapi.middleware.cors import CORSMiddleware

        http.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                            allow_methods=["GET", "POST"], allow_headers=["*"])

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    @serve.ingress(http)
    class Ingress:
        def __init__(self, replica, route_by_key: bool):
            self.replica = replica
            self.route_by_key = route_by_key
            self.reports: dict[str, tuple[float, str]] = {}  # replica -> (when, its metrics text)
            self.closing_at: float | None = None  # (monotonic) when the grace of a shutdown ends
            self.relaying = 0  # requests forwarded whose answer has not ended

        def report(self, replica: str, text: str) -> float | None:
            """A replica's metrics in; out, the seconds of grace left when shutting down (None: not)."""
            self.reports[replica] = (time.monotonic(), text)
            return None if self.closing_at is None else max(0.0, self.closing_at - time.monotonic())

        def drain(self, grace: float) -> None:
            self.closing_at = time.monotonic() + grace

        def busy(self) -> int:
            return self.relaying

        @http.get("/metrics")
        async def metrics(self):
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(merged_metrics(self.reports, time.monotonic()), media_type=CONTENT_TYPE_LATEST)

        @http.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(self, path: str, request: HTTPRequest):
            if self.closing_at is not None:
                return JSONResponse(error_body("The server is shutting down.", "service_unavailable"), 503)
            self.relaying += 1
            try:
                return await self.relayed(path, request)
            except BaseException:
                self.relaying -= 1
                raise

        async def relayed(self, path: str, request: HTTPRequest):
            """The replica's answer; `relaying` drops once its last byte is sent (or it fails)."""
            body = await request.body()
            headers = list(request.headers.items())
            target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
            key = route_key(request.headers.get("authorization")) if self.route_by_key else NO_KEY
            stream = self.replica.options(stream=True, multiplexed_model_id=key).call.remote(
                request.method, target, headers, body)
            try:
                status, out_headers = await stream.__anext__()
            except Exception as e:  # noqa: BLE001 - the replica died before answering
                self.relaying -= 1
                return JSONResponse(error_body(f"The replica serving this request failed: {type(e).__name__}. "
                                               "Retry: Ray Serve is replacing it.", "service_unavailable"), 503)
            kept = {k: v for k, v in out_headers if k.lower() not in ("content-length", "transfer-encoding")}
            return StreamingResponse(relay(stream, self.relayed_one), status_code=status, headers=kept,
                                     media_type=kept.get("content-type"))

        def relayed_one(self) -> None:
            self.relaying -= 1

    return Replica, Ingress


async def relay(stream, ended: Callable[[], None]) -> AsyncIterator[bytes]:
    """A replica's body chunks; a replica that dies mid-stream ends it with an error event and [DONE]. Calls `ended`
    once, when the relay is over however it ends."""
    import json

    from assistgen.serving.wire.errors import error_body

    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:  # noqa: BLE001
        message = f"The replica serving this stream failed: {type(e).__name__}. Retry the request."
        yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\ndata: [DONE]\n\n".encode()
    finally:
        ended()


def merged_metrics(reports: dict[str, tuple[float, str]], now: float) -> str:
    """The replicas' Prometheus texts as one: samples with the same name and labels added up (gauges only over
    replicas heard from in the last STALE_S seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[tuple, float] = {}
    kinds: dict[str, tuple[str, str]] = {}
    order: list[tuple] = []
    for when, text in reports.values():
        fresh = now - when <= STALE_S
        for family in text_string_to_metric_families(text):
            kinds.setdefault(family.name, (family.type, family.documentation))
            if family.type == "gauge" and not fresh:
                continue
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                if key not in totals:
                    order.append(key)
                    totals[key] = 0.0
                totals[key] += sample.value
    lines, seen = [], set()
    for family, name, labels in order:
        if family not in seen:
            seen.add(family)
            kind, doc = kinds[family]
            lines += [f"# HELP {family} {doc}", f"# TYPE {family} {kind}"]
        label_text = ",".join(f'{k}="{v}"' for k, v in labels)
        lines.append(f"{name}{{{label_text}}} {totals[(family, name, labels)]!r}" if labels
                     else f"{name} {totals[(family, name, labels)]!r}")
    return "\n".join(lines) + "\n"


# --- running it -----------------------------------------------------------------------------------------------

APP_NAME = "assistgen"


def application(spec: ServerSpec, options: ReplicaOptions):
    replica, ingress = deployments(options, spec.settings)
    return ingress.bind(replica.bind(spec, "Ingress", APP_NAME), options.route_by_key)


def start(spec: ServerSpec, options: ReplicaOptions, host: str, port: int, address: str | None = None,
          num_cpus: int | None = None):
    """Start (or join, with `address`) Ray and Serve on host:port and deploy the application; returns once every
    replica has loaded its model."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    return serve.run(application(spec, options), name=APP_NAME, route_prefix="/")


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run(spec: ServerSpec, options: ReplicaOptions, host: str, port: int, address: str | None = None) -> int:
    """`assistgen serve --replicas N`: serve until SIGINT/SIGTERM, then shut Serve down; 0 after a clean stop."""
    start(spec, options, host, port, address)
    print(openness(spec.settings, host, port), flush=True)
    print(f"assistgen: serving {spec.model} on {options.replicas} Ray Serve replicas at http://{host}:{port}/v1",
          flush=True)
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping.wait(0.5):
            pass
        stopping.clear()
        drain(spec.settings.shutdown_timeout, stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop()
    return 0


def drain(grace: float, again: threading.Event) -> None:
    """The first half of a shutdown: the ingress answers new requests 503 and tells the replicas the grace (they
    drain as one process does); returns once the ingress relays nothing, the grace and two metrics pushes are over,
    or `again` is set (a second signal)."""
    from ray import serve

    ingress = serve.get_app_handle(APP_NAME)
    try:
        ingress.drain.remote(grace).result(timeout_s=30)
        until = time.monotonic() + grace + 2 * METRICS_PUSH_S + 5.0
        while time.monotonic() < until and not again.wait(0.2) and ingress.busy.remote().result(timeout_s=30):
            pass
    except Exception as e:  # noqa: BLE001 - Serve is failing already: shut it down as it is
        print(f"assistgen: the drain stopped early ({type(e).__name__}: {e}); shutting down.", flush=True)
