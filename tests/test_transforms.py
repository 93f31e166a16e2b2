"""The small-row linear transform computes the same product and can be removed again."""

from __future__ import annotations

import torch
from conftest import encode, hf_greedy, tiny_llama

from assistgen import generate
from assistgen.transforms import is_applied, remove_small_rows_linear, small_rows_linear


def test_same_product_for_every_row_count():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 300)
    for rows in (1, 2, 3, 8, 32, 33, 100):
        x = torch.randn(2, rows, 64)[:1]  # [1, rows, in]
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        small_rows_linear(layer, mode="on")
        got = layer(x)
        remove_small_rows_linear(layer)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not is_applied(layer)


def test_transformed_tiny_model_still_decodes_like_transformers():
    target = tiny_llama()
    small_rows_linear(target.hf, mode="on")
    assert is_applied(target.hf)
    ids = encode("the cat sat on the mat. the cat")
    out = generate(target, ids, lookup=True, max_new_tokens=30, eos_token_ids=())
    assert out.token_ids == hf_greedy(target, ids, 30)
