"""The cost book: the one owner of what each model's forward passes cost (`spec.costs.PassCosts`).

Contract: the book holds, per model, the `PassCosts` measured of it as it is now: an entry holds for the model's
fingerprint (`backends.base`: model, set-up, library versions, CPU, threads) at the time it was measured, so a model
transformed since (quantized, its linear routes tuned) or run under other threads has none until it is measured
again; nothing is written on the model. A model with a `cache_key` shares its entries with every object of that
model (as the measurements on disk are shared: a speech model's decoder, heard anew for each input); one without
has its own, held weakly (the book keeps no model alive). Reading and measuring are apart:
    known_costs(model)     what the book holds (None: nothing yet); never measures, never reads the disk;
    calibrate(model)       measures now (`measurement.measure_costs`), or reads what was measured on this machine
                           before from `$ASSISTGEN_CACHE/costs/` (keyed by the fingerprint; `refresh` measures again),
                           and enters it. A measurement made while other processes shared the cores
                           (`backends.measure.is_quiet`) prices this run only: it is not saved.
                           `api.prepare` calls it, so no request pays for it. `later=True` does not
                           hold up a server's start: with nothing on disk it enters a provisional curve from a few
                           row counts (`measurement.quick_costs`) and leaves the full measurement to a `Calibration`
                           in `pending()`, which the serving engine advances one timed pass at a time while no
                           request runs;
    measured_costs(model)  what the book holds, else `calibrate` now: for a generation's start (a schedule's
                           `prepare`, at admission) and a drafter's set-up, where a model that was not prepared gets
                           its costs. Never called inside a decoding step: a step only reads (`known_costs`), and a
                           test makes every measurement raise while steps run (tests/policy/test_cost_book.py);
    enter(model, costs)    puts costs in the book for one model object (a test's or a benchmark's own figures).
`costs_state(model)` says what a server's policy prices the model's passes on. How a generation's passes compare
with the measurement as they run is `online.OnlineCosts`'s; how long a drafter takes per token is measured online
by the adaptive schedule, not here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Generator
from pathlib import Path

from assistgen.backends.embedded import say
from assistgen.backends.machine import CpuTicks, cpu_ticks, others_share
from assistgen.backends.measure import is_quiet
from assistgen.paths import measurement_file, recalled, remember, remembered
from assistgen.policy.measurement import REQUIRED, costs_record, measure_costs, measurement_stages, quick_costs
from assistgen.spec.costs import PassCosts


class CostBook:
    """Models' `PassCosts`, each entry for the fingerprint it was measured under (see the module's contract): a
    measurement of a model with a `cache_key` is shared by every object of that model; costs of a model without
    one, or entered for one object only (`put(..., own=True)`), belong to that object (held weakly), and come
    first."""

    def __init__(self):
        self.shared: dict[tuple[str, str], PassCosts] = {}  # (cache_key, fingerprint) -> its costs
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {fingerprint: its costs}

    def get(self, model) -> PassCosts | None:
        fingerprint = model.fingerprint()
        costs = self.own.get(model, {}).get(fingerprint)
        if costs is None and model.cache_key:
            costs = self.shared.get((model.cache_key, fingerprint))
        return costs

    def put(self, model, costs: PassCosts, own: bool = False) -> PassCosts:
        fingerprint = model.fingerprint()
        mine = self.own.setdefault(model, {})
        if own or not model.cache_key:
            mine[fingerprint] = costs
        else:
            mine.pop(fingerprint, None)
            self.shared[(model.cache_key, fingerprint)] = costs
        return costs


_BOOK = CostBook()


def known_costs(model) -> PassCosts | None:
    """The costs the book holds for the model as it is now; None when it holds none. Never measures."""
    return _BOOK.get(model)


def measured_costs(model) -> PassCosts:
    """The costs the book holds for the model, else measured now (`calibrate`: a model that was not prepared). For a
    generation's start and a drafter's set-up only, never inside a decoding step."""
    costs = known_costs(model)
    return costs if costs is not None else calibrate(model)


def enter(model, costs: PassCosts) -> PassCosts:
    """Put `costs` in the book as this model object's, as it is now (a test's or a benchmark's own figures: other
    objects of the same model keep what was measured)."""
    return _BOOK.put(model, costs, own=True)


def calibrate(model, refresh: bool = False, later: bool = False) -> PassCosts:
    """Read the model's costs from disk, or measure them now (and save them), and enter them in the book. `later`:
    when nothing is on disk, a provisional curve now (`quick_costs`, a few passes) and the full measurement left to a
    `Calibration` in `pending()`, which a server runs while it is idle (an offloaded model is measured now)."""
    path = costs_path(model)
    if later and not model.capabilities.offloaded:
        record = None if refresh else recalled(path, REQUIRED)
        if record is None:
            costs = _BOOK.put(model, quick_costs(model))
            _PENDING[model] = Calibration(model, path)
            return costs
        return _BOOK.put(model, PassCosts.of(record))
    return _BOOK.put(model, PassCosts.of(remembered(path, lambda: measure_announced(model), REQUIRED, refresh,
                                                    keep=is_quiet)))


def measure_announced(model) -> dict:
    """`measure_costs`, said on stderr first (a start that takes a while, once per machine)."""
    say(f"Measuring {model.name}'s pass costs on this CPU{'' if model.cache_key is None else ' (once: cached)'}.")
    return measure_costs(model)


def costs_path(model) -> Path | None:
    """Where this model's costs on this machine are cached (None without a `cache_key`: kept in memory only)."""
    return measurement_file("costs", model.cache_key, model.fingerprint()) if model.cache_key else None


