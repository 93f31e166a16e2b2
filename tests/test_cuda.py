"""assistgen on a CUDA GPU: exactness against transformers' own `generate`, seeded sampling, the universal pair.

Skipped where there is no CUDA device; `benchmarks/gpu.sh` runs it on a GPU machine. Greedy outputs are
compared token for token; a difference is accepted only at a floating-point near-tie of the target's
logits (`assistgen.core.exactness`), with a margin that fits the dtype: bfloat16 logits carry 8 bits of
mantissa, so two kernels that sum in another order can swap tokens whose logits are a few units in
the last place apart (0.125 at a logit of 16..32).
"""

from __future__ import annotations

import pytest
import torch
from helpers import encode, hf_greedy, tiny_gemma3, tiny_llama

from assistgen import Model, ModelLoadError, generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.devices import DeviceError, model_device
from assistgen.backends.torch.quantize import quantize
from assistgen.backends.torch.timing import machine
from assistgen.backends.torch.transforms import is_applied, tune_routes, untransformed
from assistgen.config import GenerationConfig
from assistgen.core.exactness import first_divergence
from assistgen.core.sampling import Sampler, verify_speculative
from assistgen.drafters.early_exit import EarlyExitDrafter, default_calibration_ids
from assistgen.policy.schedules import Constant, Heuristic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu.sh)")

CUDA = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.5}  # top-1 minus top-2 logit below which a swap is a tie
PROMPTS = [
    "List three facts about the Moon.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
]
N = 48


def on_cuda(model: Model) -> Model:
    model.hf.to(CUDA)
    return model


def transformers_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding on the model as it ships (its own attention)."""
    with untransformed(model.hf):
        return hf_greedy(model, ids, n, stop_at_eos=True)


def assert_exact_or_near_tie(model: Model, prompt: list[int], reference: list[int], ours: list[int]) -> None:
    d = first_divergence(model, prompt, reference, ours)
    if d is None:
        assert ours == reference
    else:
        tie = NEAR_TIE[model.hf.dtype]
        assert d.margin < tie, f"divergence at new token {d.position} with margin {d.margin:.3e} (tie: < {tie})"


# ---------------------------------------------------------------------------------------------------------------
# tiny models moved to the GPU


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_tiny_models_decode_on_the_gpu_like_transformers(make):
    target, assistant = on_cuda(make(seed=0)), on_cuda(make(seed=1))
    ids = encode("abc abc abc the cat sat")
    reference = hf_greedy(target, ids, 24)
    for kwargs in ({}, {"lookup": True}, {"assistant": assistant, "schedule": Constant(4)}):
        out = generate(target, ids, max_new_tokens=24, eos_token_ids=(), **kwargs)
        assert out.token_ids == reference, kwargs


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


def test_tiny_sampling_is_seeded_on_the_gpu():
    target, assistant = on_cuda(tiny_llama(seed=0)), on_cuda(tiny_llama(seed=1))
    ids = encode("abc abc")
    runs = [generate(target, ids, assistant=assistant, temperature=0.8, seed=11, max_new_tokens=24,
                     schedule=Constant(3)) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.drafted_tokens > 0


def test_cpu_only_pieces_refuse_gpu_weights():
    model = on_cuda(tiny_llama())
    with pytest.raises(DeviceError, match="int4 quantization .*CPU kernels only.*cuda"):
        quantize(model, "int4")
    with pytest.raises(DeviceError, match="small-row linear transform"):
        tune_routes(model)
    with pytest.raises(ModelLoadError, match="CPU kernels"):
        load_model("smollm2-135m", device=CUDA, quantize="int8")


# ---------------------------------------------------------------------------------------------------------------
# the embedded real models


@pytest.fixture(scope="module", params=list(DTYPES))
def smollm2(request):
    return load_model("smollm2-135m", dtype=DTYPES[request.param], device=CUDA)


@pytest.fixture(scope="module")
def gemma3_bf16():
    return load_model("gemma3-270m", dtype=torch.bfloat16, device=CUDA)


def test_loading_on_the_gpu_leaves_the_cpu_routes_out_and_names_the_gpu(smollm2):
    assert model_device(smollm2).type == "cuda"
    assert not is_applied(smollm2.hf)  # optimize skipped the CPU-only routes
    assert torch.cuda.get_device_name(model_device(smollm2)) in machine(model_device(smollm2))


@pytest.mark.parametrize("text", PROMPTS)
def test_smollm2_plain_lookup_and_assistant_equal_transformers(smollm2, text):
    ids = encode_prompt(smollm2, text, chat=True)
    reference = transformers_greedy(smollm2, ids, N)
    assistant = smollm2.truncated(20)  # same tokenizer: the target's first 20 layers
    for kwargs in ({}, {"lookup": True, "schedule": Constant(4)}, {"assistant": assistant, "schedule": Constant(4)}):
        out = generate(smollm2, ids, max_new_tokens=N, **kwargs)
        if "assistant" in kwargs or ("lookup" in kwargs and text.startswith("Repeat")):
            assert out.stats.drafted_tokens > 0, kwargs  # drafting happened (lookup: where the prompt repeats)
        assert_exact_or_near_tie(smollm2, ids, reference, out.token_ids)


def test_smollm2_sampling_is_seeded_and_drafts(smollm2):
    ids = encode_prompt(smollm2, PROMPTS[1], chat=True)
    assistant = smollm2.truncated(20)
    for kwargs in ({"lookup": True}, {"assistant": assistant}):
        runs = [generate(smollm2, ids, max_new_tokens=N, temperature=0.8, top_p=0.95, seed=7,
                         schedule=Constant(4), **kwargs) for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids, kwargs
        assert runs[0].stats.drafted_tokens > 0 and len(runs[0].token_ids) > 0, kwargs


def test_smollm2_early_exit_calibrates_and_drafts_on_the_gpu(smollm2):
    drafter = EarlyExitDrafter(smollm2, calibration_ids=default_calibration_ids(smollm2, 64))
    assert 1 <= drafter.layers < smollm2.config.num_hidden_layers
    ids = encode_prompt(smollm2, PROMPTS[0], chat=True)
    out = generate(smollm2, ids, assistant=drafter, max_new_tokens=N, schedule=Constant(3))
    assert out.stats.drafted_tokens > 0
    assert_exact_or_near_tie(smollm2, ids, generate(smollm2, ids, max_new_tokens=N).token_ids, out.token_ids)


def test_universal_gemma3_drafted_by_smollm2_equals_plain(gemma3_bf16):
    assistant = load_model("smollm2-135m", dtype=torch.bfloat16, device=CUDA)
    for text in ("Once upon a time, in a small village by the sea, there lived",
                 "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"):
        ids = encode_prompt(gemma3_bf16, text)
        plain = generate(gemma3_bf16, ids, max_new_tokens=32)
        ours = generate(gemma3_bf16, ids, assistant=assistant, max_new_tokens=32, schedule=Heuristic(max_k=6))
        assert ours.stats.mode == "universal" and ours.stats.draft_forward_passes > 0
        assert_exact_or_near_tie(gemma3_bf16, ids, plain.token_ids, ours.token_ids)
