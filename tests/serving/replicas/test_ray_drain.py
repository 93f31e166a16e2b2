"""Shutdown on replicas: `assistgen serve --replicas 1` sent SIGTERM in the middle of streams answers new requests
503 at its ingress, lets the replicas' running requests finish within --shutdown-grace, ends the rest with a final
chunk and [DONE], and exits 0, as one process does (tests/serving/test_shutdown.py). The real command on a local
Ray cluster (127.0.0.1), spoken to over HTTP; `make test-ray` runs it."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from helpers import final_reasons, read_stream, start_serve_command

NAME = "smollm2-135m"


# grace-over: 3 s, far less than the ~25 s the streams need, yet long enough that the late request (0.5 s after the
# signal) still finds the ingress up; with 0 s the whole stop could be over before it arrives.
@pytest.mark.parametrize("grace", [3.0, 60.0], ids=["grace-over", "grace-enough"])
def test_sigterm_mid_stream_on_replicas_ends_every_stream_well_and_exits_0(grace):
    process, port = start_serve_command("--model", NAME, "--backend", "torch", "--replicas", "1",
                                        "--cpus-per-replica", "1", "--max-batch", "2", "--shutdown-grace", str(grace),
                                        timeout=300)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        outs = [{} for _ in range(3)]  # two running, one waiting (--max-batch 2)
        firsts = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=read_stream, args=(url, NAME, 300, out, first))
                   for out, first in zip(outs, firsts, strict=True)]
        for thread in threads:
            thread.start()
        assert firsts[0].wait(120) and firsts[1].wait(120)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = httpx.post(f"{url}/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        for thread in threads:
            thread.join(180)
        assert process.wait(180) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reasons = final_reasons(outs)  # every stream: one final chunk, then [DONE]
    if grace > 30:
        assert set(reasons) <= {"stop", "length"}  # each finished within the grace
    else:
        assert "abort" in reasons  # the grace was over before they were: ended, each with its final chunk
