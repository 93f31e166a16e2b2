"""Shutdown that loses nothing: `assistgen serve` sent SIGTERM in the middle of streams answers new requests 503,
lets the running ones finish within --shutdown-grace, ends the rest with a final chunk and [DONE], and exits 0. The
real command, spoken to over HTTP; no mocks."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from helpers import start_serve_command

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
LONG = "the cat sat on the mat. " * 8 + "the cat sat on the"  # (greedy, it goes on repeating: long streams)


def stream(url: str, max_tokens: int, out: dict, first: threading.Event) -> None:
    """One streamed completion read to its end: its events, and whether [DONE] came."""
    events, done = [], False
    body = {"model": NAME, "prompt": LONG, "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    first.set()
    except httpx.HTTPError as e:  # a dropped connection: what this test must never see
        out["error"] = repr(e)
    out["events"], out["done"] = events, done


@pytest.mark.parametrize("grace", [0.0, 60.0], ids=["grace-over", "grace-enough"])
def test_sigterm_mid_stream_ends_every_stream_well_and_exits_0(grace):
    process, port = start_serve_command("--model", NAME, "--max-batch", "2", "--shutdown-grace", str(grace))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        outs = [{} for _ in range(3)]  # two running, one waiting (--max-batch 2)
        firsts = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=stream, args=(url, 300, out, first))
                   for out, first in zip(outs, firsts, strict=True)]
        for thread in threads:
            thread.start()
        assert firsts[0].wait(60) and firsts[1].wait(60)
        process.send_signal(signal.SIGTERM)
        if grace:  # (with none, the server stops listening at once)
            time.sleep(0.3)
            late = httpx.post(f"{url}/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        for thread in threads:
            thread.join(120)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reasons = []
    for out in outs:
        assert "error" not in out and out["status"] == 200 and out["done"], out  # every stream ended with [DONE]
        last = [e["choices"][0]["finish_reason"] for e in out["events"] if e["choices"][0]["finish_reason"]]
        assert len(last) == 1, out["events"][-3:]  # ... after exactly one final chunk
        reasons.append(last[0])
    if grace:
        assert set(reasons) <= {"stop", "length"}  # each finished within the grace
    else:
        assert "abort" in reasons  # the grace was over before they were: ended, each with its final chunk
