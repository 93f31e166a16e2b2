"""assistgen on a CUDA GPU, on tiny random models made here (no weights to bring: the offline GPU machine runs it):
exactness against transformers' own `generate` in float32 and bfloat16, seeded sampling, the universal pair, the
ragged batch engine, refusals of the CPU-only pieces.

Skipped where there is no CUDA device; `benchmarks/gpu.sh` runs it on a GPU machine (and
`tests/backends/test_cuda_embedded.py` where the embedded models are installed). Greedy outputs are compared token
for token; in bfloat16 a difference is accepted only at a near-tie of the target's logits (`helpers.NEAR_TIE`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_exact_or_near_tie, encode, hf_greedy, tiny_gemma3, tiny_llama
from mixed_tokenizers import byte_bpe, sentencepiece_bpe, tiny_model
from reference import verify_speculative

from assistgen import Model, ModelLoadError, generate, load_model
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.devices import DeviceError
from assistgen.backends.torch.quantize import quantize
from assistgen.backends.torch.small_rows import tune_routes
from assistgen.config import GenerationConfig
from assistgen.core.engine import begin, step
from assistgen.core.sampling import Sampler
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.policy.adaptive import Adaptive
from assistgen.policy.rules import Constant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu.sh)")

CUDA = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEXTS = ["abc abc abc the cat sat", "the cat sat on the mat and the cat sat on the mat and the",
         "one two three one two three one", "x", "hello world, hello world, hello world, hello"]


def on_cuda(model: Model, dtype: torch.dtype = torch.float32) -> Model:
    model.hf.to(CUDA, dtype)
    return model


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_tiny_models_decode_on_the_gpu_like_transformers(make, dtype):
    target, assistant = on_cuda(make(seed=0), DTYPES[dtype]), on_cuda(make(seed=1), DTYPES[dtype])
    ids = encode(TEXTS[0])
    reference = hf_greedy(target, ids, 24)
    for kwargs in ({}, {"lookup": True, "schedule": Constant(3)}, {"assistant": assistant, "schedule": Constant(4)}):
        out = generate(target, ids, max_new_tokens=24, eos_token_ids=(), **kwargs)
        if kwargs:
            assert out.stats.drafted_tokens > 0, kwargs
        assert_exact_or_near_tie(target, ids, reference, out.token_ids)


def test_the_cache_feeds_on_the_model_device():
    model = on_cuda(tiny_llama())
    cache = KVCache(model)
    assert cache.device.type == "cuda"
    logits = cache.feed(encode("hello"), logits_to_keep=2)
    assert logits.device.type == "cuda" and logits.shape[0] == 2


def test_sampling_draws_on_the_device_of_the_probabilities():
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=3))
    p = torch.softmax(torch.randn(3, 11, device=CUDA), -1)
    q_cpu = torch.softmax(torch.randn(2, 11), -1)  # a drafter on the CPU: q is moved to p's device
    accepted, token = verify_speculative(p, q_cpu, [4, 5], sampler)
    assert 0 <= accepted <= 2 and 0 <= token < 11
    assert sampler.generator_for(p.device).device.type == "cuda"
    one, two = (Sampler(GenerationConfig(temperature=1.0, seed=3)) for _ in range(2))
    assert [one.draw(p[0]) for _ in range(8)] == [two.draw(p[0]) for _ in range(8)]  # same seed, same draws


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tiny_sampling_is_seeded_on_the_gpu(dtype):
    target, assistant = on_cuda(tiny_llama(seed=0), DTYPES[dtype]), on_cuda(tiny_llama(seed=1), DTYPES[dtype])
    ids = encode("abc abc")
    runs = [generate(target, ids, assistant=assistant, temperature=0.8, seed=11, max_new_tokens=24,
                     schedule=Constant(3)) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.drafted_tokens > 0


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_universal_pair_on_the_gpu_equals_transformers(dtype):
    """Target and assistant with different tokenizers (byte-level BPE, SentencePiece-style BPE): universal mode."""
    target = on_cuda(tiny_model(byte_bpe(), seed=0), DTYPES[dtype])
    assistant = on_cuda(tiny_model(sentencepiece_bpe(), seed=1), DTYPES[dtype])
    ids = target.tokenizer("the cat sat on the mat, the cat sat on the mat")["input_ids"]
    out = generate(target, ids, assistant=assistant, max_new_tokens=24, eos_token_ids=(), schedule=Constant(4))
    assert out.stats.mode == "universal" and out.stats.draft_forward_passes > 0
    assert_exact_or_near_tie(target, ids, hf_greedy(target, ids, 24), out.token_ids)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ragged_batch_on_the_gpu_equals_each_sequence_alone(dtype):
    """Five prompts of different lengths stepped together (prompts fed in chunks beside decoding rows, prompt lookup
    with the cost-aware policy sharing rows): each sequence's tokens are its own alone."""
    model = on_cuda(tiny_llama(), DTYPES[dtype])
    config = GenerationConfig(max_new_tokens=20, eos_token_ids=())
    prompts = [encode(t) for t in TEXTS]
    alone = [generate(model, p, lookup=True, schedule=Constant(3), max_new_tokens=20, eos_token_ids=()).token_ids
             for p in prompts]
    seqs = [begin(model, p, PromptLookupDrafter(), Adaptive(), config) for p in prompts]
    tokens = [[] for _ in seqs]
    while any(s.finish is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish is None]
        for i, chunk in zip(live, step([seqs[i] for i in live], 8), strict=True):
            if chunk is not None:
                tokens[i].extend(chunk.tokens)
    for p, a, t in zip(prompts, alone, tokens, strict=True):
        assert_exact_or_near_tie(model, p, a, t)
    assert sum(s.stats.drafted_tokens for s in seqs) > 0


