"""Speculative sampling is lossless: the distribution of the first four tokens equals the target's.

The reference distribution is computed exactly from the target with transformers' own logits
warpers (temperature, top-k, top-p); assisted samples are compared with chi-squared tests on the
pairs of consecutive tokens. Four new tokens with a lookahead of 3 let the first step verify draft
positions 1..3, and every run asserts that positions 2 and 3 were judged often (`position_checks`),
so a rule that is only right for the first draft token fails here. The rules themselves are
checked exactly, by enumeration, in test_rejection_exact.py.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import char_tokenizer, tiny_llama
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import assistgen.core.sampling
import assistgen.core.verify
from assistgen import Adaptive, Constant, generate
from assistgen.backends.torch.model import Model

SMALL = char_tokenizer("abcd")  # 7 tokens: <bos>, <eos>, <pad>, a..d
PROMPT = SMALL("abcab")["input_ids"]
LENGTH = 5  # new tokens per sample: the first from the prefill, then one step can verify 3 draft tokens
SAMPLES = 3000
BROKEN_SAMPLES = 1000  # a broken acceptance rule with the far assistant: p about 1e-42 at 1000 samples, 1e-15 at 500
SETTINGS = {
    "plain-t1": dict(temperature=1.0),
    "t0.7-topk5-topp0.9": dict(temperature=0.7, top_k=5, top_p=0.9),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    """The target, and an assistant close to it (its weights plus noise): q differs from p, yet drafts are
    accepted often enough that positions 2 and 3 are judged in hundreds of samples."""
    target = tiny_llama(seed=0, layers=1, hidden=32, scale=0.3, tokenizer=SMALL)
    return target, perturbed(target, noise=0.02)


@pytest.fixture(scope="module")
def far_assistant():
    """An unrelated assistant: q far from p, so a wrong rejection rule shows clearly at the first position."""
    return tiny_llama(seed=3, layers=1, hidden=32, scale=0.3, tokenizer=SMALL)


def perturbed(model: Model, noise: float) -> Model:
    hf = copy.deepcopy(model.hf)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return Model(hf, model.tokenizer, f"{model.name}+noise{noise}")


def warp(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """transformers' own processing, independent of assistgen's Sampler. logits [n, vocab] -> probs [n, vocab]."""
    scores = logits.float()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)


@torch.inference_mode()
def exact_distribution(target, prompt=PROMPT, length=LENGTH, **settings) -> torch.Tensor:
    """P(t_1 .. t_length | prompt) for every sequence: [vocab] * length.

    One batched forward over every (t_1 .. t_length-1) gives p(. | t_<=j) at each position j.
    """
    vocab = target.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=length - 1)))  # [vocab**(length-1), length-1]
    seqs = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    logits = target.hf(seqs).logits[:, len(prompt) - 1 :]  # [n, length, vocab]
    probs = warp(logits.reshape(-1, vocab), **settings).view(len(prefixes), length, vocab)
    prefix_prob = probs[:, :-1].gather(-1, prefixes[..., None])[..., 0].prod(-1)  # [n]
    return (prefix_prob[:, None] * probs[:, -1]).view(*[vocab] * length)


def sample(target, n: int, prompt=PROMPT, **kwargs) -> tuple[torch.Tensor, list[int]]:
    """Counts of sampled sequences [vocab] * LENGTH, and how often each draft position was judged."""
    counts = torch.zeros(*[target.vocab_size] * LENGTH)
    checks: list[int] = []
    for seed in range(n):
        out = generate(target, prompt, max_new_tokens=LENGTH, seed=seed, eos_token_ids=(), **kwargs)
        counts[tuple(out.token_ids)] += 1
        for i, c in enumerate(out.stats.position_checks):
            checks[i:i + 1] = [(checks[i] if i < len(checks) else 0) + c]
    return counts, checks


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-squared goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = (probs * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    assert observed[~(probs.flatten() > 0)].sum() == 0, "sampled a sequence the target gives probability 0"
    obs, exp = obs[keep].numpy(), exp[keep].numpy()
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def pair_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The smallest p-value over the pairs of consecutive positions (1,2), (2,3), (3,4), Bonferroni-corrected."""
    dims = range(counts.dim())
    pvalues = []
    for i in range(counts.dim() - 1):
        rest = [d for d in dims if d not in (i, i + 1)]
        pvalues.append(chi2_pvalue(counts.sum(rest), probs.sum(rest)))
    return min(pvalues) * len(pvalues)


def assert_lossless(counts, checks, probs, positions: int = 3, min_checks: int = 300) -> None:
    """Chi-squared on consecutive pairs, after checking that draft positions 1..`positions` were judged often."""
    assert len(checks) >= positions and min(checks[:positions]) >= min_checks, f"draft positions judged {checks} times"
    p = pair_pvalue(counts, probs)
    assert p > 0.001, f"assisted samples do not follow the target distribution (p={p:.2e})"


SLOW = pytest.mark.slow  # `make test-slow`: more of the same chi-squared checks (docs/benchmarks.md)


@pytest.mark.parametrize("drafter,setting", [
    ("assistant", "t0.7-topk5-topp0.9"), pytest.param("assistant", "plain-t1", marks=SLOW),
    pytest.param("lookup", "plain-t1", marks=SLOW), pytest.param("lookup", "t0.7-topk5-topp0.9", marks=SLOW)])
def test_speculative_sampling_is_lossless(models, setting, drafter):
    target, assistant = models
    kwargs = {"assistant": assistant} if drafter == "assistant" else {"lookup": True}
    counts, checks = sample(target, SAMPLES, schedule=Constant(3), **kwargs, **SETTINGS[setting])
    # Lookup's one-hot q is accepted with probability p(token) (0 outside top-k), so its later positions are
    # reached less often; its rule past the first position is the assistant's with q one-hot.
    positions, min_checks = (3, 300) if drafter == "assistant" else (2, 50)
    assert_lossless(counts, checks, exact_distribution(target, **SETTINGS[setting]), positions, min_checks)


