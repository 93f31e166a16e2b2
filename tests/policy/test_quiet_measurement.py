"""A measurement made while other processes share the cores prices the run that made it and is never kept on disk as
this machine's: the cost book's `calibrate` (all at once) and its background `Calibration` (in pieces, measured again
up to `ATTEMPTS` times), and the torch backend's linear routes alike. Contention here is real: one busy process per
CPU this process may run on, started for the test and stopped after it. A record saved before measurements were
watched (without `others_share`) is measured again."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from helpers import tiny_llama

import assistgen.policy.costs as book
from assistgen.backends.machine import cpu_ticks, others_share
from assistgen.backends.measure import CONTENDED, is_quiet, watched
from assistgen.policy import measurement


@contextlib.contextmanager
def busy_cores():
    """One process spinning on each CPU this process may run on."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def model_to_measure(key: str, layers: int = 4):
    """A tiny model large enough that measuring it takes a second or so of CPU (ticks enough to say who ran)."""
    model = tiny_llama(seed=0, hidden=512, layers=layers)
    model.cache_key = key
    return model


def spin(seconds: float) -> None:
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_share_other_processes_take_is_read_from_the_machine():
    start = cpu_ticks()
    assert start is not None  # (Linux: /proc/stat and /proc/self/stat)
    with busy_cores():
        busy = watched(lambda: (spin(1.5), {})[1])
    assert busy["others_share"] > CONTENDED and not is_quiet(busy)
    assert is_quiet({"others_share": None}) and is_quiet({})  # a machine that does not say: kept
    assert others_share(cpu_ticks() - cpu_ticks()) is None  # too short a span to say


def test_a_contended_cost_measurement_prices_this_run_and_is_not_saved(monkeypatch, tmp_path, one_thread):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = model_to_measure("tiny-contended")
    with busy_cores():
        costs = book.calibrate(model)
    assert costs.record["others_share"] > CONTENDED
    assert book.known_costs(model) is costs and book.costs_state(model) == "measured"
    assert not list(tmp_path.glob("costs/*.json"))  # not this machine's costs: measured again next time

    monkeypatch.setattr(book, "_BOOK", book.CostBook())  # a new process, on whatever the machine is now
    again = book.calibrate(model)
    saved = list(tmp_path.glob("costs/*.json"))
    assert bool(saved) == is_quiet(again.record)
    assert all(json.loads(path.read_text()) == again.record for path in saved)


def test_a_record_saved_before_measurements_were_watched_is_measured_again(monkeypatch, tmp_path, one_thread):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = model_to_measure("tiny-old-record")
    path = book.costs_path(model)
    path.parent.mkdir(parents=True)
    old = {"step_seconds": [1.0] * 17, "verification_costs": [2.65] * 17, "wide_rows": [], "wide_costs": [],
           "sequence_cost": 1.0, "batch_row_cost": 1.0}  # (a curve as a contended run measured it)
    path.write_text(json.dumps(old))
    measured = []
    monkeypatch.setattr(book, "measure_costs", lambda m: measured.append(m) or measurement.measure_costs(m))
    costs = book.calibrate(model)
    assert measured == [model] and "others_share" in costs.record and costs.curve[0] == 1.0


def test_a_background_calibration_that_shared_the_cores_is_made_again_and_not_saved(monkeypatch, tmp_path,
                                                                                       one_thread):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = model_to_measure("tiny-contended-later")
    book.calibrate(model, later=True)
    calibration = book.pending([model])[0]
    try:
        with busy_cores():
            while calibration.attempts == 1:
                assert calibration.advance()  # (a contended measurement is made again: never done here)
        contended = book.known_costs(model)
        assert not contended.record.get("provisional") and contended.record["others_share"] > CONTENDED
        assert calibration in book.pending() and calibration.results == []
        assert not list(tmp_path.glob("costs/*.json"))
    finally:
        calibration.abandon()


def test_linear_routes_measured_on_shared_cores_are_not_saved(monkeypatch, tmp_path, one_thread):
    """The torch backend's route table goes through the same gate (`small_rows.tune_routes`)."""
    from assistgen.backends.torch.small_rows import small_rows_linear, tune_routes

    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = model_to_measure("tiny-routes", layers=1)  # (timed on each route: one layer is enough)
    small_rows_linear(model.hf, mode="on")
    with busy_cores():
        record = tune_routes(model, refresh=True)
    assert record["others_share"] > CONTENDED and not list(tmp_path.glob("routes/*.json"))
    again = tune_routes(model, refresh=True)
    assert bool(list(tmp_path.glob("routes/*.json"))) == is_quiet(again)
