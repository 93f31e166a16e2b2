"""The cost-aware policy: the expected-gain formula, the choice of k (0 included), switching back on, costs."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL_TOKENIZER, PricedModel, encode, hf_greedy, tiny_llama, verified

import assistgen.backends.measure
import assistgen.policy.costs
from assistgen import (
    Adaptive,
    AssistantDrafter,
    CompositeDrafter,
    Constant,
    Draft,
    EarlyExitDrafter,
    Heuristic,
    NGramCache,
    NGramCacheDrafter,
    NoDrafter,
    PromptLookupDrafter,
    UniversalDrafter,
    generate,
)
from assistgen.backends.base import Capabilities
from assistgen.policy.acceptance import Acceptance
from assistgen.policy.adaptive import AdaptiveRun
from assistgen.policy.costs import measured_costs
from assistgen.policy.gain import (
    LONG_K,
    MAX_K,
    best_draft_length,
    best_lookahead,
    expected_gain,
    expected_tokens,
    finishing_pays,
)
from assistgen.spec.costs import PassCosts
from assistgen.spec.steps import StepOutcome

FLAT = [1.0] * 17  # verification as cheap as one token (the GPU picture)
LINEAR = [1.0 + k for k in range(17)]  # every verified token costs a full step (no batching gain)


class Cheap:
    """A drafter part with no model: cost 0, so the policy asks for max_k and trims."""

    name = "lookup"
    model = None
    acceptance_prior = None


class Costly:
    """A drafter part with a model: cost from the prior, so the policy picks k before drafting."""

    name = "assistant"
    model = PricedModel()  # a model: the policy reads its start-up (none) and, by the prior, its cost
    acceptance_prior = None


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_is_the_geometric_series_for_a_constant_rate(alpha, k):
    assert expected_tokens([alpha] * 16, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_expected_tokens_chains_per_position_rates():
    # P(1st) = .5, P(2nd | 1st) = 1, P(3rd | 2nd) = .2: E(3) = 1 + .5 + .5 + .1
    assert expected_tokens([0.5, 1.0, 0.2], 3) == pytest.approx(2.1)


def test_expected_gain_divides_by_draft_and_verification_cost():
    assert expected_gain([0.5] * 8, 2, [1.0, 1.2, 1.5], c=0.25) == pytest.approx(1.75 / (0.5 + 1.5))


def test_useless_drafts_choose_k0_and_perfect_ones_the_largest_k():
    assert best_lookahead([0.0] * 16, FLAT, c=0.0, k_max=16) == (0, 1.0)
    assert best_lookahead([1.0] * 16, FLAT, c=0.0, k_max=16)[0] == 16
    assert best_lookahead([1.0] * 16, FLAT, c=0.0, k_max=5)[0] == 5
    # a full step per verified token: even perfect drafts cannot pay
    assert best_lookahead([1.0] * 16, LINEAR, c=0.0, k_max=16)[0] == 0
    # a costly drafter needs a high acceptance rate
    assert best_lookahead([0.5] * 16, FLAT, c=0.6, k_max=16)[0] == 0
    assert best_lookahead([0.95] * 16, FLAT, c=0.6, k_max=16)[0] > 0


def test_the_choice_follows_the_shape_of_the_cost_curve():
    costs = [1.0, 1.3, 1.6, 1.9, 1.95, 3.0, 3.5, 4.0]  # 4 draft tokens are almost as cheap as 3
    assert best_lookahead([1.0] * 8, costs, c=0.0, k_max=7)[0] == 4


def step(draft: list[int], part: str, verified: int, accepted: int, token: int, probs=None, source=None) -> StepOutcome:
    return StepOutcome(Draft(draft, probs, source=source or part), part, verified, accepted, token, draft_s=1e-4,
                verify_s=0.05)


def test_a_cheap_drafter_is_trimmed_to_zero_when_wrong_and_comes_back_when_right():
    policy = Adaptive(curve=[1.0 + 0.2 * k for k in range(17)]).prepare(None, [Cheap()])
    assert policy.next_k(Cheap()) == LONG_K  # free: propose as much as possible (a copy), trim afterwards
    for _ in range(20):  # every draft wrong at its first token
        draft = [7] * 16
        n = verified(policy, Draft(draft, source="lookup"), "lookup")
        policy.update(step(draft, "lookup", n, 0, token=3))
    assert verified(policy, Draft([7] * 16, source="lookup"), "lookup") == 0
    # Now the text is predictable. With k = 0 nothing is verified, but the emitted token is compared with the
    # unverified draft for free, so the estimate recovers and speculation resumes.
    for _ in range(10):
        draft = [5] * 16
        n = verified(policy, Draft(draft, source="lookup"), "lookup")
        policy.update(step(draft, "lookup", n, n, token=5))
    assert verified(policy, Draft([5] * 16, source="lookup"), "lookup") >= 4


def test_a_copy_that_keeps_being_accepted_is_verified_past_max_k_where_wide_passes_pay():
    """Copies of up to LONG_K tokens, as llama-server's n-gram modes verify: a free drafter is asked for that many, and
    once its deep positions are seen accepted a step verifies past MAX_K where the wide passes' costs make it pay; where
    every verified token costs a full step it pays nowhere; and a target whose kernels keep rows exact only to
    1 + MAX_K rows (`capabilities.verify_rows`: the torch backend) is never asked for more."""
    def copy_steps(policy, steps: int = 30) -> int:
        for _ in range(steps):  # a long copy, accepted whole every time
            draft = [5] * policy.next_k(Cheap())
            n = verified(policy, Draft(draft, source="lookup"), "lookup")
            policy.update(step(draft, "lookup", n, n, token=5))
        return verified(policy, Draft([5] * policy.next_k(Cheap()), source="lookup"), "lookup")

    cheap_rows = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)]).prepare(None, [Cheap()])  # (rows past the curve:
    assert cheap_rows.next_k(Cheap()) == LONG_K  # its slope continued)
    assert MAX_K < copy_steps(cheap_rows) <= LONG_K
    assert verified(cheap_rows, Draft([5] * 40, source="lookup"), "lookup", room=40) == 40  # the end: priced past
    # the curve too (the wide rows' costs), and all of it when that finishes sooner
    assert copy_steps(Adaptive(curve=LINEAR).prepare(None, [Cheap()])) == 0
    torch_like = PricedModel(capabilities=Capabilities(verify_rows=1 + MAX_K))
    bounded = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)]).prepare(torch_like, [Cheap()])
    assert bounded.next_k(Cheap()) == MAX_K and copy_steps(bounded) == MAX_K
    assert Adaptive(max_k=8).long_k == 8  # a schedule capped by hand stays capped (adaptive:8)
    with pytest.raises(ValueError, match="LONG_K"):
        Adaptive(long_k=LONG_K + 1)


def test_a_costly_drafter_is_switched_off_probed_and_switched_back_on():
    part = Costly()
    # A flat cost curve (a GPU's): catching up on the tokens missed while off is cheap, so probes fit the budget.
    policy = Adaptive(curve=[1.0 + 0.01 * k for k in range(17)], drafter_cost_prior=0.3, probe_share=0.05).prepare(
        None, [part])
    ks = []
    for _ in range(60):  # drafts are always rejected
        k = policy.next_k(part)
        ks.append(k)
        policy.update(step([9] * k, "assistant", k, 0, token=1) if k else step([], "", 0, 0, token=1))
    assert ks[0] > 0 and ks[-20:].count(0) >= 15  # tried, then off
    assert 0 < policy.probes and ks[10:].count(1) == policy.probes  # probed now and then with k = 1
    # The assistant becomes right: the probes succeed, and drafting comes back with a longer lookahead.
    ks = []
    for _ in range(150):
        k = policy.next_k(part)
        ks.append(k)
        policy.update(step([4] * k, "assistant", k, k, token=4) if k else step([], "", 0, 0, token=4))
    assert max(ks[-10:]) >= 3 and 0 not in ks[-10:]


def test_adaptive_plain_text_drafts_little_and_stays_exact():
    """A random-weight target and prompt lookup on text with nothing to copy: exact output, few wasted drafts."""
    target = tiny_llama(seed=0)
    ids = encode("Once upon a time, in a land far away, there lived")
    schedule = Adaptive(curve=LINEAR)  # no batching gain at all: a draft can never pay
    out = generate(target, ids, lookup=True, max_new_tokens=40, eos_token_ids=(), schedule=schedule)
    assert out.token_ids == hf_greedy(target, ids, 40)
    assert out.stats.drafted_tokens == 0 and out.stats.steps == 39  # (the prefill gives the first token)


def test_verification_costs_are_measured_once_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    target = tiny_llama(seed=0)
    target.cache_key = "tiny-test-model"
    monkeypatch.setattr(assistgen.backends.measure, "CONTENDED", 1.0)  # kept however busy the machine is (the gate
    costs = list(measured_costs(target).curve)  # itself: tests/policy/test_quiet_measurement.py)
    assert len(costs) == MAX_K + 1 and costs[0] == 1.0 and all(c > 0 for c in costs)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["verification_costs"] == costs

    fresh = tiny_llama(seed=0)  # a new process: an empty cost book, but the file
    fresh.cache_key = "tiny-test-model"
    monkeypatch.setattr(assistgen.policy.costs, "_BOOK", assistgen.policy.costs.CostBook())

    def fail(*args, **kwargs):
        raise AssertionError("measured again although a cached measurement exists")

    monkeypatch.setattr(assistgen.policy.costs, "measure_costs", fail)
    assert list(measured_costs(fresh).curve) == costs
    before = assistgen.policy.costs.costs_path(fresh)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 99)
    assert assistgen.policy.costs.costs_path(fresh) != before  # another machine set-up measures again


def test_a_probe_that_must_catch_up_on_a_long_prompt_waits_longer():
    settings = Adaptive(curve=[1.0 + 0.01 * k for k in range(17)], drafter_cost_prior=0.5, probe_share=0.05)
    short = settings.prepare(None, [Costly()], prompt_length=10)
    long = settings.prepare(None, [Costly()], prompt_length=5000)  # a probe would first feed 5000 tokens to it
    for policy in (short, long):
        policy.acceptance["assistant"] = Acceptance(0.0, 0.2, 17)  # known useless: switched off
        for _ in range(300):
            if policy.next_k(Costly()) == 0:
                policy.update(step([], "", 0, 0, token=1))
    assert short.probes >= 2 and long.probes == 0


def test_a_costly_drafter_starts_only_when_its_catch_up_on_the_prompt_pays():
    """Drafting is expected to pay per step, but first the assistant must read the prompt: worth it for a short
    prompt or a long generation, not for a long prompt followed by a few tokens."""
    settings = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.2)

    def first_k(prompt_length, budget):
        return settings.prepare(None, [Costly()], prompt_length=prompt_length, budget=budget).next_k(Costly())

    assert first_k(20, 64) > 0
    assert first_k(1500, 64) == 0  # catching up costs 0.2 * 1500 * 1.32 / 17 = 23 plain steps; drafting saves ~14
    assert first_k(1500, 4096) > 0
    assert first_k(1500, None) > 0  # no budget known: the catch-up is assumed to pay


class Encoding:
    """A model drafter whose model must first encode its input (`startup_s`: a speech assistant's encoder)."""

    name = "assistant"
    acceptance_prior = 0.9

    def __init__(self, startup_s: float):
        self.model = PricedModel(startup_s=startup_s)  # the policy reads only this of it (its cost: the prior)


def test_a_drafter_whose_model_must_first_encode_starts_only_when_that_pays():
    settings = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.2)

    def first_k(startup_s, budget):
        policy = settings.prepare(None, [Encoding(startup_s)], prompt_length=4, budget=budget)
        for _ in range(3):  # three plain steps of 0.05 s: the unit the start-up is priced in
            policy.update(step([], "", 0, 0, token=1))
        return policy.next_k(Encoding(startup_s))

    assert first_k(0.5, 12) == 0  # 10 plain steps of encoding before drafting 9 more tokens: no
    assert first_k(0.5, 400) > 0  # before 393 more: yes
    assert first_k(0.0, 12) > 0  # nothing to encode: drafting pays at once