def test_cpu_only_pieces_refuse_gpu_weights():
    model = on_cuda(tiny_llama())
    with pytest.raises(DeviceError, match="int4 quantization .*CPU kernels only.*cuda"):
        quantize(model, "int4")
    with pytest.raises(DeviceError, match="small-row linear transform"):
        tune_routes(model)
    with pytest.raises(ModelLoadError, match="CPU kernels"):
        load_model("smollm2-135m", device=CUDA, quantize="int8")


def test_layers_beyond_a_gpu_budget_stay_in_cpu_memory_and_decode_exactly(tmp_path):
    # max_memory on a GPU: accelerate's placement keeps the layers beyond the budget in CPU memory and moves them to
    # the GPU for each pass; the tokens are the same as with every layer on the GPU.
    made = tiny_llama(layers=6, hidden=256)
    made.hf.save_pretrained(tmp_path)
    made.tokenizer.save_pretrained(tmp_path)
    reference = hf_greedy(on_cuda(made), encode(TEXTS[1]), 24)
    budget = made.weight_bytes // 2
    model = load_model(str(tmp_path), backend="torch", device=CUDA, max_memory=budget)
    placed = set(model.hf.hf_device_map.values())
    assert "cpu" in placed and placed - {"cpu"}, model.hf.hf_device_map  # split between the GPU and CPU memory
    for kwargs in ({}, {"lookup": True, "schedule": Constant(3)}):
        out = generate(model, encode(TEXTS[1]), max_new_tokens=24, eos_token_ids=(), **kwargs)
        if kwargs:
            assert out.stats.drafted_tokens > 0
        assert out.token_ids == reference, kwargs


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sampled_verification_on_the_gpu_draws_beforehand_what_the_lazy_draw_gives(monkeypatch, dtype):
    """On a GPU `core.verify` draws the stop tokens before its one read (EAGER by default there): the same tokens
    as drawing after the read, for seeded generations with an assistant; and no synchronization beyond the read
    (`torch.cuda.set_sync_debug_mode`, warnings counted)."""
    import warnings

    import assistgen.core.verify as verify

    target, assistant = on_cuda(tiny_llama(seed=0), DTYPES[dtype]), on_cuda(tiny_llama(seed=1), DTYPES[dtype])
    outputs = {}
    for eager in (False, True):
        monkeypatch.setattr(verify, "EAGER", eager)
        outputs[eager] = [generate(target, encode("abc abc abc"), assistant=assistant, schedule=Constant(3),
                                   max_new_tokens=24, temperature=0.9, top_p=0.95, seed=seed).token_ids
                          for seed in range(4)]
    assert outputs[True] == outputs[False]
    monkeypatch.setattr(verify, "EAGER", True)
    p = torch.softmax(torch.randn(4, target.vocab_size, device=CUDA), -1)
    job = verify.Verification(torch.log(p), [3, 4, 5], Sampler(GenerationConfig(temperature=1.0, seed=0)),
                              torch.softmax(torch.randn(3, target.vocab_size, device=CUDA), -1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            verify.verify_all([job])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in said if "synchroniz" in str(w.message)]) <= 1, [str(w.message) for w in said]
