"""Early-exit self-speculation: the truncated model shares the target's weights, drafts exactly, calibrates."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TOKENIZER, encode, hf_greedy, naive_greedy, tiny_gemma3, tiny_gpt2, tiny_llama

from assistgen import Constant, generate
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.model import Model
from assistgen.drafters.early_exit import EarlyExitDrafter, best_speedup, calibrate_exit_layer
from assistgen.policy.costs import known_costs
from assistgen.policy.gain import MAX_K, expected_gain

ARCHS = {"llama": tiny_llama, "gemma3": tiny_gemma3, "gpt2": tiny_gpt2}


def layer_list(hf: torch.nn.Module) -> torch.nn.ModuleList:
    base = hf.base_model
    return base.layers if hasattr(base, "layers") else base.h


def deep_cut(model: Model, layers: int) -> Model:
    """The reference: an independent deep copy with its layer list cut (as tests/api/test_real_models.py does)."""
    hf = copy.deepcopy(model.hf)
    base = hf.base_model
    if hasattr(base, "layers"):
        base.layers = base.layers[:layers]
    else:
        base.h = base.h[:layers]
    hf.config.num_hidden_layers = layers
    return Model(hf, model.tokenizer, f"{model.name}[:{layers}] deep")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_truncated_model_shares_weights_and_leaves_the_target_alone(arch):
    target = ARCHS[arch](layers=3)
    truncated = target.truncated(2)
    target_ptrs = {p.data_ptr() for p in target.hf.parameters()}
    own = [p for p in truncated.hf.parameters() if p.data_ptr() not in target_ptrs]
    assert own == []  # no parameter memory of its own
    assert len(layer_list(truncated.hf)) == 2 and truncated.hf.config.num_hidden_layers == 2
    assert len(layer_list(target.hf)) == 3 and target.hf.config.num_hidden_layers == 3
    assert truncated.hf.get_output_embeddings() is target.hf.get_output_embeddings()
    for model, layers in ((truncated, 2), (target, 3)):
        cache = KVCache(model)
        cache.feed(encode("abc"))
        assert len(cache.kv.keys) == layers  # one key buffer per layer that ran


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_truncated_logits_equal_a_deep_copy_cut_to_n_layers(arch, layers):
    target = ARCHS[arch](layers=3)
    ids = torch.tensor([encode("Sliding windows must roll back exactly: " * 2)])  # longer than gemma's window 16
    with torch.inference_mode():
        ours = target.truncated(layers).hf(ids).logits
        reference = deep_cut(target, layers).hf(ids).logits
        full = target.hf(ids).logits
    assert torch.equal(ours, reference)
    assert not torch.allclose(ours, full)


def test_gemma3_truncation_keeps_the_first_layer_types():
    target = tiny_gemma3(layers=3)
    truncated = target.truncated(2)
    assert truncated.hf.config.layer_types == ["sliding_attention", "sliding_attention"]
    assert target.hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert truncated.hf.config.sliding_window == target.hf.config.sliding_window


@pytest.mark.parametrize("layers", [0, 3, -1, 1.5, True, None])
def test_bad_layer_counts_are_refused_clearly(layers):
    with pytest.raises(ValueError, match=r"1 <= layers < 3"):
        tiny_llama(layers=3).truncated(layers)


def test_unsupported_architecture_is_named():
    model = Model(torch.nn.Sequential(torch.nn.Linear(4, 4)), TOKENIZER, "odd")
    with pytest.raises(ValueError, match="Sequential"):
        model.truncated(1)


@pytest.mark.parametrize("layers", [1, 2])
def test_llama_early_exit_output_is_exact(layers):
    target = tiny_llama(layers=3)
    ids = encode("Once upon a time, in a land far away, there lived")
    drafter = EarlyExitDrafter(target, layers=layers)
    out = generate(target, ids, assistant=drafter, max_new_tokens=40, eos_token_ids=(), schedule=Constant(4))
    assert out.token_ids == hf_greedy(target, ids, 40)
    assert out.token_ids == naive_greedy(target, ids, 40)
    assert out.stats.drafted_tokens > 0
    assert drafter.report() == {"early_exit_layers": layers, "early_exit_agreement": None}


@pytest.mark.parametrize("layers", [1, 2])
def test_gemma3_early_exit_rolls_back_past_the_sliding_window(layers):
    """Window 16, a prompt of ~80 tokens: the drafter's sliding-window cache is rolled back at rejections."""
    target = tiny_gemma3(seed=0, scale=0.02)
    ids = encode("Sliding windows must roll back exactly: " * 2)
    assert len(ids) > 16
    out = generate(target, ids, assistant=EarlyExitDrafter(target, layers=layers), max_new_tokens=60,
                   eos_token_ids=(), schedule=Constant(5))
    assert out.token_ids == hf_greedy(target, ids, 60)
    assert out.token_ids == naive_greedy(target, ids, 60)
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens  # some accepted, some rolled back


