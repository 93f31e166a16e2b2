"""Speculative sampling is lossless: the distribution of the first two tokens equals the target's.

The reference distribution is computed exactly from the target with transformers' own logits
warpers (temperature, top-k, top-p); assisted samples are compared with a chi-squared test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_TOKENIZER, tiny_llama
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import assistgen.engine
import assistgen.sampling
from assistgen import Adaptive, Constant, generate

PROMPT = SMALL_TOKENIZER("abcab")["input_ids"]
SAMPLES = 3000
SETTINGS = {
    "plain-t1": dict(temperature=1.0),
    "t0.7-topk5-topp0.9": dict(temperature=0.7, top_k=5, top_p=0.9),
}


@pytest.fixture(scope="module")
def models():
    # Different seeds: the assistant's q differs clearly from the target's p.
    target = tiny_llama(seed=0, layers=1, hidden=32, scale=0.15, tokenizer=SMALL_TOKENIZER)
    assistant = tiny_llama(seed=3, layers=1, hidden=32, scale=0.15, tokenizer=SMALL_TOKENIZER)
    return target, assistant


def warp(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """transformers' own processing, independent of assistgen's Sampler. logits [vocab] -> probs [vocab]."""
    scores = logits[None].float()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)[0]


@torch.inference_mode()
def exact_two_token_distribution(target, prompt=PROMPT, **settings) -> torch.Tensor:
    """P(t1, t2 | prompt) for every pair: [vocab, vocab]."""
    hf = target.hf
    p1 = warp(hf(torch.tensor([prompt])).logits[0, -1], **settings)  # [vocab]
    vocab = p1.shape[0]
    seqs = torch.tensor([prompt + [t] for t in range(vocab)])  # [vocab, len+1]
    p2 = torch.stack([warp(row, **settings) for row in hf(seqs).logits[:, -1]])  # [vocab, vocab]
    return p1[:, None] * p2


def sample_pairs(target, n: int, prompt=PROMPT, **kwargs) -> torch.Tensor:
    counts = torch.zeros(target.vocab_size, target.vocab_size)
    for seed in range(n):
        out = generate(target, prompt, max_new_tokens=2, seed=seed, eos_token_ids=(), **kwargs)
        counts[out.token_ids[0], out.token_ids[1]] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-squared goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = (probs * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    assert observed[~(probs.flatten() > 0)].sum() == 0, "sampled a pair the target gives probability 0"
    obs, exp = obs[keep].numpy(), exp[keep].numpy()
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", ["assistant", "lookup"])
def test_speculative_sampling_is_lossless(models, setting, drafter):
    target, assistant = models
    kwargs = {"assistant": assistant} if drafter == "assistant" else {"lookup": True}
    counts = sample_pairs(target, SAMPLES, schedule=Constant(2), **kwargs, **SETTINGS[setting])
    p = chi2_pvalue(counts, exact_two_token_distribution(target, **SETTINGS[setting]))
    assert p > 0.001, f"assisted samples do not follow the target distribution (p={p:.2e})"


@pytest.mark.parametrize("drafter", ["assistant", "lookup"])
def test_adaptive_policy_sampling_is_lossless(models, drafter):
    """The cost-aware policy (cheap made-up costs: it drafts, trims and checks unverified tokens) stays lossless."""
    target, assistant = models
    kwargs = {"assistant": assistant} if drafter == "assistant" else {"lookup": True}
    schedule = Adaptive(costs=[1.0 + 0.05 * k for k in range(17)], drafter_cost_prior=0.05)
    counts = sample_pairs(target, SAMPLES, schedule=schedule, temperature=1.0, **kwargs)
    p = chi2_pvalue(counts, exact_two_token_distribution(target, temperature=1.0))
    assert p > 0.001, f"adaptive samples do not follow the target distribution (p={p:.2e})"


def test_direct_sampling_matches_too(models):
    """The plain loop's sampler itself follows the target distribution (guards the reference)."""
    target, _ = models
    counts = sample_pairs(target, SAMPLES, temperature=1.0)
    assert chi2_pvalue(counts, exact_two_token_distribution(target, temperature=1.0)) > 0.001


def broken_resample_from_p(p, q, draft, sampler):
    """A classic bug: on rejection draw from p instead of the residual norm(max(p - q, 0))."""
    for i, x in enumerate(draft):
        if sampler.uniform() < min(1.0, float(p[i, x]) / float(q[i, x])):
            continue
        return i, sampler.draw(p[i])
    return len(draft), sampler.draw(p[len(draft)])


def broken_accept_if_likely(p, q, draft, sampler):
    """Accept-if-likely: keep a draft token whenever p(x) >= q(x), never randomly."""
    for i, x in enumerate(draft):
        if float(p[i, x]) >= float(q[i, x]):
            continue
        return i, sampler.draw(assistgen.sampling.residual(p[i], q[i], x))
    return len(draft), sampler.draw(p[len(draft)])


@pytest.mark.parametrize("broken", [broken_resample_from_p, broken_accept_if_likely])
def test_the_test_detects_a_broken_acceptance_rule(models, monkeypatch, broken):
    target, assistant = models
    monkeypatch.setattr(assistgen.engine, "verify_speculative", broken)
    counts = sample_pairs(target, SAMPLES, assistant=assistant, schedule=Constant(2), temperature=1.0)
    assert chi2_pvalue(counts, exact_two_token_distribution(target, temperature=1.0)) < 0.001


def test_same_seed_same_output_and_temperature_zero_ignores_seed(models):
    target, assistant = models
    a = generate(target, PROMPT, assistant=assistant, max_new_tokens=12, temperature=1.0, seed=7, eos_token_ids=())
    b = generate(target, PROMPT, assistant=assistant, max_new_tokens=12, temperature=1.0, seed=7, eos_token_ids=())
    assert a.token_ids == b.token_ids
    g1 = generate(target, PROMPT, assistant=assistant, max_new_tokens=12, seed=1, eos_token_ids=())
    g2 = generate(target, PROMPT, assistant=assistant, max_new_tokens=12, seed=2, eos_token_ids=())
    assert g1.token_ids == g2.token_ids
    others = {tuple(generate(target, PROMPT, max_new_tokens=12, temperature=1.0, seed=s, eos_token_ids=()).token_ids)
              for s in range(5)}
    assert len(others) > 1  # sampling does depend on the seed