def test_a_measured_agreement_is_not_undone_by_one_rejection():
    # The self-draft's agreement (0.9, measured over a text) is a window of observations: one early rejection moves it
    # as much as any later one (the moving average's weight), and drafting stays on at c = 0.45 with cheap rows.
    settings = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)], drafter_cost_prior=0.45)
    policy = settings.prepare(None, [Encoding(0.0)], prompt_length=4, budget=100)
    k = policy.next_k(Encoding(0.0))
    assert k > 0
    policy.update(step([7] * k, "assistant", k, 0, token=4))  # its first draft: rejected at once
    assert policy.estimate("assistant").rates[0] == pytest.approx(0.9 - settings.weight * 0.9)
    assert policy.next_k(Encoding(0.0)) > 0


class Timed:
    """A model drafter whose model's passes were measured: two rows cost 1.5 of its one-row pass."""

    name = "assistant"
    acceptance_prior = 0.9
    model = PricedModel(PassCosts.from_curve([1.0, 1.5, 1.6]))


def test_a_model_drafters_first_pass_is_priced_by_the_rows_it_feeds():
    from dataclasses import replace

    settings = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.3)
    policy = settings.prepare(None, [Timed()], prompt_length=4, budget=400)
    assert policy.first_pass_extra(Timed()) == 0.0  # it has not drafted: its catch-up is priced apart
    k = policy.next_k(Timed())
    policy.update(step([5] * k, "assistant", k, k, token=6))  # all kept: it must feed its last draft and the token
    policy.next_k(Timed())
    assert policy.first_pass_extra(Timed()) == pytest.approx(0.5)
    # Its proposal of 3 tokens took 3 + 0.5 of its passes, each 0.3 of a plain step (0.05 s): c stays 0.3.
    policy.update(replace(step([5] * 3, "assistant", 3, 1, token=6), draft_s=3.5 * 0.3 * 0.05))
    assert policy.drafters["assistant"].cost == pytest.approx(0.3, rel=0.02)
    policy.next_k(Timed())
    assert policy.first_pass_extra(Timed()) == 0.0  # a draft token was rejected: it feeds the target's token only


