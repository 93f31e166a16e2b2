"""Alternatives: other drafters' drafts verified beside a sequence's own, in forks of its cache, in the same pass.

Where a pass costs about the same for 1 and 17 rows (weights streamed under `max_memory`; a GPU), a greedy
generation verifies the drafts of its other drafters too and keeps the one accepted furthest. The output must stay
the target's own greedy tokens, the alternatives must really be verified (and win steps), and without a flat curve
nothing changes.
"""

from __future__ import annotations

import pytest
from helpers import CHARS, encode, hf_greedy, tiny_llama

from assistgen import Adaptive, generate
from assistgen.policy.alternatives import StepPricing
from assistgen.policy.costs import enter
from assistgen.policy.gain import alternative_gain, merged_reach, reach
from assistgen.spec.costs import PassCosts

FLAT = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.01)  # streamed weights
STEEP = Adaptive(curve=[1.0 + 0.6 * k for k in range(17)], drafter_cost_prior=0.01)  # a CPU without a cap
# Every character comes once first, so that prompt lookup has a draft at the first step whatever token the random
# target emits first (the prefill's).
PROMPT = CHARS + " the cat sat on the mat. the dog sat on the rug. the cat sat on the"
N = 40


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(seed=0)
    model.max_memory = 10**9  # as if offloaded: the only targets alternatives are for
    return model


def test_the_gain_of_another_draft():
    best = reach([0.5], 4)  # 0.5, 0.25, 0.125, 0.0625
    assert best == [0.5, 0.25, 0.125, 0.0625]
    other = reach([1.0], 2)
    # The other draft is sure of 2 tokens: it adds where the first one falls short.
    assert alternative_gain(best, other) == pytest.approx((1 - 0.5) + (1 - 0.25))
    # Beginning with the first draft's first token, it adds nothing there.
    assert alternative_gain(best, other, shared=1) == pytest.approx(1 - 0.25)
    assert merged_reach(best, other) == pytest.approx([1.0, 1.0, 0.125, 0.0625])
    assert alternative_gain(best, []) == 0.0


def test_a_further_sequence_pays_only_where_rows_are_cheap():
    flat = StepPricing(PassCosts.from_curve([1.0 + 0.02 * k for k in range(17)]), 1, 1, 4, 2.0)
    steep = StepPricing(PassCosts.from_curve([1.0 + 0.6 * k for k in range(17)]), 1, 1, 4, 2.0)
    gain = alternative_gain(reach([0.5], 4), reach([0.8], 8))
    assert flat.rate_with(gain, 8) > flat.rate()
    assert steep.rate_with(gain, 8) < steep.rate()


def run(target, drafter: str, schedule):
    ids = encode(PROMPT)
    kwargs = {"self": {"assistant": target}, "other": {"assistant": tiny_llama(seed=1)}}[drafter]
    return ids, generate(target, ids, max_new_tokens=N, eos_token_ids=(), schedule=schedule, lookup=True, **kwargs)


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_alternatives_keep_the_target_greedy_output(target, drafter):
    """Prompt lookup drafts first; the model's draft is verified beside it, in a fork of the cache. With the
    target drafting for itself the model's draft is always right, so it wins wherever lookup's is rejected early."""
    ids, out = run(target, drafter, FLAT)
    assert out.token_ids == hf_greedy(target, ids, N)
    notes = out.stats.notes
    assert notes.get("alternatives_verified", 0) > 0, notes
    if drafter == "self":
        assert notes.get("alternatives_won", 0) > 0, notes


def test_no_alternatives_where_rows_cost(target):
    ids, out = run(target, "self", STEEP)
    assert out.token_ids == hf_greedy(target, ids, N)
    assert "alternatives_verified" not in out.stats.notes


def test_no_alternatives_for_a_target_in_memory():
    model = tiny_llama(seed=0)  # no max_memory: a flat curve is no sign of free rows (forks cost copies)
    ids = encode(PROMPT)
    out = generate(model, ids, max_new_tokens=N, eos_token_ids=(), schedule=FLAT, lookup=True, assistant=model)
    assert out.token_ids == hf_greedy(model, ids, N)
    assert "alternatives_verified" not in out.stats.notes


def test_alternatives_switched_off(target):
    settings = Adaptive(curve=FLAT.curve, drafter_cost_prior=0.01, alternatives=0)
    ids, out = run(target, "self", settings)
    assert out.token_ids == hf_greedy(target, ids, N)
    assert "alternatives_verified" not in out.stats.notes


def test_sampling_verifies_one_draft(target):
    ids = encode(PROMPT)
    out = generate(target, ids, max_new_tokens=N, eos_token_ids=(), schedule=FLAT, lookup=True, assistant=target,
                   temperature=0.8, seed=3)
    assert "alternatives_verified" not in out.stats.notes


def test_keeping_the_furthest_takes_fewer_steps(target):
    _, kept = run(target, "self", FLAT)
    _, alone = run(target, "self", Adaptive(curve=FLAT.curve, drafter_cost_prior=0.01, alternatives=0))
    assert kept.token_ids == alone.token_ids
    assert kept.stats.steps < alone.stats.steps


def test_alternatives_on_llama_cpp_in_forked_sequences():
    """The embedded SmolLM2-135M on llama.cpp: the forks are sequences of its context sharing the prompt's cells,
    verified in one llama_decode beside the sequence's own draft; the output is plain decoding's."""
    from assistgen import load_model

    smol = load_model("smollm2-135m", backend="llama.cpp", context=1024, max_memory="1GB")
    enter(smol, PassCosts.from_curve(FLAT.curve))  # as measured with its weights streamed from the file
    # (raw code, no chat template: its continuation copies from the prompt from its first token on)
    prompt = smol.tokenizer.encode("def area(width, height):\n    return width * height\n\n\n"
                                   "def volume(width, height, depth):\n    return")
    plain = generate(smol, prompt, max_new_tokens=48)
    out = generate(smol, prompt, max_new_tokens=48, lookup=True, assistant=smol,
                   schedule=Adaptive(drafter_cost_prior=0.01))
    assert out.token_ids == plain.token_ids
    assert out.stats.notes.get("alternatives_verified", 0) > 0, out.stats.notes
    assert out.stats.notes.get("alternatives_won", 0) > 0, out.stats.notes



def test_a_bad_schedule_on_the_command_line_names_the_problem(capsys):
    from assistgen.cli.main import main

    for text, said in (("adaptive:16:x", "invalid literal"), ("adaptive:16:-1", "alternatives >= 0"),
                       ("sometimes", "use adaptive[:MAX_K[:ALTERNATIVES]]")):
        with pytest.raises(SystemExit):
            main(["generate", "--schedule", text, "hi"])
        assert said in capsys.readouterr().err
