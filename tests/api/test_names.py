"""A model or an assistant given by name to generate/stream is loaded once per process, then reused."""

from __future__ import annotations

import assistgen.api as api
import assistgen.api.loading as loading
import assistgen.api.names as names
from assistgen import Constant, generate, load_model

NAME = "smollm2-135m"


def test_a_name_is_resolved_once_and_every_later_call_reuses_the_model(monkeypatch):
    loads = []
    real = loading.load

    def counted(spec, settings=None):
        loads.append(spec)
        return real(spec, settings)

    monkeypatch.setattr(loading, "load", counted)
    monkeypatch.setattr(names, "_NAMED", {})
    first = generate(NAME, "Name three colours:", max_new_tokens=6)
    again = generate(f" {NAME} ", "Name three colours:", max_new_tokens=6)
    assert loads == [NAME] and again.token_ids == first.token_ids
    target = load_model(NAME)  # (a model of its own: the one loads that count)
    loads.clear()
    drafted = [generate(target, "Name three colours:", assistant=NAME, schedule=Constant(3), max_new_tokens=6)
               for _ in range(2)]
    assert loads == [] and api.as_model(NAME) is api.as_model(NAME)  # the assistant: the named model, reused
    assert all(d.token_ids == first.token_ids for d in drafted)
    assert all(d.stats.drafted_tokens > 0 for d in drafted)