@pytest.mark.parametrize("drafter", ["lookup", pytest.param("assistant", marks=SLOW)])
def test_adaptive_policy_sampling_is_lossless(models, drafter):
    """The cost-aware policy (cheap made-up costs: it drafts, trims and checks unverified tokens) stays lossless."""
    target, assistant = models
    kwargs = {"assistant": assistant} if drafter == "assistant" else {"lookup": True}
    schedule = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)], drafter_cost_prior=0.05)
    counts, checks = sample(target, SAMPLES, schedule=schedule, temperature=1.0, **kwargs)
    assert_lossless(counts, checks, exact_distribution(target, temperature=1.0), positions=2, min_checks=50)


@SLOW
def test_direct_sampling_matches_too(models):
    """The plain loop's sampler itself follows the target distribution (guards the reference)."""
    target, _ = models
    counts, checks = sample(target, SAMPLES, temperature=1.0)
    assert checks == []
    assert pair_pvalue(counts, exact_distribution(target, temperature=1.0)) > 0.001


# Broken rules, put in the loop's verification (`core.verify`) piece by piece: the acceptance decision, the
# distribution a stop draws from, the draft probabilities read.


def residual_from_p(p, q, draft, at, rejected=None):
    """A classic bug: on rejection draw from p instead of the residual norm(max(p - q, 0))."""
    return p[at]


def accept_if_likely(p_x, q_x, sampler):
    """Accept-if-likely: keep a draft token whenever p(x) >= q(x), never randomly."""
    for i, (p_i, q_i) in enumerate(zip(p_x, q_x, strict=True)):
        if p_i < q_i:
            return i, True
    return len(p_x), True


def first_row_of_q(piece):
    """An indexing bug invisible at the first draft position: positions 2.. are judged against q's first row."""
    def broken(p, q, draft, *args):
        if q is not None and len(draft) > 1:
            q = q[:1].expand(len(q), -1)
        return piece(p, q, draft, *args)
    return broken


@pytest.mark.parametrize("piece,broken", [("stop_distribution", residual_from_p),
                                          pytest.param("accepted_count", accept_if_likely, marks=SLOW)])
def test_the_test_detects_a_broken_acceptance_rule(models, far_assistant, monkeypatch, piece, broken):
    target, _ = models
    monkeypatch.setattr(assistgen.core.verify, piece, broken)
    counts, _ = sample(target, BROKEN_SAMPLES, assistant=far_assistant, schedule=Constant(3), temperature=1.0)
    assert pair_pvalue(counts, exact_distribution(target, temperature=1.0)) < 0.001


def test_the_test_detects_keyed_draws_that_ignore_the_position(models, monkeypatch):
    """Copied drafts are judged by keyed draws (`core.verify.keyed`): one uniform for every position of a sample
    makes its tokens depend on each other, which the pairs' test sees."""
    import assistgen.spec.sampling as spec_sampling

    target, _ = models
    monkeypatch.setattr(spec_sampling, "keyed_uniform", lambda key, position, real=spec_sampling.keyed_uniform:
                        real(key, 0))
    counts, _ = sample(target, BROKEN_SAMPLES, lookup=True, schedule=Constant(3), temperature=1.0)
    assert pair_pvalue(counts, exact_distribution(target, temperature=1.0)) < 0.001


@SLOW
def test_the_test_detects_a_bug_beyond_the_first_draft_position(models, monkeypatch):
    target, assistant = models
    for piece in ("draft_probabilities", "stop_distribution"):
        monkeypatch.setattr(assistgen.core.verify, piece, first_row_of_q(getattr(assistgen.core.verify, piece)))
    counts, checks = sample(target, SAMPLES, assistant=assistant, schedule=Constant(3), temperature=1.0)
    assert min(checks[:3]) >= 300
    assert pair_pvalue(counts, exact_distribution(target, temperature=1.0)) < 0.001


def test_same_seed_same_output_and_temperature_zero_ignores_seed(models):
    target, assistant = models
    run = dict(assistant=assistant, schedule=Constant(3), max_new_tokens=12, eos_token_ids=())
    a = generate(target, PROMPT, temperature=1.0, seed=7, **run)
    b = generate(target, PROMPT, temperature=1.0, seed=7, **run)
    assert a.stats.drafted_tokens > 0 and a.stats.accepted_tokens > 0
    assert a.token_ids == b.token_ids
    g1 = generate(target, PROMPT, seed=1, **run)
    g2 = generate(target, PROMPT, seed=2, **run)
    assert g1.stats.drafted_tokens > 0
    assert g1.token_ids == g2.token_ids
    others = {tuple(generate(target, PROMPT, max_new_tokens=12, temperature=1.0, seed=s, eos_token_ids=()).token_ids)
              for s in range(5)}
    assert len(others) > 1  # sampling does depend on the seed


@pytest.mark.parametrize("temperature", [4.2499333555316727e-271, 1e-30, 1e-6])
def test_a_tiny_temperature_gives_the_limit_distribution_not_nan(temperature):
    """A temperature far below any logit gap (the server's fuzzer sent 4.2e-271) puts all mass on the argmax."""
    from assistgen.config import GenerationConfig

    logits = torch.tensor([[1.0, 30.0, -2.0, 29.5], [0.0, -1.0, 3.0, float("-inf")]])  # [2, vocab]
    for top_k, top_p in ((0, 1.0), (2, 0.9)):
        config = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        probs = assistgen.core.sampling.Sampler(config).probs(logits)
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