def test_a_drafter_that_drafted_last_step_pays_no_catch_up():
    settings = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.2)
    policy = settings.prepare(None, [Costly()], prompt_length=20, budget=64)
    k = policy.next_k(Costly())
    policy.update(step([4] * k, "assistant", k, k, token=4))
    assert policy.catch_up_cost("assistant", 0.2) == 0.0
    policy.update(step([], "", 0, 0, token=4))  # a step without it: it now has 1 token to catch up on
    assert policy.catch_up_cost("assistant", 0.2) == pytest.approx(0.2 * 1 * 1.32 / 17)


def test_a_new_source_starts_from_its_drafters_pooled_estimate():
    settings = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)])
    policy = settings.prepare(None, [Cheap()])
    for _ in range(10):  # lookup:3 drafts are always right
        draft = [5] * 16
        n = verified(policy, Draft(draft, source="lookup:3"), "lookup")
        policy.update(step(draft, "lookup", n, n, token=5, source="lookup:3"))
    assert verified(policy, Draft([5] * 16, source="lookup:3"), "lookup") >= 14
    # A first lookup:1 draft is judged by what lookup has shown so far, not by the 0.5 prior.
    fresh = settings.prepare(None, [Cheap()])  # a new generation with the same settings: nothing learnt
    assert verified(fresh, Draft([5] * 16, source="lookup:1"), "lookup") < 8
    # (a little less far than lookup:3's own: the first position of a source not yet seen is priced with caution)
    assert verified(policy, Draft([5] * 16, source="lookup:1"), "lookup") >= 10


class Oracle:
    """Drafts the target's own greedy continuation (known in advance): every draft token is right."""

    name = "oracle"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.sequence = prompt + continuation

    def propose(self, ids, k, sampler, min_confidence=0.0):
        assert ids == self.sequence[: len(ids)]
        return Draft(self.sequence[len(ids) : len(ids) + k])

    def observe(self, num_accepted, target_probs=None):
        pass

    def finish(self, ids):
        pass

    def report(self):
        return {}


