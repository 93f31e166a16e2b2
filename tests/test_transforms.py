"""The small-row linear transform computes the same product and can be removed again."""

from __future__ import annotations

import pytest
import torch
from conftest import encode, hf_greedy, tiny_llama

from assistgen import generate
from assistgen.transforms import is_applied, remove_small_rows_linear, small_rows_linear


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
