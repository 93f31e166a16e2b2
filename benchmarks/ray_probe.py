"""What Ray Serve adds per request, apart from the model: medians of requests to an idle server, one process at a
time.

Contract: starts `assistgen serve` (one process, no Ray) or the Ray Serve application (`--ray`, one replica with
`--cpus-per-replica` CPUs) on a free 127.0.0.1 port, then times with httpx, 20 times each: `GET /v1/models` (no
model work), `GET /metrics` (on Ray, answered by the ingress itself: one hop less), a 1-token completion, and a
48-token streamed completion (8 times). Prints one line of medians in ms.

    python benchmarks/ray_probe.py            # the single process
    python benchmarks/ray_probe.py --ray --cpus-per-replica 1
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_ms(fn, n: int = 20) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def probe(url: str) -> dict:
    http = httpx.Client(timeout=120)
    one = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
    long = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 48, "stream": True}
    http.post(f"{url}/v1/completions", json=one).raise_for_status()  # warm-up

    def stream() -> None:
        with http.stream("POST", f"{url}/v1/completions", json=long) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass

    return {"models": median_ms(lambda: http.get(f"{url}/v1/models")),
            "metrics": median_ms(lambda: http.get(f"{url}/metrics")),
            "one_token": median_ms(lambda: http.post(f"{url}/v1/completions", json=one)),
            "stream_48": median_ms(stream, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray", action="store_true")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.ray:
        from assistgen.backends.settings import LoadSettings
        from assistgen.serving.assembly import ServerSpec
        from assistgen.serving.ray import ReplicaOptions, start, stop

        start(ServerSpec(MODEL, LoadSettings(backend=args.backend)),
              ReplicaOptions(replicas=1, cpus_per_replica=args.cpus_per_replica), "127.0.0.1", port, num_cpus=2)
        try:
            result = probe(url)
        finally:
            stop()
    else:
        cli = Path(sys.executable).with_name("assistgen")
        server = subprocess.Popen([str(cli), "serve", "--model", MODEL, "--backend", args.backend, "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                try:
                    httpx.get(f"{url}/v1/models")
                    break
                except httpx.TransportError:
                    time.sleep(0.5)
            result = probe(url)
        finally:
            server.terminate()
            server.wait()
    label = f"ray, 1 replica, {args.cpus_per_replica:g} CPU" if args.ray else "one process"
    print(f"{label}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