def test_no_draft_token_is_verified_past_max_new_tokens():
    target = tiny_llama(seed=0)
    ids = encode("Once upon a time")
    reference = generate(target, ids, max_new_tokens=80, eos_token_ids=()).token_ids
    for n in (1, 2, 7, 23, 40):
        out = generate(target, ids, assistant=Oracle(ids, reference), schedule=Constant(k=16), max_new_tokens=n,
                       eos_token_ids=())
        assert out.token_ids == reference[:n]
        # the prefill emits one, every step its accepted draft tokens plus one, and every verified draft token is
        # accepted: nothing verified was thrown away at the end
        assert 1 + out.stats.accepted_tokens + out.stats.steps == n
        assert out.stats.drafted_tokens == out.stats.accepted_tokens
        assert out.stats.steps == -(-(n - 1) // 17)


def test_near_the_end_it_verifies_everything_that_can_finish_the_generation():
    costs = [1.0] * 6 + [1.3] * 11  # up to 5 draft tokens cost one step, 6 or more cost 1.3
    policy = Adaptive(curve=costs).prepare(None, [Cheap()])
    for _ in range(40):  # lookup is always right (seen often enough for the caution at each position to vanish)
        policy.update(step([5] * 16, "lookup", 16, 16, token=5))
    draft = Draft([5] * 6, source="lookup")
    assert verified(policy, draft, "lookup") == 5  # per step, 6 tokens for 1.0 beat 7 for 1.3
    assert verified(policy, draft, "lookup", room=6) == 6  # but 7 tokens end the generation: one step, not two
    assert verified(policy, Draft([5] * 16, source="lookup"), "lookup", room=30) == 16  # far from the end: unchanged
    assert finishing_pays([1.0] * 17, costs, 5, 6.0, 6)
    assert not finishing_pays([0.2] * 17, costs, 1, 1.2, 6)  # unlikely to finish anyway: keep the cheap step


def test_unverified_positions_of_a_free_drafter_are_assumed_at_least_the_floor():
    acceptance = Acceptance(0.5, 0.2, 17, unseen_floor=0.7)
    acceptance.record(verified=1, accepted=0)  # the first token was wrong once: rate 0 at position 0
    acceptance.record(verified=1, accepted=1)
    rates = acceptance.estimate()
    assert rates[0] == pytest.approx(0.5) and min(rates[1:]) == pytest.approx(0.7)
    assert Acceptance(0.5, 0.2, 17).estimate()[1:] == [0.5] * 16  # no floor: the position before
    costs = [1.0 + 0.05 * k for k in range(17)]
    optimistic = Adaptive(curve=costs, drafter_cost_prior=0.5).prepare(None, [Cheap(), Costly()])
    plain = Adaptive(curve=costs, drafter_cost_prior=0.5, unseen_floor=0.0).prepare(None, [Cheap(), Costly()])
    for policy in (optimistic, plain):
        for accepted in (0, 1, 0, 1):  # only first tokens verified so far, half of them right
            policy.estimate("lookup").record(1, accepted)
    assert optimistic.estimate("assistant").unseen_floor == 0.0  # a model drafter pays for every token
    draft = Draft([5] * 16, source="lookup")
    assert verified(optimistic, draft, "lookup") > verified(plain, draft, "lookup")


def test_one_lucky_draft_does_not_set_a_rate_to_one():
    acceptance = Acceptance(0.5, 0.2, 4)
    acceptance.record(verified=1, accepted=1)
    assert acceptance.estimate()[0] == pytest.approx(0.75)  # the prior counts as one observation
    for _ in range(30):
        acceptance.record(verified=1, accepted=1)
    assert acceptance.estimate()[0] > 0.99  # and is forgotten at the EMA weight afterwards


class Jittery:
    """An assistant whose speed varies from run to run, as on a busy machine: each proposal sleeps a random time."""

    name = "assistant"
    acceptance_prior = None

    def __init__(self, inner: AssistantDrafter):
        self.inner, self.model, self.context_length = inner, inner.model, inner.context_length
        self.jitter = random.Random()  # unseeded: a different delay on every run

    def propose(self, ids, k, sampler, min_confidence=0.0):
        time.sleep(self.jitter.uniform(0.0, 0.004))
        return self.inner.propose(ids, k, sampler, min_confidence)

    def observe(self, num_accepted, target_probs=None):
        self.inner.observe(num_accepted, target_probs)

    def finish(self, ids):
        pass

    def report(self):
        return {}


def test_a_sampled_adaptive_generation_depends_on_the_seed_not_on_timings():
    """With sampling, k decides how many random draws a step takes, so k must not follow the clock:
    the same seed gives the same text however long drafting takes."""
    target = tiny_llama(seed=0, layers=2, hidden=32, scale=0.15, tokenizer=SMALL_TOKENIZER)
    assistant = tiny_llama(seed=3, layers=1, hidden=32, scale=0.15, tokenizer=SMALL_TOKENIZER)
    prompt = SMALL_TOKENIZER("abcab")["input_ids"]
    settings = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)], drafter_cost_prior=0.05)

    def sample(seed):
        return generate(target, prompt, assistant=Jittery(AssistantDrafter(assistant, target)), schedule=settings,
                        max_new_tokens=40, temperature=1.0, seed=seed, eos_token_ids=())

    first, second, other = sample(7), sample(7), sample(8)
    assert first.stats.drafted_tokens > 0 and 0 < first.stats.accepted_tokens < first.stats.drafted_tokens
    assert first.token_ids == second.token_ids
    assert first.stats.accept_histogram == second.stats.accept_histogram  # the same k, step by step
    assert other.token_ids != first.token_ids  # the seed does matter


def test_a_schedule_is_settings_and_each_generation_gets_its_own_state():
    settings = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)])
    before = repr(settings)
    with pytest.raises(AttributeError):
        settings.max_k = 3  # frozen
    first, second = settings.prepare(None, [Cheap()]), settings.prepare(None, [Cheap()])
    assert isinstance(first, AdaptiveRun) and first is not second and first.acceptance is not second.acceptance
    first.update(step([5] * 16, "lookup", 16, 16, token=5))
    assert "lookup" in first.acceptance and "lookup" not in second.acceptance
    heuristic = Heuristic()
    one, two = heuristic.prepare(None, []), heuristic.prepare(None, [])
    one.update(step([5] * 5, "assistant", 5, 5, token=5))
    assert (one.next_k(), two.next_k()) == (7, 5)
    assert Constant(3).prepare(None, []) == Constant(3)  # no state: its own run

    target = tiny_llama(seed=0)
    ids = encode("abc abc abc abc abc")
    runs = [generate(target, ids, lookup=True, schedule=settings, max_new_tokens=12, eos_token_ids=()).stats
            for _ in range(2)]
    assert repr(settings) == before  # the engine never changes a user's settings
    assert runs[0].notes["acceptance_estimate"] == runs[1].notes["acceptance_estimate"]  # nothing carried over
    for bad in (lambda: Constant(MAX_K + 1), lambda: Adaptive(max_k=MAX_K + 1), lambda: Heuristic(max_k=MAX_K + 1)):
        with pytest.raises(ValueError, match="MAX_K"):
            bad()


