"""assistgen on a CUDA GPU with the embedded real models (SmolLM2-135M, Gemma-3-270M): exactness against
transformers' own `generate`, seeded sampling, early exit, the universal pair.

Skipped where there is no CUDA device. `benchmarks/gpu.sh` runs it where the embedded models' packages are
installed (the offline GPU machine has no room for their weights: `tests/backends/test_cuda.py` runs there on tiny
models). Greedy outputs are compared token for token; a difference is accepted only at a floating-point near-tie
of the target's logits (`first_divergence`, tests/reference.py), with a margin that fits the dtype.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_exact_or_near_tie, transformers_greedy

from assistgen import generate, load_model
from assistgen.api import encode_prompt
from assistgen.backends.torch.devices import model_device
from assistgen.backends.torch.small_rows import is_applied
from assistgen.backends.torch.timing import machine
from assistgen.drafters.early_exit import EarlyExitDrafter, default_calibration_ids
from assistgen.policy.rules import Constant, Heuristic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu.sh)")

CUDA = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPTS = [
    "List three facts about the Moon.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
]
N = 48

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
