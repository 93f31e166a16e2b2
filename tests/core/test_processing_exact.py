"""The sampling set under speculation (`core/processing.py`), exactly: with penalties, logit bias, bad words,
min_tokens and min-p, one speculative step's output distribution equals plain sampling's, each plain position
processed by a reference written here from the fields' documented semantics (OpenAI's frequency and presence
penalties, HF's and vLLM's repetition penalty, vLLM's min_tokens and bad words); and greedy speculation with each
of them keeps plain decoding's tokens on a real model. Enumerated, not sampled (`test_rejection_exact.py`)."""

from __future__ import annotations

import itertools
import math
from functools import cache

import pytest
import torch
from reference import verify_speculative
from test_rejection_exact import TOKENIZER, assert_same_distribution, continued, enumerate_outcomes, target_joint

from assistgen import generate
from assistgen.config import GenerationConfig
from assistgen.core.processing import process_rows
from assistgen.core.sampling import Sampler
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.policy.rules import Constant

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = {1}
A, B, C, D = (TOKENIZER.convert_tokens_to_ids(ch) for ch in "abcd")
PROCESSED = {
    "penalties": GenerationConfig(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4,
                                  repetition_penalty=1.5),
    "bias-bad-words-min-tokens-min-p": GenerationConfig(temperature=0.8, logit_bias=((A, 1.5), (D, -2.0)),
                                                        bad_words=((C,), (A, B)), min_tokens=2, min_p=0.05),
}


def reference_row(logits: torch.Tensor, config: GenerationConfig, prompt: list[int], history: list[int]):
    """One position's logits [vocab] processed as the fields' documents say, token by token (no shared code)."""
    out = [float(x) for x in logits]
    for t in range(len(out)):
        if t in EOS and len(history) < config.min_tokens:
            out[t] = -math.inf
        for word in config.bad_words:
            if word[-1] == t and (len(word) == 1 or tuple(history[-(len(word) - 1):]) == word[:-1]):
                out[t] = -math.inf
        out[t] += dict(config.logit_bias).get(t, 0.0)
        if config.repetition_penalty != 1.0 and (t in prompt or t in history):
            out[t] = out[t] / config.repetition_penalty if out[t] > 0 else out[t] * config.repetition_penalty
        count = history.count(t)
        out[t] -= config.frequency_penalty * count + config.presence_penalty * (count > 0)
    return torch.tensor(out)


def plain_p_of(target, prompt: list[int], config: GenerationConfig):
    """p(. | prompt + prefix) [vocab] as plain sampling processes the position after `prefix` (the output so far)."""

    @cache
    def p_of(prefix: tuple) -> torch.Tensor:
        with torch.inference_mode():
            logits = target.hf(torch.tensor([prompt + list(prefix)])).logits[0, -1]  # [vocab]
        return Sampler(config).probs(reference_row(logits, config, prompt, list(prefix))[None])[0]

    return p_of


def speculative_step(drafter, target, prompt: list[int], k: int, config: GenerationConfig):
    """One step as the loop makes it: draft, the target's rows over it processed by `process_rows` (row i after
    draft[:i]), verified by the rejection rule."""

    def run(sampler):
        draft = drafter.propose(prompt, k, sampler, 0.0)
        with torch.inference_mode():
            logits = target.hf(torch.tensor([prompt + draft.tokens])).logits[0, len(prompt) - 1:]  # [n+1, vocab]
        rows = process_rows(logits, config, prompt, [], draft.tokens, EOS)
        accepted, token = verify_speculative(sampler.probs(rows), draft.probs, draft.tokens, sampler)
        return tuple(draft.tokens[:accepted]) + (token,)

    return run


@pytest.fixture(scope="module")
def pair():
    from helpers import tiny_llama

    target = tiny_llama(seed=0, layers=2, hidden=32, scale=0.25, tokenizer=TOKENIZER)
    assistant = tiny_llama(seed=3, layers=1, hidden=32, scale=0.25, tokenizer=TOKENIZER)
    return target, assistant