def test_every_drafter_declares_what_the_policy_reads():
    target, other = tiny_llama(seed=0, layers=3), tiny_llama(seed=1, tokenizer=SMALL_TOKENIZER)
    early = EarlyExitDrafter(target, layers=1)
    drafters = [NoDrafter(), PromptLookupDrafter(), NGramCacheDrafter(NGramCache()), AssistantDrafter(target, target),
                UniversalDrafter(other, target), early, CompositeDrafter([PromptLookupDrafter(), early])]
    for drafter in drafters:
        assert drafter.model is None or drafter.model.hf is not None, type(drafter).__name__
        assert drafter.acceptance_prior is None or 0.0 <= drafter.acceptance_prior <= 1.0, type(drafter).__name__
    assert [d.model is None for d in drafters] == [True, True, True, False, False, False, True]
    assert EarlyExitDrafter(target, calibration_ids=encode("the cat sat on the mat. " * 4)).acceptance_prior is not None


def old_trim(run: AdaptiveRun, draft: Draft, drafter_name: str, room: int) -> int:
    """The per-sequence rule the loop had before its one optimizer: trim a free drafter's draft to its best length
    on the run's curve, verify everything near the end when finishing pays, keep a costly drafter's draft."""
    if not draft.tokens or not run.is_free(drafter_name):
        return min(len(draft.tokens), room)
    rates = run.estimate(draft.source or drafter_name, drafter_name).estimate()
    k, gain = best_lookahead(rates, run.curve, 0.0, len(draft.tokens))
    if k < room <= len(draft.tokens) and finishing_pays(rates, run.curve, k, gain, room):
        return room
    return min(k, room)


def test_the_one_optimizer_gives_one_sequence_what_the_per_sequence_rule_gave():
    rng = random.Random(0)
    finishing = 0
    for _ in range(1000):
        # a curve with a step in it (where verifying everything to finish can pay), or one that grows steadily
        if rng.random() < 0.5:
            j, jump, slope = rng.randrange(1, 17), rng.uniform(0.05, 1.0), rng.choice([0.0, 0.01, 0.05])
            curve = [1.0 + slope * n + (jump if n >= j else 0.0) for n in range(17)]
        else:
            curve = [1.0]
            for _ in range(16):
                curve.append(curve[-1] + rng.choice([0.0, 0.01, 0.05, 0.2, 0.6, 1.0]))
        run = Adaptive(curve=curve).prepare(None, [Cheap()])
        for _ in range(rng.randrange(30)):
            verified_ = rng.randrange(17)
            accepted = verified_ if rng.random() < 0.9 else rng.randrange(verified_ + 1)
            run.update(step([5] * 16, "lookup", verified_, accepted, token=5))
        draft = Draft([5] * rng.randrange(1, 17), source=rng.choice(["lookup", "lookup:2"]))
        room = rng.randrange(0, len(draft.tokens) + 3)  # often the end is near: every draft token usable
        expected = old_trim(run, draft, "lookup", room)
        assert verified(run, draft, "lookup", room) == expected
        finishing += expected == room and room > 0 and expected != old_trim(run, draft, "lookup", 1 << 30)
    assert finishing > 0  # the end-of-generation rule was exercised


def test_passes_slower_than_measured_flatten_the_curve_and_lengthen_the_drafts():
    """Costs measured with the weights in memory (t(17) = 13 t(1)), then every pass takes 1.2 s more (the weights
    read from the file in each pass, as under a memory cap): the policy's curve flattens and the same drafter drafts
    longer. Passes at the measured speed leave the measured curve as it is."""
    from assistgen.spec.drafts import Draft

    seconds = [0.1 * (1 + 0.75 * k) for k in range(17)]
    record = {"step_seconds": seconds, "verification_costs": [t / seconds[0] for t in seconds], "wide_rows": [],
              "wide_costs": [], "sequence_cost": 0.0, "batch_row_cost": 0.0}
    target = PricedModel(PassCosts.of(record))
    settings = Adaptive(drafter_cost_prior=0.1)
    ks = {}
    for name, extra in (("steady", 0.0), ("streamed", 1.2)):
        run, rng, chosen = settings.prepare(target, [Costly()]), random.Random(0), []
        for _ in range(60):
            k = run.next_k(Costly())
            chosen.append(k)
            accepted = next((i for i in range(k) if rng.random() > 0.8), k)  # each draft token right with p = 0.8
            run.update(StepOutcome(Draft([4] * k), "assistant" if k else "", k, accepted, 4, draft_s=0.03 * k,
                                   verify_s=seconds[k] + extra))
        ks[name] = (run, chosen)
    steady, streamed = ks["steady"][0], ks["streamed"][0]
    assert steady.curve == target.costs.curve  # as measured
    assert streamed.curve[16] < 2.1 < target.costs.curve[16]  # 13 before: nearly flat now
    assert min(ks["streamed"][1][-20:]) > max(ks["steady"][1][-20:])  # drafts longer where verifying is nearly free
    # A free drafter's draft (prompt lookup) is verified further too: the step is priced with the run's costs.
    lengths = {}
    for name, extra in (("steady", 0.0), ("streamed", 1.2)):
        run, rng = Adaptive().prepare(target, [Cheap()]), random.Random(1)
        for _ in range(40):  # 12 of each draft verified, each token right with p = 0.7
            accepted = next((i for i in range(12) if rng.random() > 0.7), 12)
            run.update(StepOutcome(Draft([4] * 16, source="lookup"), "lookup", 12, accepted, 5, draft_s=1e-4,
                                   verify_s=seconds[12] + extra))
        lengths[name] = verified(run, Draft([4] * 16, source="lookup"), "lookup")
    assert lengths["streamed"] > lengths["steady"], lengths


