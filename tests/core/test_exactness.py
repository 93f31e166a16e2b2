"""Greedy exactness: assisted output is token-identical to transformers' generate() and a naive loop."""

from __future__ import annotations

import pytest
from helpers import encode, hf_greedy, naive_greedy, tiny_gemma3, tiny_gpt2, tiny_llama

from assistgen import Adaptive, Constant, Heuristic, generate
from assistgen.drafters.lookup import PromptLookupDrafter

PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "Once upon a time, in a land far away, there lived",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
]
# The adaptive policy with cheap made-up costs, so that it drafts, trims, switches off and probes.
ADAPTIVE = Adaptive(curve=[1.0 + 0.05 * k for k in range(17)], drafter_cost_prior=0.05)
SCHEDULES = {"k1": Constant(1), "k4": Constant(4), "heuristic": Heuristic(), "adaptive": ADAPTIVE}
ARCHS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
N = 40


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    make = ARCHS[request.param]
    return make(seed=0), make(seed=1)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_loop_matches_transformers_and_naive(pair, prompt):
    target, _ = pair
    ids = encode(prompt)
    ours = generate(target, ids, max_new_tokens=N, eos_token_ids=()).token_ids
    assert ours == hf_greedy(target, ids, N)
    assert ours == naive_greedy(target, ids, N)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("drafter", ["random-assistant", "self", "lookup"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_assisted_matches_transformers(pair, prompt, drafter, schedule):
    target, other = pair
    ids = encode(prompt)
    kwargs = {"random-assistant": {"assistant": other}, "self": {"assistant": target}, "lookup": {"lookup": True}}
    out = generate(target, ids, max_new_tokens=N, eos_token_ids=(), schedule=SCHEDULES[schedule], **kwargs[drafter])
    assert out.token_ids == hf_greedy(target, ids, N)
    if drafter == "self":  # the target drafting for itself agrees everywhere
        assert out.stats.acceptance_rate == 1.0
    if drafter == "random-assistant":
        assert out.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("drafter", ["random-assistant", "lookup"])
def test_sliding_window_rollback_past_the_window(drafter):
    """Gemma-3 layout (window 16 here): context of ~100 tokens, rolled back at every rejection."""
    target, other = tiny_gemma3(seed=0, scale=0.02), tiny_gemma3(seed=1, scale=0.02)
    ids = encode("Sliding windows must roll back exactly: " * 2)
    assert len(ids) > 16
    kwargs = {"assistant": other} if drafter == "random-assistant" else {"lookup": True}
    out = generate(target, ids, max_new_tokens=60, eos_token_ids=(), schedule=Constant(5), **kwargs)
    assert out.token_ids == hf_greedy(target, ids, 60)
    assert out.stats.accepted_tokens < out.stats.drafted_tokens  # there were rollbacks
    assert out.stats.steps < 60 or drafter == "random-assistant"


def test_lookup_drafter_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    ids = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # the most recent earlier occurrence of [2, 3] is followed by 5, 6, 7
    assert d.propose(ids, 3, sampler=None).tokens == [5, 6, 7]
    assert d.propose([1, 2, 3], 3, sampler=None).tokens == []
    # falls back to shorter n-grams: [8, 3] never occurred, [3] did
    assert d.propose([3, 4, 5, 8, 3], 2, sampler=None).tokens == [4, 5]


@pytest.mark.integration
def test_real_smollm2_with_a_shallower_copy_as_assistant(smollm2):
    """SmolLM2-135M drafted by itself truncated to 18 of its 30 layers (same tokenizer, other logits)."""
    import copy

    from assistgen.backends.torch.model import Model

    shallow = copy.deepcopy(smollm2.hf)
    shallow.model.layers = shallow.model.layers[:18]
    shallow.config.num_hidden_layers = 18
    assistant = Model(shallow, smollm2.tokenizer, "smollm2-135m[:18]")
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three facts about the Moon."}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    n = 48
    out = generate(smollm2, ids, assistant=assistant, max_new_tokens=n, schedule=Heuristic(max_k=6))
    assert out.token_ids == hf_greedy(smollm2, ids, n, stop_at_eos=True)
    assert 0 < out.stats.acceptance_rate < 1
