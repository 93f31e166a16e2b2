"""The small-row linear transform computes the same product and can be removed again."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, hf_greedy, naive_greedy, tiny_gemma3, tiny_llama

from assistgen import generate
from assistgen.backends.torch.attention import _grouped_sdpa, grouped_attention_applied, grouped_query_attention
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.ragged import inner_attention, set_inner_attention
from assistgen.backends.torch.small_rows import (
    SmallRowsLinear,
    applied_routes,
    is_applied,
    remove_small_rows_linear,
    route_table,
    small_rows_linear,
)
from assistgen.backends.torch.transforms import untransformed
from assistgen.policy.rules import Constant


def wrapped(layer: torch.nn.Linear) -> torch.nn.Sequential:
    return torch.nn.Sequential(layer)  # the transform swaps the linears inside a module


PADDED = [0, 3, 3, 3, 4, 8, 8, 8, 8] + list(range(9, 33))


@pytest.mark.parametrize("padded", [None, PADDED])
@pytest.mark.parametrize("routes", ["mkl", "onednn", ["mkl", "mkl", "mkl"] + ["onednn"] * 30])
def test_same_product_for_every_row_count(routes, padded):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 300)
    model = wrapped(layer)
    for rows in (1, 2, 3, 5, 8, 32, 33, 100):
        x = torch.randn(2, rows, 64)[:1]  # [1, rows, in]
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        small_rows_linear(model, mode="on", routes=routes, padded=padded)
        assert isinstance(model[0], SmallRowsLinear) and model[0].weight is layer.weight  # swapped, no copy
        got = model(x)
        remove_small_rows_linear(model)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not is_applied(model) and type(model[0]) is torch.nn.Linear and model[0].weight is layer.weight


def test_route_table_pads_a_row_count_only_where_a_larger_one_is_clearly_cheaper():
    # whole-model step seconds for 1..5 rows: one row costs more than four on oneDNN (the 1.5B fp32 curve)
    by_route = {"mkl": [1.0, 1.1, 1.3, 1.5, 1.8], "onednn": [1.2, 1.0, 0.9, 0.8, 1.9]}
    routes, padded = route_table(by_route, max_rows=8)
    assert routes == ["mkl", "mkl", "onednn", "onednn", "onednn", "mkl", "mkl", "mkl", "mkl"]
    assert padded == [0, 4, 4, 4, 4, 5, 6, 7, 8]
    flat = {"mkl": [1.0, 0.99, 1.2], "onednn": [1.5, 1.5, 1.5]}  # within 3%: not worth padding
    assert route_table(flat, max_rows=3)[1] == [0, 1, 2, 3]


def test_a_non_contiguous_input_gives_the_same_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 96)
    model = wrapped(layer)
    x = torch.randn(48, 4).T  # [4, in] laid out as [in, 4], like act(gate) * up
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    for routes in ("mkl", "onednn"):
        small_rows_linear(model, mode="on", routes=routes)
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
        remove_small_rows_linear(model)


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
    model = wrapped(torch.nn.Linear(32, 64))
    small_rows_linear(model, mode="on", routes="onednn")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(2)  # the copy's product must follow its own weights
    x = torch.randn(4, 32)
    for m in (twin[0], model[0]):
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)


def verification_logits(model, ids: list[int], context: int, n: int) -> torch.Tensor:
    cache = KVCache(model)
    cache.feed(ids[:context], logits_to_keep=1)
    return cache.feed(ids[context : context + n], logits_to_keep=n)  # [n, vocab]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-sliding"])
def test_grouped_attention_verifies_like_transformers_attention(make):
    model = make()
    ids = encode("the quick brown fox jumps over the lazy dog and runs far away.")  # > the gemma window
    expected = {}
    for impl in ("eager", "sdpa"):
        set_inner_attention(model.hf.config, impl)
        expected[impl] = [verification_logits(model, ids, 40, n) for n in (1, 2, 5, 9)]
    assert grouped_query_attention(model.hf) and grouped_attention_applied(model.hf)
    got = [verification_logits(model, ids, 40, n) for n in (1, 2, 5, 9)]
    for g, e, s in zip(got, expected["eager"], expected["sdpa"], strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)
    assert make().hf.config._attn_implementation == "sdpa"  # a fresh model is untouched
    assert inner_attention(model.hf.config) == grouped_attention_applied(model.hf)


def test_the_ragged_attention_writes_nothing_of_its_own_on_a_config():
    """Attached, a config's own `_attn_implementation` names the ragged attention and the one inside it: nothing else
    is written on it, and a copy of it (early exit's truncated model's) keeps both."""
    import copy

    model = tiny_llama()
    config = model.hf.config
    fields = set(vars(config))
    KVCache(model)  # attaches the ragged attention
    assert grouped_query_attention(model.hf)
    assert set(vars(config)) == fields and inner_attention(config) == grouped_attention_applied(model.hf)
    assert inner_attention(copy.deepcopy(config)) == inner_attention(config) != config._attn_implementation


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-sliding"])
def test_grouped_attention_decodes_like_a_plain_loop(make):
    model = make()
    grouped_query_attention(model.hf)
    ids = encode("abc abc abc. the cat sat on the mat; the cat sat on the")
    out = generate(model, ids, lookup=True, schedule=Constant(k=6), max_new_tokens=40, eos_token_ids=())
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
    layer = model.hf.model.layers[0].mlp.down_proj
    packed = layer.packed.tensor
    with untransformed(model.hf):
        assert not is_applied(model.hf) and not grouped_attention_applied(model.hf)
        assert type(model.hf.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert applied_routes(model.hf) == table and grouped_attention_applied(model.hf)
    assert model.hf.model.layers[0].mlp.down_proj is layer and layer.packed.tensor is packed