def test_an_offloaded_target_prices_a_resident_assistant_by_measured_step_times():
    """A target whose weights stream from their file (offloaded) takes 1.2 s a pass whatever its size; an assistant
    of 45 % of its weight bytes, resident, takes 0.03 s: its prior cost is their measured step times' ratio, not the
    bytes' share, and with it the assistant drafts from the first step. The bytes' share stays for a target whose
    steps were never timed."""
    from assistgen.policy.records import cost_hint

    def measured(t1: float, slope: float) -> PassCosts:
        seconds = [t1 * (1 + slope * k) for k in range(17)]
        return PassCosts.of({"step_seconds": seconds, "verification_costs": [t / t1 for t in seconds],
                             "wide_rows": [], "wide_costs": [], "sequence_cost": 0.0, "batch_row_cost": 0.0})

    assistant = PricedModel(measured(0.03, 0.5), weight_bytes=450)
    drafter = SimpleNamespace(name="assistant", model=assistant, acceptance_prior=None)
    streamed = PricedModel(measured(1.2, 0.02), weight_bytes=1000, capabilities=Capabilities(offloaded=True))
    resident = PricedModel(measured(0.1, 0.75), weight_bytes=1000)
    assert cost_hint(drafter, streamed, assistant.costs, streamed.costs) == pytest.approx(0.025)
    assert cost_hint(drafter, resident, assistant.costs, resident.costs) == pytest.approx(0.3)  # measured: what its
    # passes take
    unmeasured = PricedModel(weight_bytes=1000)
    assert cost_hint(drafter, unmeasured, assistant.costs, None) == pytest.approx(0.45)  # else its share of the
    # weight bytes
    run = Adaptive().prepare(streamed, [drafter], prompt_length=600, budget=32)
    assert run.next_k(drafter) >= 1  # drafts at once: its catch-up on the prompt is cheap against a streamed pass
    assert Adaptive().prepare(resident, [drafter], prompt_length=600, budget=32).next_k(drafter) == 0  # catch-up


def test_passes_that_also_cost_more_per_row_than_measured_are_not_priced_as_free():
    """As measured under a memory cap on the torch backend (SmolLM2-135M, costs cached from a run in memory, t(1) =
    29 ms): a plain pass takes about 1.0 s, a 16-row one about 1.45 s, more than a fixed extra cost per pass gives
    (1.06). Lookup's drafts are right 10 % of the time: once the steps show that, long drafts are not verified."""
    from assistgen.spec.drafts import Draft

    curve = [1.0 + 0.125 * k for k in range(17)]  # t(17) = 3 t(1), as measured in memory
    seconds = [0.029 * v for v in curve]
    record = {"step_seconds": seconds, "verification_costs": curve, "wide_rows": [], "wide_costs": [],
              "sequence_cost": 0.0, "batch_row_cost": 0.0}
    target = PricedModel(PassCosts.of(record))
    run, rng = Adaptive().prepare(target, [Cheap()]), random.Random(0)
    for i in range(40):
        rows = 1 if i % 3 == 0 else rng.choice([4, 8, 12, 16])
        accepted = 1 if rows > 1 and rng.random() < 0.1 else 0
        run.update(StepOutcome(Draft([4] * 16, source="lookup"), "lookup" if rows > 1 else "", rows - 1,
                               min(accepted, rows - 1), 5, draft_s=1e-4, verify_s=1.0 + 0.03 * (rows - 1)))
    assert run.curve[15] > 1.3  # what the steps showed, not the 1.06 of a fixed extra cost
    assert verified(run, Draft([4] * 16, source="lookup"), "lookup") <= 2


def test_under_a_budget_calibration_times_fewer_passes():
    """Each pass of an offloaded model streams its weights (seconds on a large one): calibration then times the
    row counts of SPARSE_ROWS once each after a warm-up (and the curve is linear between them), not every count
    1..17 three times. The curve still has every entry."""
    from assistgen.policy import measurement as costs_module

    def passes(max_memory):
        model = tiny_llama(seed=0)
        model.max_memory = max_memory
        timed = []  # every timed pass reads the clock twice
        real = model.clock

        def counting():
            timed.append(1)
            return real()

        model.clock = counting
        record = costs_module.measure_costs(model)
        assert len(record["verification_costs"]) == MAX_K + 1
        return len(timed) // 2

    assert passes(10**9) < passes(None) / 2
    assert costs_module.interpolated([1.0, 2.0, 4.0], (1, 2, 4)) == [1.0, 2.0, 3.0, 4.0]


