"""Offloaded weights (`max_memory`, `--max-memory`): budgets parsed and checked, and speculation run for real under a
memory cap below the weights (a cgroup v1 memory group, `bench.memory_group`), exact and inside the cap.

The cap test runs SmolLM2-135M (llama.cpp backend, a private copy of its file) in a child process twice: first in a
group with no real limit, for plain decoding's tokens and the most anonymous memory the run needs (what the kernel
cannot evict), then in a group limited to that, where while decoding the room left for file pages is a third of the
model's file, so that its weight pages are read from the file again and again. It needs root and
the v1 memory controller (as the machines `make test` runs on have).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from assistgen import ConfigError, ModelLoadError, generate, load_model
from assistgen.backends.budget import parse_budget
from assistgen.backends.llamacpp.loading import gguf_file
from assistgen.bench.memory_group import MemoryGroup, cgroups_available, drop_from_page_cache

NAME = "smollm2-135m"
PROMPT = ("Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, "
          "melons.\n")
TOKENS = 40
CHILD = f"""
import json, sys
from assistgen import generate, load_model
from assistgen.backends.budget import resident
budget, gguf, limit, room = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = load_model(gguf, backend="llama.cpp", context=512, max_memory=budget)
# Loading needs more anonymous memory for a moment than decoding does; what it gives back would leave the weights
# room to stay. Other memory in use (a ballast, touched) keeps the room for file pages near `room` while decoding.
ballast = bytes([1]) * max(0, limit - resident()["anon"] - room)
runs = {{}}
for name, kwargs in (("plain", {{}}), ("lookup", {{"lookup": True}}), ("ngram", {{"ngram_cache": True}})):
    out = generate(model, {PROMPT!r}, max_new_tokens={TOKENS}, **kwargs)
    runs[name] = {{"tokens": out.token_ids, "drafted": out.stats.drafted_tokens, "accepted": out.stats.accepted_tokens}}
print("RESULT " + json.dumps({{"runs": runs, "repack": model.settings.repack, "budget": model.settings.max_memory}}))
"""


def test_budgets_parse_in_bytes_and_units():
    assert parse_budget(1234) == 1234
    assert parse_budget("800MB") == 800 * 10**6
    assert parse_budget("1.5 GiB") == int(1.5 * 2**30)
    assert parse_budget("2g") == 2 * 10**9
    for bad in ("lots", "0", "-5MB", "12 parsecs", True, 0):
        with pytest.raises(ConfigError, match="max_memory"):
            parse_budget(bad)


def test_a_budget_below_what_must_stay_resident_names_the_smallest_that_works():
    with pytest.raises(ModelLoadError, match=r"give at least (\d+) MB") as caught:
        load_model(NAME, backend="llama.cpp", context=512, max_memory="1MB")
    least = int(re.search(r"give at least (\d+) MB", str(caught.value)).group(1))
    assert "one layer's weights" in str(caught.value) and "KV cache" in str(caught.value)
    model = load_model(NAME, backend="llama.cpp", context=512, max_memory=f"{least + 20}MB")  # the named one works
    assert model.settings.max_memory == (least + 20) * 10**6 and model.settings.repack is False  # no anonymous copy
    assert generate(model, "Hello", max_new_tokens=4).token_ids


def test_the_torch_backend_refuses_a_budget_naming_llama_cpp():
    with pytest.raises(ModelLoadError, match="llama.cpp backend only"):
        load_model(NAME, backend="torch", max_memory="1GB")


def run_in_group(limit: int, room: int, gguf) -> tuple[dict, dict]:
    """CHILD on `gguf` in a fresh group of `limit` bytes (leaving about `room` for file pages while it decodes): its
    result, and the group's peak, peak anonymous memory and pages in."""
    drop_from_page_cache(gguf)
    group = MemoryGroup(limit)
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, "400MB", str(gguf), str(limit), str(room)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=group.add_self)
        anon = 0
        while child.poll() is None:
            anon = max(anon, group.stat("total_rss"))
            time.sleep(0.05)
        out, err = child.communicate()
        assert child.returncode == 0, (child.returncode, err[-3000:])
        seen = {"peak": group.peak(), "anon": anon, "pgpgin": group.stat("total_pgpgin")}
    finally:
        group.remove()
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), seen


@pytest.mark.skipif(cgroups_available() is not None, reason=f"memory cgroups: {cgroups_available()}")
def test_speculation_under_a_cap_below_the_weights_is_exact_and_stays_inside_it(tmp_path):
    # A private copy of the file: pages another process has mapped stay charged to it, and would not stream here.
    gguf = tmp_path / "smollm2-135m-copy.gguf"
    shutil.copyfile(gguf_file(NAME), gguf)
    weights = gguf.stat().st_size
    free_result, free = run_in_group(1 << 40, 1 << 40, gguf)  # no cap: plain decoding's tokens, and the most
    # anonymous memory the run needs (while loading)
    reference = free_result["runs"]["plain"]["tokens"]
    assert len(reference) == TOKENS
    limit = free["anon"] + 16 * 10**6
    result, capped = run_in_group(limit, weights // 3, gguf)  # room for about a third of the weights' pages
    runs = result["runs"]
    assert result["repack"] is False
    for name, run in runs.items():
        assert run["tokens"] == reference, name  # greedy: the same tokens as plain decoding without a cap
    assert runs["lookup"]["accepted"] > 0 and runs["ngram"]["accepted"] > 0  # drafting happened, and was kept
    assert capped["peak"] <= limit
    # the weights did not fit: their pages were read in again and again (3 runs of about 40 passes), many times the
    # file more than the same run with room for everything (its anonymous pages are charged to both alike)
    assert (capped["pgpgin"] - free["pgpgin"]) * 4096 > 5 * weights, (capped, free, weights)
