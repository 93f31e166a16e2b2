"""`assistgen info` as a user runs it, and a model that is not row-exact saying so: a warning, the statistics,
/health and /metrics (the real server, HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import httpx
import pytest
from helpers import scrape, start, stop

from assistgen import generate, load_model

pytestmark = pytest.mark.integration


def info(*flags: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assistgen.cli.main", "info", *flags], capture_output=True,
                          text=True, timeout=120, check=True, env={**os.environ, "ASSISTGEN_CACHE": str(cache)})


def test_info_names_the_row_exact_build_the_cpu_and_what_the_cache_holds(tmp_path):
    cache = tmp_path / "cache"
    (cache / "models" / "a-model").mkdir(parents=True)
    (cache / "models" / "a-model" / "weights.bin").write_bytes(b"x" * 3000)
    (cache / "costs").mkdir()
    (cache / "costs" / "a-model-123.json").write_text("{}")

    found = json.loads(info("--json", cache=cache).stdout)
    assert found["backends"]["llama.cpp"]["row_exact"] is True  # make's build carries the patch
    assert found["packages"]["torch"] and found["packages"]["assistgen"]
    folders = {f["kind"]: f for f in found["cache"]["folders"]}
    assert folders["models"]["entries"] == [{"name": "a-model", "bytes": 3000}]
    assert folders["costs"]["bytes"] == 2 and found["cache"]["bytes"] == 3002
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert ("avx2" in found["cpu"]["flags"]) == ("avx2" in flags)
    assert ("avx512f" in found["cpu"]["flags"]) == ("avx512f" in flags)

    text = info(cache=cache).stdout
    assert "row-exact (patched" in text and "a-model" in text and "2.9 KiB" in text
    assert f"rm -rf {cache}" in text


def test_a_row_exact_model_loads_without_a_warning_and_says_exact():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model = load_model("smollm2-135m", backend="llama.cpp", context=512)
    assert model.capabilities.exact
    assert generate(model, "1, 2, 3, 4,", lookup=True, max_new_tokens=8).stats.exact


def test_a_model_that_is_not_row_exact_warns_once_and_says_so_in_stats_health_and_metrics(one_thread):
    with pytest.warns(RuntimeWarning, match="flash attention is off.*leave flash_attention on"):
        model = load_model("smollm2-135m", backend="llama.cpp", context=512, flash_attention=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # once per process and reason
        load_model("smollm2-135m", backend="llama.cpp", context=512, flash_attention=False)
    assert not model.capabilities.exact
    result = generate(model, "1, 2, 3, 4,", lookup=True, max_new_tokens=8)
    assert not result.stats.exact and "exact: no" in result.stats.summary()

    live = start(model, max_tokens_limit=8)
    try:
        health = httpx.get(f"{live.url}/health", timeout=5).json()
        assert health["exact"] is False and "flash attention" in health["inexact_reason"]
        assert scrape(live)["assistgen:exact"] == 0
        reply = live.client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=4)
        assert reply.model_extra["metrics"]["speculative_decoding"]["exact"] is False
    finally:
        stop(live)