def test_one_fit_tells_a_fixed_cost_per_pass_from_a_machine_uniformly_slower():
    """`online.OnlineCosts`: passes that all take twice their measured time (a busy machine: t = 2 t_measured) leave
    the measured curve as it is and double the plain step's time; passes that take a fixed 1.2 s more (weights
    streamed) flatten it, v'[k] = (v[k] + f) / (1 + f)."""
    from assistgen.policy.online import OnlineCosts

    seconds = [0.1 * (1 + 0.75 * k) for k in range(17)]
    measured = PassCosts.of({"step_seconds": seconds, "verification_costs": [t / seconds[0] for t in seconds],
                             "wide_rows": [], "wide_costs": [], "sequence_cost": 0.0, "batch_row_cost": 0.0})
    busy, streamed = OnlineCosts(measured), OnlineCosts(measured)
    for k in [0, 4, 1, 8, 2, 16, 0, 3] * 3:
        busy.observe((1, 1, k), 2 * seconds[k])
        streamed.observe((1, 1, k), seconds[k] + 1.2)
    # (the slope's pull towards the measured t(1), one row's spread against these rows', costs a few % of the unit)
    assert busy.costs().curve == pytest.approx(measured.curve) and busy.unit_s() == pytest.approx(0.2, rel=0.1)
    assert busy.fixed() == pytest.approx(0.0, abs=1e-9)
    assert streamed.fixed() == pytest.approx(11.0) and streamed.unit_s() == pytest.approx(1.3)
    assert streamed.costs().curve[16] == pytest.approx((13.0 + 11.0) / 12.0)
    # While the rows do not spread, the extra time is read as a fixed cost (the slope held at the measured t(1)).
    still = OnlineCosts(measured)
    for _ in range(5):
        still.observe((1, 1, 0), 0.1 + 1.2)
    assert still.fixed() == pytest.approx(11.0)


def test_wide_passes_whose_times_tilt_the_line_never_make_a_plain_step_free():
    """Passes that are all wide (long copies verified one after another) with noisy times can tilt the fitted line
    so far that it crosses zero above one row. A plain step then cost nothing, and a drafter's cost per token (its
    seconds over that unit) a million steps: copying stopped for the rest of the generation (seen on a 2,700-token
    prompt). No pass has a negative fixed cost, so the line goes through the origin instead."""
    from assistgen.policy.online import OnlineCosts

    seconds = [0.05 * (1 + 0.3 * k) for k in range(65)]
    measured = PassCosts.of({"step_seconds": seconds[:17], "verification_costs": [t / seconds[0] for t in seconds],
                             "wide_rows": [], "wide_costs": [], "sequence_cost": 0.0, "batch_row_cost": 0.0})
    online = OnlineCosts(measured)
    for k, t in [(0, 0.05)] + [(48, 0.50), (64, 1.30), (56, 0.70), (64, 1.25), (60, 1.10)] * 3:
        online.observe((1, 1, k), t)
    assert online.fit()[0] >= 0.0
    assert 0.02 < online.unit_s() < 0.1  # (about a plain step's 0.05 s, not 1e-12)


def test_a_positions_first_observation_starts_from_what_was_estimated_for_it():
    acceptance = Acceptance(0.5, 0.2, 4)
    for _ in range(20):  # only first tokens verified so far, all of them right
        acceptance.record(verified=1, accepted=1)
    before = acceptance.estimate()
    assert before[1] == before[0] > 0.95  # the second position is taken from the first
    acceptance.record(verified=2, accepted=2)  # the second position verified for the first time: right
    assert acceptance.estimate()[1] >= before[1]  # an accepted token never lowers its position's estimate


def test_unverified_draft_tokens_are_checked_against_the_tokens_the_target_emits_next():
    """Lookup's drafts start right and then go wrong: the steps that follow tell, for free, that its second position
    is wrong, so a draft is not verified past its first token on the first position's record alone."""
    curve = [1.0 + 0.5 * k for k in range(17)]  # every verified row costs half a step
    wrong, right = (Adaptive(curve=curve).prepare(None, [Cheap()]) for _ in range(2))
    for t in range(10, 30):  # the target emits 10, 11, 12, ...; nothing is verified
        wrong.update(step([t, 999, 999], "lookup", 0, 0, token=t))
        right.update(step([t, t + 1, t + 2], "lookup", 0, 0, token=t))
    assert wrong.estimate("lookup").estimate()[0] > 0.9 and wrong.estimate("lookup").estimate()[1] < 0.2
    assert min(right.estimate("lookup").estimate()[:3]) > 0.9  # learned at each position it was checked
    assert verified(wrong, Draft([5] * 16, source="lookup"), "lookup") == 1  # its first token only
    assert verified(right, Draft([5] * 16, source="lookup"), "lookup") >= 3


def test_a_first_position_seen_once_is_priced_with_caution():
    """One lucky first token is little evidence: a long, costly verification waits for more; many are not."""
    once, often = Acceptance(0.5, 0.2, 17, caution=1.0), Acceptance(0.5, 0.2, 17, caution=1.0)
    once.record(verified=1, accepted=1)
    for _ in range(30):
        often.record(verified=1, accepted=1)
    assert once.estimate(cautious=False)[0] == pytest.approx(0.75)
    assert once.estimate()[0] == pytest.approx(0.75 - (0.75 * 0.25 / 3) ** 0.5)  # one sd off: 0.5
    assert often.estimate()[0] > 0.97  # the margin shrinks as observations come in


def test_a_rate_carried_to_a_position_never_observed_is_priced_as_a_guess():
    """What was seen at the first position says little of the positions after it that were never seen: a long draft
    is verified on what was observed at each position, not on the first position's record carried over."""
    first_only, deep = Acceptance(0.5, 0.2, 17, caution=1.0), Acceptance(0.5, 0.2, 17, caution=1.0)
    for i in range(40):  # the first token right 6 times in 7; when it is, the rest of the draft too
        right = i % 7 != 3
        first_only.record(verified=1, accepted=int(right))
        deep.record(verified=16, accepted=16 if right else 0)
    assert first_only.estimate()[0] == pytest.approx(deep.estimate()[0])
    carried = first_only.estimate(cautious=False)[1]
    assert carried == pytest.approx(first_only.rates[0])  # the first position's rate, carried over
    assert first_only.estimate()[1] == pytest.approx(carried - (carried * (1 - carried) / 2) ** 0.5)  # no observations
    assert min(deep.estimate()[1:]) > 0.95  # observed there: priced as observed
    costs = [1.0 + 0.45 * k for k in range(17)]  # each row 0.45 of a step
    assert best_draft_length(first_only.estimate(), costs, 0.0, 16)[0] <= 2
    assert best_draft_length(deep.estimate(), costs, 0.0, 16)[0] == 16


