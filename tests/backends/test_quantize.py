"""Weight-only int8/int4: row-independent kernels, exact greedy speculation, the on-disk cache, clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, tiny_gemma3, tiny_gpt2, tiny_llama

from assistgen import generate
from assistgen.backends.torch.attention import ROW_ATTENTION, grouped_attention_applied
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.quantization_schemes import QuantizeError
from assistgen.backends.torch.quantize import is_saved, load_quantized, quantize, row_independent, save_quantized
from assistgen.backends.torch.quantized_layers import (
    KERNEL_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizedLinear,
)
from assistgen.backends.torch.transforms import optimize
from assistgen.cli.main import main as cli_main
from assistgen.policy.rules import Constant

SCHEMES = ("int8", "int4")
MODELS = {"llama": tiny_llama, "gemma3": tiny_gemma3}
TEXT = "the cat sat on the mat and the dog sat too, so the bird flew over the house and sang a long song"


def quantized(make, scheme: str, **kwargs):
    """A tiny model quantized and optimized as `load_model(..., quantize=scheme)` does it."""
    model = make(**kwargs)
    quantize(model, scheme)
    model.quantization = scheme
    optimize(model)
    assert grouped_attention_applied(model.hf) == ROW_ATTENTION
    return model


def quantized_layers(hf):
    return [m for m in hf.modules() if isinstance(m, QuantizedLinear)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", MODELS)
def test_every_linear_is_swapped_and_row_independent(arch, scheme):
    model = MODELS[arch]()
    quantize(model, scheme)
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in model.hf.modules())
    layers = quantized_layers(model.hf)
    kind = Int8Linear if scheme == "int8" else Int4Linear
    assert layers and all(isinstance(m, kind) for m in layers)
    assert isinstance(model.hf.get_input_embeddings(), Int8Embedding)
    for layer in layers:
        assert row_independent(layer, max_rows=17), layer


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_layer_computes_the_product_it_stores(scheme):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 80, bias=True)  # 80 output rows: int4 pads to a multiple of 16
    reference = linear.weight.detach().clone(), linear.bias.detach().clone()
    layer = Int8Linear(256, 80, bias=True) if scheme == "int8" else Int4Linear(256, 80, bias=True, group=128)
    if scheme == "int8":
        from assistgen.backends.torch.quantization_schemes import int8_rows

        layer.weight, layer.scales = int8_rows(reference[0])
    else:
        layer.set_weight(reference[0])
    layer.bias = reference[1]
    for rows in (1, 3, 17, 100, KERNEL_ROWS + 1, 300):  # the kernel, then the dequantized prefill route
        x = torch.randn(rows, 256)
        exact = torch.nn.functional.linear(x, *reference)
        got = layer(x)
        assert got.shape == exact.shape and got.dtype == torch.float32
        relative = (got - exact).norm() / exact.norm()
        assert relative < (0.02 if scheme == "int8" else 0.12), (rows, relative)
    x = torch.randn(KERNEL_ROWS, 256).to(torch.bfloat16)
    torch.testing.assert_close(layer.matmul(x).float(), torch.nn.functional.linear(x, layer.dequantized()).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", MODELS)
def test_one_token_at_a_time_equals_a_verification_step_bitwise(arch, scheme):
    """The whole model, attention included: logits of a k-token step equal k one-token steps exactly."""
    model = quantized(MODELS[arch], scheme)
    ids = encode(TEXT)
    prefix, rest = ids[:50], ids[50:67]
    one = KVCache(model)
    one.feed(prefix)
    singles = torch.cat([one.feed([t]) for t in rest])  # [17, vocab]
    for k in (2, 5, 9, 17):
        many = KVCache(model)
        many.feed(prefix)
        assert torch.equal(many.feed(rest[:k], logits_to_keep=k), singles[:k]), k


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", MODELS)
def test_greedy_speculation_equals_plain_decoding_with_the_same_weights(arch, scheme):
    target = quantized(MODELS[arch], scheme, seed=0)
    assistant = quantized(MODELS[arch], scheme, seed=0)  # the same weights: every draft is right
    ids = encode(TEXT)
    plain = generate(target, ids, max_new_tokens=40, eos_token_ids=())
    for kwargs in ({"lookup": True}, {"assistant": assistant}):
        out = generate(target, ids, max_new_tokens=40, eos_token_ids=(), schedule=Constant(k=5), **kwargs)
        assert out.stats.drafted_tokens > 0
        if "assistant" in kwargs:  # every draft right: verification steps of up to 6 rows ran
            assert out.stats.steps <= 10
        assert out.token_ids == plain.token_ids, kwargs


def test_int8_keeps_a_tied_head_and_embedding_as_one_tensor():
    model = tiny_llama()
    model.hf.config.tie_word_embeddings = True
    model.hf.lm_head.weight = model.hf.model.embed_tokens.weight
    ids = torch.tensor([encode("tied weights")])
    quantize(model, "int8")
    head, embedding = model.hf.lm_head, model.hf.model.embed_tokens
    assert head.weight is embedding.weight and head.scales is embedding.scales
    assert torch.isfinite(model.hf(ids).logits).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_saved_and_loaded_again_gives_the_same_logits_without_float_weights(tmp_path, scheme):
    model = tiny_gemma3()  # a scaled embedding, sliding-window layers
    quantize(model, scheme)
    ids = torch.tensor([encode("the same numbers after a reload")])
    expected = model.hf(ids).logits
    save_quantized(model, tmp_path / "q")
    assert is_saved(tmp_path / "q")
    loaded = load_quantized(tmp_path / "q", name="tiny")
    assert loaded.name == "tiny" and load_quantized(tmp_path / "q").name == "q"  # not a layer's name
    hf, tokenizer = loaded.hf, loaded.tokenizer
    assert torch.equal(hf(ids).logits, expected)
    big_float = [n for n, p in list(hf.named_parameters()) + list(hf.named_buffers())
                 if p.is_floating_point() and p.numel() >= 64 * 64]
    assert not big_float, big_float  # only norms, rotary tables and scales stay floating point
    assert tokenizer.encode("the") == model.tokenizer.encode("the")


def test_unknown_scheme_and_unsupported_models_are_refused_clearly():
    with pytest.raises(QuantizeError, match="supported are int8, int4"):
        quantize(tiny_llama(), "int3")
    with pytest.raises(QuantizeError, match="Conv1D"):
        quantize(tiny_gpt2(), "int8")
    odd = tiny_llama(hidden=40)  # 40 input features: no int4 group of 32 fits
    with pytest.raises(QuantizeError, match="use --quantize int8"):
        quantize(odd, "int4")
    assert any(isinstance(m, torch.nn.Linear) for m in odd.hf.modules())  # refused before touching the model


def test_cli_names_the_supported_schemes(capsys):
    assert cli_main(["generate", "--model", "smollm2-135m", "--quantize", "int3", "hi"]) == 2
    err = capsys.readouterr().err
    assert "int3" in err and "int8, int4" in err and "Traceback" not in err
