"""The cost book: one owner of the models' pass costs. Reading never measures; an entry holds for the fingerprint it
was measured under; and no decoding step measures anything.

`forbidding_measurement` makes every function that measures a model's passes raise, under every name a module of the
package bound it to (`MEASURING`), and the background calibration's `advance` too. The steps then run on the embedded
SmolLM2-135M on both backends after admission (`engine.begin`, where an adaptive schedule's `prepare` measures a
target the book knows nothing of): plain decoding, the adaptive schedule with prompt lookup and with an assistant
model, and a batch under a fixed rule, with the target known to the book and with an empty book (then the step's time
is shared out by rows, `engine.time_share`)."""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest
import torch
from helpers import PricedModel, encode, tiny_llama

import assistgen.policy.costs as book
from assistgen import Adaptive, Constant, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.quantize import quantize
from assistgen.config import GenerationConfig
from assistgen.core.engine import begin, step, time_share
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.drafters.base import NoDrafter
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.spec.costs import PassCosts

MEASURING = {  # module -> the functions in it that time a model's passes (or start timing them)
    "assistgen.backends.measure": ("step_times", "step_time_pieces", "best_of_rounds", "random_context"),
    "assistgen.policy.measurement": ("measure_costs", "quick_costs", "measurement_stages", "batch_step_pieces",
                                     "batch_step_times"),
    "assistgen.policy.costs": ("calibrate", "measured_costs"),
}


@contextlib.contextmanager
def forbidding_measurement(*models):
    """Inside: every measuring function raises (and is recorded), wherever the package's modules bound it, as do the
    background calibration's `advance` and the models' own `optimize` (their transforms time passes too)."""
    calls: list[str] = []

    def forbidden(name):
        def measure(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called inside a decoding step")
        return measure

    functions = {id(getattr(importlib.import_module(m), n)): f"{m}.{n}" for m, names in MEASURING.items()
                 for n in names}
    with pytest.MonkeyPatch.context() as patch:
        for name, module in list(sys.modules.items()):
            if name == "assistgen" or name.startswith("assistgen."):
                for attr, value in list(vars(module).items()):
                    if id(value) in functions:
                        patch.setattr(module, attr, forbidden(functions[id(value)]))
        patch.setattr(book.Calibration, "advance", forbidden("Calibration.advance"))
        for model in models:
            patch.setattr(model, "optimize", forbidden(f"{model.name}.optimize"))
        yield calls


def run_to_the_end(states) -> None:
    while any(s.finish is None for s in states):
        step([s for s in states if s.finish is None])


def test_a_step_that_measures_is_caught():
    """The check itself: a measuring function called while steps run raises and is recorded."""
    with forbidding_measurement() as calls, pytest.raises(AssertionError, match="inside a decoding step"):
        book.measured_costs(tiny_llama())
    assert calls == ["assistgen.policy.costs.measured_costs"]


@pytest.fixture
def quick_measurement(monkeypatch, tmp_path):
    """Measurements that time nothing (a flat curve, as if measured), on disk in a folder of the test's own."""
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    curve = [1.0 + 0.1 * k for k in range(17)]
    record = {"step_seconds": [0.01 * v for v in curve], "verification_costs": curve, "wide_rows": [],
              "wide_costs": [], "sequence_cost": 0.1, "batch_row_cost": 0.1, "others_share": 0.0}
    monkeypatch.setattr(book, "measure_costs", lambda model: dict(record))


def test_reading_measures_nothing_and_an_entry_holds_for_its_fingerprint(quick_measurement, monkeypatch):
    model = tiny_llama()
    with forbidding_measurement() as calls:
        assert book.known_costs(model) is None and book.costs_state(model) == "unmeasured"
    assert calls == []
    costs = book.calibrate(model)
    assert book.known_costs(model) is costs and book.costs_state(model) == "measured"
    threads = torch.get_num_threads()
    with monkeypatch.context() as other:
        other.setattr(torch, "get_num_threads", lambda: threads + 1)
        assert book.known_costs(model) is None  # another machine set-up: not measured under it
    assert book.known_costs(model) is costs
    quantize(model, "int8")  # the model changed: what was measured of it no longer applies
    assert book.known_costs(model) is None
    assert book.measured_costs(model) is not costs and book.known_costs(model) is not None  # measured again


def test_objects_of_one_model_share_what_was_measured_and_entered_costs_stay_their_own(quick_measurement):
    first, second, other = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=0)
    first.cache_key = second.cache_key = "tiny-book"  # `other` has no cache_key: its entries are its own
    measured = book.calibrate(first)
    assert book.known_costs(second) is measured and book.known_costs(other) is None
    mine = book.enter(second, PassCosts.from_curve([1.0, 1.1, 1.2]))
    assert book.known_costs(second) is mine and book.known_costs(first) is measured
    stand_in = PricedModel(mine)
    assert book.known_costs(stand_in) is mine


