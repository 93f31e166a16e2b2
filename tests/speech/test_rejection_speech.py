"""The enumerated rejection tests (tests/core/test_rejection_exact.py) on the speech path: a tiny random Whisper
heard on random features is the target, and every drafter's sampled step must emit exactly its distribution:
an assistant Whisper with its own encoder, one whose head computes only part of the vocabulary (q = 0 on the
rest), early exit, prompt lookup."""

from __future__ import annotations

import pytest
import torch
from core.test_rejection_exact import SETTINGS, assert_same_distribution, drafter_step, step_distribution, target_joint
from helpers import SMALL_TOKENIZER

from assistgen.backends.torch.speech import SpeechModel
from assistgen.config import GenerationConfig
from assistgen.core.sampling import Sampler
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.drafters.early_exit import EarlyExitDrafter
from assistgen.drafters.lookup import PromptLookupDrafter

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = len(SMALL_TOKENIZER)  # <bos> <eos> <pad> a..h
START, END = 0, 1


def tiny_whisper(seed: int, decoder_layers: int) -> SpeechModel:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=decoder_layers,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, num_mel_bins=4, max_source_positions=8, max_target_positions=32,
                           decoder_start_token_id=START, eos_token_id=END, pad_token_id=2, bos_token_id=START)
    hf = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0)  # peaked enough distributions that drafts are often accepted, and often not
    hf.generation_config.suppress_tokens = [2]  # <pad>: -inf on every row
    hf.generation_config.begin_suppress_tokens = [END]
    return SpeechModel(hf, SMALL_TOKENIZER, None, name=f"tiny-whisper-{seed}")


@pytest.fixture(scope="module")
def heard():
    features = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    target, assistant = tiny_whisper(0, 2), tiny_whisper(1, 1)
    prompt = [START, 3, 4, 5, 3, 4]  # <bos> a b c a b: the first generated token is at index 6
    return target.listen(features, begin=1), assistant, features, prompt


def heard_p_of(model, prompt: list[int], config: GenerationConfig, depth: int):
    """p(. | prompt + prefix) [vocab] under the heard decoder (suppression included) for every prefix up to `depth`
    tokens, each prefix fed after a fork of its parent's cache."""
    sampler, table = Sampler(config), {}

    def walk(cache, prefix, logits):
        table[prefix] = sampler.probs(logits[None])[0]
        if len(prefix) < depth:
            for t in range(VOCAB):
                child = cache.fork()
                walk(child, prefix + (t,), child.feed([t])[-1])

    cache = model.new_cache()
    walk(cache, (), cache.feed(prompt)[-1])
    return table.__getitem__


def check(drafter, target, prompt, k, setting) -> dict:
    config = SETTINGS[setting]
    p_of = heard_p_of(target, prompt, config, k)
    got, lengths = step_distribution(drafter_step(drafter, prompt, k, 0.0), p_of, k, config)
    assert_same_distribution(got, target_joint(k + 1, p_of))
    return lengths


@pytest.mark.parametrize("setting", ["t1", "t0.7-topk4-topp0.9"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("part", [None, 6], ids=["whole head", "head of 6 tokens"])
def test_an_assistant_whisper_is_exact(heard, k, setting, part):
    target, assistant, features, prompt = heard
    drafter = AssistantDrafter(assistant.listen(features, begin=1, draft_vocabulary=part), target)
    lengths = check(drafter, target, prompt, k, setting)
    assert lengths.get(k, 0) > 0  # full drafts happen


def test_a_part_of_the_head_drafts_nothing_else(heard):
    _, assistant, features, _ = heard
    logits = assistant.listen(features, begin=1, draft_vocabulary=6).new_cache().feed([START, 3])[-1]
    assert torch.isinf(logits[6:]).all() and torch.isfinite(logits[:6]).sum() == 5  # ids 0..5, <pad> suppressed
    assert torch.isfinite(logits[END])  # the end token is always drafted


@pytest.mark.parametrize("k", [1, 2, 3])
def test_early_exit_and_lookup_on_speech_are_exact(heard, k):
    target, _, _, prompt = heard
    check(EarlyExitDrafter(target, layers=1), target, prompt, k, "t1")
    lengths = check(PromptLookupDrafter(), target, prompt, k, "t1")
    assert lengths.get(k, 0) == pytest.approx(1.0)


def test_begin_suppression_applies_to_the_first_generated_token_only():
    features = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    model = tiny_whisper(0, 2).listen(features, begin=3)
    rows = model.new_cache().feed([START, 3, 4, 5], 4)  # rows predict indices 1, 2, 3, 4
    assert [bool(torch.isinf(r[END])) for r in rows] == [False, False, True, False]
    assert torch.isinf(rows[:, 2]).all()  # <pad> everywhere


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_timestamp_rules_keep_sampling_exact(k):
    """With Whisper's timestamp rules (here ids 8..10 are the timestamps, 7 is <|notimestamps|>, the first token at
    most one step in), the target's distribution is the masked one at every row, each row masked on the tokens
    before it; an assistant with the same rules and prompt lookup (whose drafts the rules may forbid) emit it."""
    features = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    models = []
    for seed, layers in ((0, 2), (1, 1)):
        model = tiny_whisper(seed, layers)
        model.hf.generation_config.no_timestamps_token_id = 7
        model.hf.generation_config.max_initial_timestamp_index = 1
        models.append(model)
    prompt = [START, 3, 4, 8, 3, 4]  # the first generated token is at index 6, and it must be a timestamp
    target = models[0].listen(features, begin=len(prompt), timestamps=True)
    first_row = target.new_cache().feed(prompt)[-1]
    assert torch.isfinite(first_row).nonzero().flatten().tolist() == [8, 9]  # <|0.00|> or the next one, nothing else
    assistant = models[1].listen(features, begin=len(prompt), timestamps=True)
    lengths = check(AssistantDrafter(assistant, target), target, prompt, k, "t1")
    assert lengths.get(k, 0) > 0  # full drafts happen
    check(PromptLookupDrafter(), target, prompt, k, "t0.7-topk4-topp0.9")  # (it drafts 3 4 8 ...: the rules decide)
