"""The small-row linear transform computes the same product and can be removed again."""

from __future__ import annotations

import pytest
import torch
from conftest import encode, hf_greedy, naive_greedy, tiny_gemma3, tiny_llama

from assistgen import generate
from assistgen.cache import KVCache
from assistgen.transforms import (
    _grouped_sdpa,
    applied_routes,
    grouped_attention_applied,
    grouped_query_attention,
    is_applied,
    remove_small_rows_linear,
    small_rows_linear,
    untransformed,
)


@pytest.mark.parametrize("routes", ["mkl", "onednn", ["mkl", "mkl", "mkl"] + ["onednn"] * 30])
def test_same_product_for_every_row_count(routes):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 300)
    for rows in (1, 2, 3, 5, 8, 32, 33, 100):
        x = torch.randn(2, rows, 64)[:1]  # [1, rows, in]
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        small_rows_linear(layer, mode="on", routes=routes)
        got = layer(x)
        remove_small_rows_linear(layer)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not is_applied(layer) and "_assistgen_packed" not in layer.__dict__


def test_a_non_contiguous_input_gives_the_same_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 96)
    x = torch.randn(48, 4).T  # [4, in] laid out as [in, 4], like act(gate) * up
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    for routes in ("mkl", "onednn"):
        small_rows_linear(layer, mode="on", routes=routes)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        remove_small_rows_linear(layer)


def test_transformed_tiny_model_still_decodes_like_transformers():
    target = tiny_llama()
    small_rows_linear(target.hf, mode="on")
    assert is_applied(target.hf)
    ids = encode("the cat sat on the mat. the cat")
    out = generate(target, ids, lookup=True, max_new_tokens=30, eos_token_ids=())
    assert out.token_ids == hf_greedy(target, ids, 30)


def test_a_deep_copy_packs_its_own_weights():
    import copy

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64)
    small_rows_linear(layer, mode="on", routes="onednn")
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(2)  # the copy's product must follow its own weights
    x = torch.randn(4, 32)
    torch.testing.assert_close(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def verification_logits(model, ids: list[int], context: int, n: int) -> torch.Tensor:
    cache = KVCache(model.hf)
    cache.feed(ids[:context], logits_to_keep=1)
    return cache.feed(ids[context : context + n], logits_to_keep=n)  # [n, vocab]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-sliding"])
def test_grouped_attention_verifies_like_transformers_attention(make):
    model = make()
    ids = encode("the quick brown fox jumps over the lazy dog and runs far away.")  # > the gemma window
    expected = {}
    for impl in ("eager", "sdpa"):
        model.hf.config._attn_implementation = impl
        expected[impl] = [verification_logits(model, ids, 40, n) for n in (1, 2, 5, 9)]
    assert grouped_query_attention(model.hf) and grouped_attention_applied(model.hf)
    got = [verification_logits(model, ids, 40, n) for n in (1, 2, 5, 9)]
    for g, e, s in zip(got, expected["eager"], expected["sdpa"], strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)
    assert make().hf.config._attn_implementation == "sdpa"  # a fresh model is untouched


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-sliding"])
def test_grouped_attention_decodes_like_a_plain_loop(make):
    model = make()
    grouped_query_attention(model.hf)
    ids = encode("abc abc abc. the cat sat on the mat; the cat sat on the")
    out = generate(model, ids, lookup=True, schedule="constant:6", max_new_tokens=40, eos_token_ids=())
    assert out.stats.accepted_tokens > 0  # multi-token verification steps happened
    assert out.token_ids == naive_greedy(model, ids, 40)


def test_grouped_attention_without_a_mask_stays_causal():
    torch.manual_seed(0)
    module = torch.nn.Module()
    q, kv, heads, groups, d = 3, 10, 4, 2, 8
    query, key, value = torch.randn(1, heads, q, d), torch.randn(1, groups, kv, d), torch.randn(1, groups, kv, d)
    out, _ = _grouped_sdpa(module, query, key, value, None, scaling=d**-0.5, is_causal=True)  # [1, q, heads, d]
    for h in range(heads):
        k, v = key[0, h // (heads // groups)], value[0, h // (heads // groups)]  # [kv, d]
        for t in range(q):
            visible = kv - q + t + 1  # position t sees the cache and the new tokens up to itself
            weights = torch.softmax(query[0, h, t] @ k[:visible].T * d**-0.5, -1)
            torch.testing.assert_close(out[0, t, h], weights @ v[:visible], atol=1e-5, rtol=1e-5)


def test_untransformed_restores_the_routes_packed_weights_and_attention():
    model = tiny_llama()
    table = ["mkl", "mkl", "mkl"] + ["onednn"] * 30
    small_rows_linear(model.hf, mode="on", routes=table)
    grouped_query_attention(model.hf)
    layer = next(m for m in model.hf.modules() if isinstance(m, torch.nn.Linear))
    packed = layer._assistgen_packed.tensor
    with untransformed(model.hf):
        assert not is_applied(model.hf) and not grouped_attention_applied(model.hf)
    assert applied_routes(model.hf) == table and grouped_attention_applied(model.hf)
    assert layer._assistgen_packed.tensor is packed
