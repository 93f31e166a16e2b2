"""A drafter at its cheapest on the llama.cpp backend (`backends.llamacpp.derive`): a GGUF file requantized once and
its output head kept to the most frequent tokens (FR-Spec), on the embedded SmolLM2 (whose head is its tied input
table). The kept head gives the full head's logits for its tokens and -inf for the others; a requantized assistant
with a kept head drafts only kept tokens and leaves the target's output as it was; the refusals name the way out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assistgen import ModelLoadError, generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.llamacpp.gguf import tensor_infos
from assistgen.policy.rules import Constant

pytestmark = pytest.mark.integration

HEAD = 8192  # of SmolLM2's 49,152 tokens
Q4_0 = 2  # ggml's type id


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m", backend="llama.cpp")


@pytest.fixture(scope="module")
def cheap():
    return load_model("smollm2-135m", backend="llama.cpp", quantize="q4_0", head=HEAD)


def kept_ids(model) -> np.ndarray:
    import gguf

    d2t = next(t for t in gguf.GGUFReader(model.path).tensors if t.name == "d2t")
    return np.array(d2t.data).reshape(-1)


def test_a_kept_head_gives_the_full_heads_logits_for_its_tokens_and_minus_infinity_elsewhere(smol):
    pruned = load_model("smollm2-135m", backend="llama.cpp", head=HEAD)
    assert pruned.path != smol.path and pruned.vocab_size == smol.vocab_size
    kept = torch.from_numpy(kept_ids(pruned))
    assert len(kept) == HEAD and set(smol.eos_token_ids) <= set(kept.tolist())
    ids = encode_prompt(smol, "Write a haiku about the sea.", chat=True)
    full = smol.new_cache().feed(ids)[-1]  # [vocab]
    ours = pruned.new_cache().feed(ids)[-1]
    left_out = torch.ones(len(full), dtype=torch.bool)
    left_out[kept] = False
    assert torch.isneginf(ours[left_out]).all() and torch.isfinite(ours[kept]).all()
    torch.testing.assert_close(ours[kept], full[kept], rtol=0, atol=1e-4)


def test_a_requantized_assistant_with_a_kept_head_drafts_only_kept_tokens_and_changes_no_output(smol, cheap):
    infos, _ = tensor_infos(cheap.path)
    matrices = {name: info.ggml_type for name, info in infos.items() if len(info.shape) == 2}
    assert set(matrices.values()) == {Q4_0}, matrices  # every matrix requantized, the head too
    assert infos["output.weight"].shape == (576, HEAD)
    kept = set(kept_ids(cheap).tolist())
    drafted: list[int] = []
    for text in ("Write a Python function that reverses a string.", "List three facts about the Moon."):
        ids = encode_prompt(smol, text, chat=True)
        plain = generate(smol, ids, max_new_tokens=40)
        ours = generate(smol, ids, assistant=cheap, max_new_tokens=40, schedule=Constant(3))
        assert ours.token_ids == plain.token_ids
        assert ours.stats.mode == "assistant" and ours.stats.accepted_tokens > 0
        cache = cheap.new_cache()
        for end in range(len(ids), len(ids) + len(plain.token_ids)):  # its greedy draft at every position
            drafted.append(int(cache.feed((ids + plain.token_ids)[len(cache):end])[-1].argmax()))
    assert set(drafted) <= kept and len(set(drafted)) > 10


def test_a_derived_file_is_made_once_and_bad_asks_name_the_fix(cheap):
    again = load_model("smollm2-135m", backend="llama.cpp", quantize="q4_0", head=HEAD)
    assert again.path == cheap.path
    with pytest.raises(ModelLoadError, match="gemma3 model.*llama, qwen2"):
        load_model("gemma3-270m", backend="llama.cpp", head=HEAD)
    with pytest.raises(ModelLoadError, match="head must be a number of tokens of at least 256"):
        load_model("smollm2-135m", backend="llama.cpp", head=10)
    with pytest.raises(ModelLoadError, match="keeps the whole vocabulary"):
        load_model("smollm2-135m", backend="llama.cpp", head=60000)
    with pytest.raises(ModelLoadError, match="quantize='f16' is not a type llama.cpp's quantizer makes from a GGUF"):
        load_model("smollm2-135m", backend="llama.cpp", quantize="f16")
    with pytest.raises(ModelLoadError, match="head belong to the llama.cpp backend"):
        load_model("smollm2-135m", backend="torch", head=HEAD)
