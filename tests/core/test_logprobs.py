"""logprobs under speculation: each emitted token's log-probability and its top alternatives are the target's
own at that position, for every drafter, greedy and sampled. The reference is independent of the loop: one
forward pass of transformers over the whole emitted sequence (teacher forcing), its rows processed as the
generation's settings say (log-softmax of the logits when greedy; the log of the processed p when sampling)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import encode, tiny_llama
from mixed_tokenizers import byte_bpe, sentencepiece_bpe, tiny_model

from assistgen import Constant, EarlyExitDrafter, NGramCache, generate, stream
from assistgen.config import ConfigError, GenerationConfig
from assistgen.core.logprobs import FLOOR
from assistgen.spec.sampling import Sampler

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
N = 24
TOP = 3
SETTINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=20, top_p=0.95, seed=3)}


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(seed=0), tiny_llama(seed=1)


@pytest.fixture(scope="module")
def mixed():
    return tiny_model(byte_bpe(), seed=0), tiny_model(sentencepiece_bpe(), seed=1)


@torch.inference_mode()
def reference(model, prompt: list[int], tokens: list[int], config: GenerationConfig) -> torch.Tensor:
    """[n, vocab] log-probabilities of the distributions plain decoding chose each token from."""
    logits = model.hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    if config.greedy:
        return torch.log_softmax(logits, -1).clamp_min(FLOOR)
    return torch.log(Sampler(config).probs(logits)).clamp_min(FLOOR)


def check_logprobs(model, prompt: list[int], chunks, config: GenerationConfig) -> list[int]:
    tokens = [t for c in chunks for t in c.tokens]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token for lp in logprobs] == tokens
    want = reference(model, prompt, tokens, config)
    for i, lp in enumerate(logprobs):
        assert math.isclose(lp.logprob, float(want[i, lp.token]), abs_tol=2e-4), f"token {i}"
        assert len(lp.top) == TOP
        values, ids = want[i].topk(TOP)
        for (token, value), want_value in zip(lp.top, values.tolist(), strict=True):
            assert math.isclose(value, want_value, abs_tol=2e-4)
            assert math.isclose(value, float(want[i, token]), abs_tol=2e-4)  # (ties may swap ids)
    return tokens


def run(target, prompt, setting, **drafting):
    chunks = list(stream(target, prompt, schedule=Constant(4), max_new_tokens=N, eos_token_ids=(), logprobs=TOP,
                         **SETTINGS[setting], **drafting))
    return chunks, GenerationConfig(logprobs=TOP, **SETTINGS[setting])


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", ["plain", "lookup", "ngram-cache", "assistant", "early-exit"])
def test_logprobs_are_the_targets_for_every_drafter(pair, setting, drafter):
    target, assistant = pair
    prompt = encode(PROMPT)
    drafting = {"plain": {}, "lookup": {"lookup": True}, "assistant": {"assistant": assistant},
                "early-exit": {"assistant": EarlyExitDrafter(target, layers=1)}}.get(drafter, {})
    if drafter == "ngram-cache":
        cache = NGramCache()
        generate(target, prompt, ngram_cache=cache, max_new_tokens=N, eos_token_ids=(), **SETTINGS[setting])
        drafting = {"ngram_cache": cache}  # (it learnt this prompt's continuation)
    chunks, config = run(target, prompt, setting, **drafting)
    tokens = check_logprobs(target, prompt, chunks, config)
    stats = chunks[-1].stats
    if drafter != "plain":
        assert stats.drafted_tokens > 0, "the drafter proposed nothing: the test would not test speculation"
    if setting == "greedy":
        plain, _ = run(target, prompt, setting)
        assert tokens == [t for c in plain for t in c.tokens]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logprobs_in_universal_mode_are_the_targets(mixed, setting):
    target, assistant = mixed
    prompt = target.tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    chunks, config = run(target, prompt, setting, assistant=assistant)
    check_logprobs(target, prompt, chunks, config)
    assert chunks[-1].stats.drafted_tokens > 0


def test_no_logprobs_unless_asked(pair):
    target, _ = pair
    chunks = list(stream(target, encode(PROMPT), max_new_tokens=4, eos_token_ids=()))
    assert all(c.logprobs is None for c in chunks)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_a_bad_logprobs_count_is_refused(pair, bad):
    with pytest.raises(ConfigError, match="logprobs"):
        generate(pair[0], encode(PROMPT), max_new_tokens=2, logprobs=bad)


@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_are_the_targets_whether_the_prompt_comes_in_one_feed_or_several(pair, budget):
    from assistgen.core.engine import begin, step
    from assistgen.drafters.base import NoDrafter

    target, _ = pair
    prompt = encode(PROMPT)
    config = GenerationConfig(max_new_tokens=2, eos_token_ids=(), prompt_logprobs=2)
    state = begin(target, prompt, NoDrafter(), Constant(0), config)
    first = None
    while first is None:
        first = step([state], budget)[0]
    with torch.inference_mode():
        want = torch.log_softmax(target.hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    got = first.prompt_logprobs
    assert [lp.token for lp in got] == prompt[1:]
    for i, lp in enumerate(got):
        assert math.isclose(lp.logprob, float(want[i, prompt[i + 1]]), abs_tol=2e-4)
        assert [t for t, _ in lp.top] == want[i].topk(2).indices.tolist()
    assert state.stats.target_forward_passes == (1 if budget is None else -(-len(prompt) // budget))  # (the pass
    # that ends the prompt gives the first token)