class Calibration:
    """A model's full cost measurement, run in pieces between other work (one thread, the model's own).
    `advance()` times one pass and says whether more remain; after the last the record is entered in the book and
    saved, and the calibration leaves `pending()`. Other processes' load is summed over the timed pieces only (a
    server's idle gaps, when a client on the same machine may run, do not count); a measurement that shared the
    cores (`is_quiet`) is entered but not saved, and made again, up to `ATTEMPTS` times in all. `interrupt()` drops
    the stage half done (closing its generator frees its caches, so the model's sequences can serve), to be timed
    again from that stage's start. `abandon()`
    gives up: the provisional costs stay. One thread advances it at a time (a call while another thread times a pass
    returns at once), and no pass is timed while an engine other than the caller serves requests on the model
    (`hold`/`release`: engines of two servers may share a model)."""

    def __init__(self, model, path: Path | None):
        self.model, self.path = model, path
        self.stages = measurement_stages(model)
        self.results: list = []
        self.current: Generator | None = None
        self.lock = threading.Lock()  # one thread times a pass at a time (engines of several servers may share a model)
        self.holders: set[int] = set()  # ids of the engines now serving requests on the model
        self.holding = threading.Lock()  # guards `holders` (never held while a pass is timed)
        self.spent: CpuTicks | None = CpuTicks(0, 0, 0)  # ticks over the timed pieces (None: the machine does not say)
        self.attempts = 1

    def hold(self, who: object) -> None:
        """`who` (an engine) serves requests on the model: no pass is timed until it lets go (`release`), and a stage
        half done is dropped (its caches freed for the requests; a pass being timed ends first)."""
        with self.holding:
            self.holders.add(id(who))
        with self.lock:
            self._interrupt()

    def release(self, who: object) -> None:
        with self.holding:
            self.holders.discard(id(who))

    def free_for(self, who: object) -> bool:
        """Whether `who` may time a pass now: no other engine serves requests on the model."""
        with self.holding:
            return not (self.holders - {id(who)})

    def advance(self, who: object = None) -> bool:
        if not self.lock.acquire(blocking=False):
            return True  # another thread is timing a pass of it
        try:
            return True if not self.free_for(who) else self._advance()  # (requests on the model come first)
        finally:
            self.lock.release()

    ATTEMPTS = 3

    def _advance(self) -> bool:
        if self.current is None:
            self.current = self.stages[len(self.results)]()
        start = cpu_ticks()
        try:
            next(self.current)
            return True
        except StopIteration as done:
            self.results.append(done.value)
            self.current = None
        finally:
            end = cpu_ticks()
            self.spent = self.spent + (end - start) if self.spent and start and end else None
        if len(self.results) < len(self.stages):
            return True
        record = {**costs_record(self.model, *self.results), "others_share": others_share(self.spent)}
        _BOOK.put(self.model, PassCosts.of(record))
        if is_quiet(record):
            remember(self.path, record)
        elif self.attempts < self.ATTEMPTS:  # (measured again while idle; meanwhile priced on this one)
            self.attempts, self.results, self.spent = self.attempts + 1, [], CpuTicks(0, 0, 0)
            return True
        _PENDING.pop(self.model, None)
        return False

    def interrupt(self) -> None:
        with self.lock:
            self._interrupt()

    def _interrupt(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def abandon(self) -> None:
        with self.lock:
            self._interrupt()
        _PENDING.pop(self.model, None)


_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Calibration, until measured


def pending(models: list | None = None) -> list[Calibration]:
    """The cost measurements left for later (`calibrate(later=True)`), oldest first; those of `models` only when
    given (an engine measures the models it serves, never another engine's)."""
    calibrations = list(_PENDING.values())
    return calibrations if models is None else [c for c in calibrations if any(c.model is m for m in models)]


def costs_state(model) -> str:
    """What the policy prices `model`'s passes on: "measured", "measuring" (provisional costs, the measurement
    pending), "provisional" (the measurement given up) or "unmeasured" (nothing yet)."""
    costs = known_costs(model)
    if costs is None:
        return "unmeasured"
    if not costs.record.get("provisional"):
        return "measured"
    return "measuring" if model in _PENDING else "provisional"