def test_calibration_picks_a_valid_exit_and_reports_it():
    target = tiny_llama(layers=4)
    layers, table = calibrate_exit_layer(target)  # the package's article, in the character tokenizer
    assert 1 <= layers < 4
    assert [row["layers"] for row in table] == [1, 2, 3]
    assert all(0.0 <= row["agreement"] <= 1.0 for row in table)
    costs = [row["cost"] for row in table]
    assert all(0 < c < 1 for c in costs) and costs == sorted(costs)
    assert max(table, key=lambda row: row["best_speedup"])["layers"] == layers
    # a verification that costs nothing extra per token favours longer drafts than a steep one
    _, free = calibrate_exit_layer(target, verify_cost=[1.0] * 9)
    _, steep = calibrate_exit_layer(target, verify_cost=[1.0 + k for k in range(9)])
    assert all(f["best_speedup"] >= s["best_speedup"] for f, s in zip(free, steep, strict=True))

    drafter = EarlyExitDrafter(target, calibration_ids=encode("the cat sat on the mat. " * 4))
    report = drafter.report()
    assert 1 <= report["early_exit_layers"] < 4 and 0.0 <= report["early_exit_agreement"] <= 1.0
    assert drafter.name == "early-exit"


def test_calibration_weighs_the_targets_measured_verification_costs():
    target = tiny_llama(layers=3)
    _, table = calibrate_exit_layer(target)
    measured = list(known_costs(target).curve)  # measured once (the target was not prepared), kept in the book:
    # the curve calibration used
    for row in table:
        assert (row["best_speedup"], row["best_k"]) == best_speedup(row["agreement"], row["cost"], measured)
    speedup, k = best_speedup(0.9, 0.1, measured)
    assert 1 <= k <= MAX_K and speedup == max(expected_gain([0.9], j, measured, 0.1) for j in range(1, MAX_K + 1))


def test_a_drafter_calibrates_once_per_target(monkeypatch):
    import assistgen.drafters.early_exit as early_exit

    calls = []
    real = early_exit.calibrate_exit_layer
    monkeypatch.setattr(early_exit, "calibrate_exit_layer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    target, other = tiny_llama(layers=3), tiny_llama(layers=3)
    first, second, third = EarlyExitDrafter(target), EarlyExitDrafter(target), EarlyExitDrafter(other)
    assert len(calls) == 2  # target once, other once
    assert first.report() == second.report() and first.calibration == second.calibration
    first.calibration[0]["layers"] = 99  # each drafter gets its own copy of the table
    assert second.calibration[0]["layers"] == 1 and third.layers >= 1


def test_calibration_needs_some_text():
    with pytest.raises(ValueError, match="at least 2 token ids"):
        calibrate_exit_layer(tiny_llama(layers=3), ids=[5])


@pytest.mark.integration
def test_real_smollm2_early_exit_equals_plain_greedy(smollm2):
    from assistgen.api import encode_prompt
    from assistgen.drafters.early_exit import default_calibration_ids

    # A shorter calibration text than the default keeps this test quick; the choice is still calibrated.
    drafter = EarlyExitDrafter(smollm2, calibration_ids=default_calibration_ids(smollm2, 64))
    assert 1 <= drafter.layers < smollm2.config.num_hidden_layers
    ids = encode_prompt(smollm2, "List three facts about the Moon.", chat=True)
    out = generate(smollm2, ids, assistant=drafter, max_new_tokens=24, schedule=Constant(3))
    assert out.token_ids == hf_greedy(smollm2, ids, 24, stop_at_eos=True)
    assert out.stats.drafted_tokens > 0
