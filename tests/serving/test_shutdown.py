"""Shutdown that loses nothing: `assistgen serve` sent SIGTERM in the middle of streams answers new requests 503,
lets the running ones finish within --shutdown-grace, ends the rest with a final chunk and [DONE], and exits 0. The
real command, spoken to over HTTP; no mocks."""

from __future__ import annotations

import pytest
from helpers import sigterm_mid_streams, start_serve_command

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"


@pytest.mark.parametrize("grace", [0.0, 60.0], ids=["grace-over", "grace-enough"])
def test_sigterm_mid_stream_ends_every_stream_well_and_exits_0(grace):
    process, port = start_serve_command("--model", NAME, "--max-batch", "2", "--shutdown-grace", str(grace))
    # (with no grace the server stops listening at once: no request is sent during the drain)
    reasons = sigterm_mid_streams(process, f"http://127.0.0.1:{port}/v1", NAME, late_after=0.3 if grace else None,
                                  wait=60)
    if grace:
        assert set(reasons) <= {"stop", "length"}  # each finished within the grace
    else:
        assert "abort" in reasons  # the grace was over before they were: ended, each with its final chunk