def test_without_costs_a_fixed_rule_shares_a_batched_steps_time_by_rows():
    costs = PassCosts.from_curve([1.0 + 0.5 * k for k in range(17)])
    assert time_share(3, 2, 4, None) == pytest.approx(0.75)
    assert time_share(3, 2, 4, costs) == pytest.approx(costs.rows(3) / costs.batch(2, 4))


TEXTS = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
         "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n")


@pytest.fixture(scope="module")
def smol_llama():
    return load_model("smollm2-135m", backend="llama.cpp")


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_no_measurement_is_reachable_from_a_decoding_step(backend, smollm2, smol_llama, monkeypatch):
    """SmolLM2-135M (the torch one not prepared: its costs are measured at admission, by the adaptive schedule's
    `prepare`), every kind of step after admission: nothing measures."""
    target = smollm2 if backend == "torch" else smol_llama
    assistant = smol_llama if backend == "torch" else smollm2
    config = GenerationConfig(max_new_tokens=8, eos_token_ids=())
    prompts = [encode_prompt(target, text) for text in TEXTS]
    cases = {"plain": [(NoDrafter(), Adaptive())],
             "adaptive, lookup": [(PromptLookupDrafter(), Adaptive())],
             "adaptive, assistant": [(AssistantDrafter(assistant, target), Adaptive())],
             "batch, fixed rule": [(PromptLookupDrafter(), Constant(3)), (NoDrafter(), Constant(3))]}
    for case, runs in cases.items():
        states = [begin(target, prompt, drafter, schedule, config)
                  for prompt, (drafter, schedule) in zip(prompts, runs, strict=False)]  # admission
        with forbidding_measurement(target, assistant) as calls:
            run_to_the_end(states)
        assert calls == [], case
        assert all(s.stats.new_tokens == 8 for s in states), case
    assert book.known_costs(target) is not None  # measured at admission, for the adaptive schedule
    monkeypatch.setattr(book, "_BOOK", book.CostBook())  # a target the book knows nothing of
    states = [begin(target, prompt, PromptLookupDrafter(), Constant(3), config) for prompt in prompts]
    with forbidding_measurement(target, assistant) as calls:
        run_to_the_end(states)
    assert calls == [] and book.known_costs(target) is None  # the fixed rule's batch shared its time by rows
    assert all(0.0 < s.stats.verify_s for s in states)


def test_a_tiny_models_steps_measure_nothing_either():
    """The same on a tiny model, in the fast suite: adaptive with lookup beside a fixed rule, in one batch."""
    target = tiny_llama()
    config = GenerationConfig(max_new_tokens=8, eos_token_ids=())
    adaptive = Adaptive(curve=[1.0 + 0.1 * k for k in range(17)])
    states = [begin(target, encode("abc abc abc abc"), PromptLookupDrafter(), adaptive, config),
              begin(target, encode("hello hello"), NoDrafter(), Constant(2), config)]
    with forbidding_measurement(target) as calls:
        run_to_the_end(states)
    assert calls == []


class ShapeKeeping:
    """A model whose pass takes 10 ms a row, plus 3 ms of set-up when its row count differs from the pass before
    (as llama.cpp keeps its last compute graph), on a clock that only its passes move."""

    vocab_size, context_length = 1000, 4096
    tokenizer = list(range(1000))

    def __init__(self):
        self.now, self.last_rows = 0.0, None

    def clock(self) -> float:
        return self.now

    def new_cache(self):
        model = self

        class Cache:
            def feed(self, ids, logits_to_keep=1):
                model.now += 0.010 * len(ids) + (0.003 if len(ids) != model.last_rows else 0.0)
                model.last_rows = len(ids)

            def crop(self, length):
                pass

        return Cache()


def test_a_pass_is_timed_as_decoding_meets_it_after_a_one_row_step():
    """t(1) is a decoding step's (one row after one row: no set-up), and t(n) a verification's (n rows after a
    one-row step: the set-up paid), whatever order the row counts are timed in. (Timed after passes of other shapes,
    t(1) would carry the set-up and every ratio t(n) / t(1) come out too low.)"""
    from assistgen.backends.measure import step_times

    times = step_times(ShapeKeeping(), rows=[1, 2, 17], repeats=2)
    assert times == pytest.approx([0.010, 0.023, 0.173])