def test_an_expected_length_prices_one_off_costs_and_bad_values_are_refused():
    from assistgen.config import ConfigError, GenerationConfig

    assert GenerationConfig(max_new_tokens=444, expected_new_tokens=25).budget == 25
    assert GenerationConfig(max_new_tokens=10, expected_new_tokens=25).budget == 10  # never past the limit
    assert GenerationConfig(max_new_tokens=444).budget == 444
    for bad in (0, -3, 2.5, True, "25"):
        with pytest.raises(ConfigError, match="expected_new_tokens must be None or an integer >= 1"):
            GenerationConfig(expected_new_tokens=bad).validate()
    with pytest.raises(ValueError, match="caution >= 0"):
        Adaptive(caution=-1.0)


def test_a_model_drafters_acceptance_is_one_rate_for_every_position():
    from assistgen.policy.acceptance import Acceptance

    pooled = Acceptance(0.9, 0.2, 8, prior_weight=5.0, pooled=True)
    pooled.record(verified=4, accepted=1)  # the first token kept, the second rejected: half of those judged
    rate = 0.9 + 0.2 * (0.5 - 0.9)
    assert pooled.estimate() == pytest.approx([rate] * 8)  # the rejection at depth 2 lowers every depth alike
    pooled.record(verified=1, accepted=1)  # and a one-token draft kept raises them all: depth 2 is not stuck
    assert pooled.estimate()[1] > rate
    pooled.record(verified=16, accepted=16)  # a long draft kept whole is one step's evidence
    assert pooled.estimate()[0] < 0.9
    per_position = Acceptance(0.9, 0.2, 8, prior_weight=5.0)
    per_position.record(verified=4, accepted=1)
    per_position.record(verified=1, accepted=1)
    assert per_position.estimate()[1] == pytest.approx((0.9 + 0.2 * 0.1) * 0.8)  # depth 2 keeps its rejection
    # The policy pools a model drafter's positions, not a free drafter's.
    settings = Adaptive(curve=[1.0 + 0.02 * k for k in range(17)], drafter_cost_prior=0.3)
    policy = settings.prepare(None, [Timed(), Cheap()])
    assert policy.estimate("assistant").pooled and not policy.estimate("lookup", "lookup").pooled


def test_a_later_positions_first_observation_starts_from_the_rate_not_the_cautious_price():
    from assistgen.policy.acceptance import Acceptance

    rates = Acceptance(0.5, 0.2, 4, caution=1.0)
    rates.observe(0, True)  # the first position: 0.5 -> 0.75 (averaged with the start, worth one observation)
    # carried over to the next position, never observed there: priced with caution for no observations of its own
    assert rates.estimate()[1] == pytest.approx(0.75 - (0.75 * 0.25 / 2) ** 0.5)
    rates.observe(1, True)
    assert rates.rates[1] == pytest.approx(0.75 + 0.5 * 0.25)  # from 0.75, the rate, not from the price


def test_under_a_curve_where_no_draft_can_pay_nothing_is_verified_and_where_drafts_pay_they_are(smollm2):
    """The policy's promise, on a real model through the loop: where each verified row costs a whole plain step (no
    draft can pay, however right), plain decoding's steps, none verifying a draft; where rows are free, the copies
    of a repeating text are verified and kept. The text is the same."""
    prompt = "the cat sat on the mat. " * 6 + "the cat"
    steep = generate(smollm2, prompt, lookup=True, schedule=Adaptive(curve=[1.0 + k for k in range(17)]),
                     max_new_tokens=24)
    flat = generate(smollm2, prompt, lookup=True, schedule=Adaptive(curve=[1.0] * 17), max_new_tokens=24)
    assert steep.token_ids == flat.token_ids
    assert steep.stats.drafted_tokens == 0 and steep.stats.steps == 23  # (the prefill gives the first token)
    assert flat.stats.accepted_tokens >= 12 and flat.stats.steps < 12


def test_a_free_drafter_priced_out_again_and_again_is_asked_only_now_and_then():
    """Where no copy can pay (every verified token costs a full step), a free drafter drafts `rest_after` times, then
    only every `rest_steps + 1`-th step (its search costs a step's Python even when nothing is verified); once a draft
    is verified again it is asked every step."""
    settings = Adaptive(curve=LINEAR)
    run, asked = settings.prepare(None, [Cheap()]), 0
    for _ in range(40):
        k = run.next_k(Cheap())
        if k:
            asked += 1
            draft = [5] * k
            n = verified(run, Draft(draft, source="lookup"), "lookup")
            assert n == 0
            run.update(step(draft, "lookup", n, 0, token=5))
        else:
            run.update(StepOutcome(Draft([]), "", 0, 0, 5))
    assert asked == settings.rest_after + (40 - settings.rest_after) // (settings.rest_steps + 1)
    assert run.report()["adaptive_rested_steps"] == 40 - asked
    cheap = Adaptive(curve=[1.0 + 0.2 * k for k in range(17)]).prepare(None, [Cheap()])
    for _ in range(settings.rest_after):
        cheap.update(step([7] * 16, "lookup", 0, 0, token=3))  # drafts priced out ...
    assert cheap.next_k(Cheap()) == 0
    while cheap.next_k(Cheap()) == 0:
        pass
    cheap.update(step([5] * 16, "lookup", 4, 4, token=5))  # ... until one is verified
    assert all(cheap.next_k(Cheap()) == LONG_K for _ in range(5))
