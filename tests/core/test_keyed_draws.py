"""Keyed draws: a seeded sampled generation whose drafts are copies (prompt lookup, a prediction) samples the same
tokens whatever was drafted, verified or batched beside it, as greedy decoding does: plain sampling, lookup with
fixed and cost-aware schedules, a prediction, on a tiny model and on SmolLM2 on both backends. (That each token
follows the target's distribution: tests/core/test_sampling.py's chi-squared tests with lookup.)"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama

from assistgen import Constant, generate, load_model
from assistgen.spec.sampling import inverse_cdf, keyed_uniform

PROMPT = "the cat sat on the mat. " * 4 + "the cat"


def runs(model, prompt, tokens: int, **sampling) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The same seeded request, drafted in several ways: each way's tokens, and its draft tokens kept."""
    ways = {"plain": {}, "lookup-k1": {"lookup": True, "schedule": Constant(k=1)},
            "lookup-k4": {"lookup": True, "schedule": Constant(k=4)}, "lookup-adaptive": {"lookup": True},
            "prediction": {"prediction": PROMPT, "schedule": Constant(k=6)}}
    outs, accepted = {}, {}
    for name, drafting in ways.items():
        result = generate(model, prompt, max_new_tokens=tokens, **sampling, **drafting)
        outs[name], accepted[name] = result.token_ids, result.stats.accepted_tokens
    return outs, accepted


def test_a_seeded_sample_is_the_same_whatever_was_drafted_on_a_tiny_model():
    model = tiny_llama(seed=0)
    kept = 0
    for seed in range(4):
        outs, accepted = runs(model, PROMPT, 24, temperature=1.0, seed=seed, eos_token_ids=())
        assert all(v == outs["plain"] for v in outs.values()), (seed, outs)
        kept += accepted["lookup-k4"]
    assert kept > 0  # (drafts were verified and kept)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_a_seeded_sample_is_the_same_whatever_was_drafted_on_smollm2(backend, smollm2):
    model = smollm2 if backend == "torch" else load_model("smollm2-135m", backend="llama.cpp")
    outs, accepted = runs(model, PROMPT, 40, temperature=0.8, top_p=0.95, seed=3)
    assert all(v == outs["plain"] for v in outs.values()), outs
    assert accepted["lookup-k4"] > 0 and accepted["prediction"] > 0
    other = generate(model, PROMPT, max_new_tokens=40, temperature=0.8, top_p=0.95, seed=4).token_ids
    assert other != outs["plain"]  # (the seed decides)


def test_the_inverse_cdf_gives_each_token_its_probability():
    """Over an even grid of uniforms, each token's share is its probability (to the grid's step); a token of
    probability 0 never comes."""
    p = torch.tensor([[0.1, 0.0, 0.25, 0.05, 0.6, 0.0]])
    grid = torch.arange(10_000, dtype=torch.float64) / 10_000
    tokens = inverse_cdf(p.expand(len(grid), -1), grid)
    shares = torch.bincount(tokens, minlength=6).double() / len(grid)
    assert torch.allclose(shares, p[0].double(), atol=2e-4)
    assert (shares[p[0] == 0] == 0).all()


def test_keyed_uniforms_are_spread_and_depend_on_key_and_position():
    values = [keyed_uniform(7, t) for t in range(20_000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    assert keyed_uniform(7, 3) != keyed_uniform(8, 3) and keyed_uniform(7, 3) != keyed_uniform(7, 4)