@pytest.mark.parametrize("setting", list(PROCESSED))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_sampling_with_the_sampling_set_follows_plain_sampling(pair, k, setting):
    target, assistant = pair
    prompt = TOKENIZER("abcab")["input_ids"]
    config = PROCESSED[setting]
    p_of = plain_p_of(target, prompt, config)
    emitted = enumerate_outcomes(speculative_step(AssistantDrafter(assistant, target), target, prompt, k, config),
                                 config)
    assert_same_distribution(continued(emitted, k + 1, p_of), target_joint(k + 1, p_of))


def test_rows_that_ignore_the_draft_are_caught(pair):
    """The check can fail: processing every row as if the draft were not there (the output alone as history)."""
    target, assistant = pair
    prompt = TOKENIZER("abcab")["input_ids"]
    config = PROCESSED["penalties"]
    p_of = plain_p_of(target, prompt, config)

    def run(sampler):
        draft = AssistantDrafter(assistant, target).propose(prompt, 2, sampler, 0.0)
        with torch.inference_mode():
            logits = target.hf(torch.tensor([prompt + draft.tokens])).logits[0, len(prompt) - 1:]
        rows = process_rows(logits, config, prompt, [], [], EOS)  # (the draft left out of the history)
        accepted, token = verify_speculative(sampler.probs(rows), draft.probs, draft.tokens, sampler)
        return tuple(draft.tokens[:accepted]) + (token,)

    with pytest.raises(AssertionError, match="differs from the target"):
        assert_same_distribution(continued(enumerate_outcomes(run, config), 3, p_of), target_joint(3, p_of))


GREEDY = {
    "frequency+presence": {"frequency_penalty": 0.8, "presence_penalty": 0.5},
    "repetition": {"repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": ((A, 3.0), (B, -3.0))},
    "bad_words": {"bad_words": ((C, D), (A,))},
    "min_tokens+ignore_eos": {"min_tokens": 6, "ignore_eos": True},
}


@pytest.mark.parametrize("fields", list(GREEDY))
def test_greedy_speculation_with_each_field_keeps_plain_decodings_tokens(pair, fields):
    target, assistant = pair
    settings = {"max_new_tokens": 24, **GREEDY[fields]}
    plain = generate(target, "abcab", **settings)
    drafted = generate(target, "abcab", assistant=assistant, schedule=Constant(k=3), **settings)
    assert drafted.token_ids == plain.token_ids
    assert drafted.stats.drafted_tokens > 0


REAL = {**GREEDY, "frequency+presence": {"frequency_penalty": 1.5, "presence_penalty": 1.0},
        "repetition": {"repetition_penalty": 1.6}, "bad_words": {"bad_words": ((1171,), (260, 2644))},
        "logit_bias": {"logit_bias": ((28, 10.0),)}, "min_tokens+ignore_eos": {"min_tokens": 40, "ignore_eos": True}}
RIDDLE = "the cat sat on the mat. " * 4 + "the cat"  # (SmolLM2's ids: " mat" 1171, " the" 260, " cat" 2644, "," 28)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_greedy_with_each_field_on_a_real_model_is_plain_decodings_on_both_backends(backend, smollm2):
    from assistgen import load_model

    model = smollm2 if backend == "torch" else load_model("smollm2-135m", backend="llama.cpp")
    base = generate(model, RIDDLE, max_new_tokens=48)
    accepted = 0
    for fields, settings in REAL.items():
        plain = generate(model, RIDDLE, max_new_tokens=48, **settings)
        drafted = generate(model, RIDDLE, max_new_tokens=48, lookup=True, schedule=Constant(k=4), **settings)
        assert drafted.token_ids == plain.token_ids, fields
        assert drafted.stats.drafted_tokens > 0, fields  # (drafts verified on processed rows)
        accepted += drafted.stats.accepted_tokens
        if fields != "min_tokens+ignore_eos":  # (the base never ends before its 48 tokens)
            assert plain.token_ids != base.token_ids, f"{fields} changed nothing"
    assert accepted > 48  # (and kept: rows after accepted draft tokens processed with them as history)


def test_every_combination_of_penalties_changes_only_what_it_names():
    """process_rows on a row with no history changes nothing but the biased and forbidden tokens."""
    logits = torch.randn(1, 7)
    for frequency, presence in itertools.product((0.0, 1.0), repeat=2):
        config = GenerationConfig(frequency_penalty=frequency, presence_penalty=presence)
        assert torch.equal(process_rows(logits, config, [], [], [], EOS), logits)
