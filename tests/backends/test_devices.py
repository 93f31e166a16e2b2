"""Where things run, checked on the CPU: the model's device is the one home, the CPU random stream is
unchanged, fingerprints name a GPU, and CPU-only transforms refuse weights elsewhere (the `meta` device
stands in for a GPU: real tensors that are not on the CPU, no faking of CUDA)."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, tiny_llama

from assistgen import ModelLoadError, generate, load_model
from assistgen.backends.torch.cache import KVCache
from assistgen.backends.torch.devices import DeviceError, accelerator, model_device, require_cpu, resolve_device
from assistgen.backends.torch.model import Model
from assistgen.backends.torch.quantize import quantize
from assistgen.backends.torch.small_rows import (
    PackedWeight,
    SmallRowsLinear,
    is_applied,
    small_rows_linear,
    tune_routes,
)
from assistgen.backends.torch.timing import clock, machine, measurement_key
from assistgen.backends.torch.transforms import optimize
from assistgen.bench.dataset import Prompt
from assistgen.bench.runner import Runner, run_bench
from assistgen.cli.bench import parse_method
from assistgen.cli.main import main
from assistgen.config import GenerationConfig
from assistgen.drafters.assistant import fit_vocab
from assistgen.policy.rules import Constant
from assistgen.spec.sampling import Sampler

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def on_meta() -> Model:
    """A tiny model whose weights are real tensors off the CPU."""
    model = tiny_llama()
    model.hf.to("meta")
    return model


def test_the_model_device_is_where_its_first_weight_is():
    model = tiny_llama()
    assert model_device(model) == model_device(model.hf) == torch.device("cpu")
    assert KVCache(model).device == torch.device("cpu")
    assert model_device(on_meta()).type == "meta"
    assert model_device(torch.nn.ReLU()) == torch.device("cpu")  # nothing to ask: the CPU


def test_fit_vocab_keeps_the_logits_device():
    row = torch.empty(5, device="meta")
    assert fit_vocab(row, 8).device.type == "meta" and fit_vocab(row, 8).shape == (8,)
    assert fit_vocab(row, 3).device.type == "meta"


def test_the_cpu_random_stream_is_the_seeded_generator_as_before():
    """Draws and uniforms come from one CPU generator seeded with the seed, in the order they are asked for."""
    probs = torch.softmax(torch.randn(7, generator=torch.Generator().manual_seed(1)), -1)
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=123))
    reference = torch.Generator().manual_seed(123)
    for _ in range(20):
        assert sampler.draw(probs) == int(torch.multinomial(probs, 1, generator=reference))
        assert sampler.uniform() == float(torch.rand((), generator=reference))
    assert sampler.generator_for(torch.device("cpu")) is sampler.generator
    unseeded = Sampler(GenerationConfig(temperature=1.0))
    assert unseeded.generator_for(torch.device("cpu")) is unseeded.generator


def test_sampled_generation_is_unchanged_by_the_device_bookkeeping():
    target, assistant = tiny_llama(seed=0), tiny_llama(seed=1)
    ids = encode("abc abc")
    runs = [generate(target, ids, assistant=assistant, temperature=0.8, seed=5, max_new_tokens=16,
                     schedule=Constant(k=3)) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.drafted_tokens > 0


def test_clock_reads_the_cpu_clock_without_waiting():
    a = clock()
    b = clock("cpu")
    assert b >= a


def test_a_gpu_where_there_is_none_is_refused_before_loading():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="Unknown device"):
        resolve_device("not-a-device")
    with pytest.raises(DeviceError, match="'cpu' or 'cuda'"):
        resolve_device("meta")


@no_cuda
def test_cuda_asked_for_on_a_machine_without_it_names_the_fix(capsys):
    with pytest.raises(DeviceError, match="sees no CUDA device.*device='cpu'"):
        resolve_device("cuda:0")
    with pytest.raises(ModelLoadError, match="sees no CUDA device"):
        load_model("smollm2-135m", device="cuda")  # refused before anything is read
    assert main(["generate", "--model", "smollm2-135m", "--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


def test_the_fingerprint_names_the_gpu(monkeypatch):
    assert machine() == machine("cpu") == machine(torch.device("cpu"))  # CPU keys stay what they were
    assert accelerator("cpu") == [] and accelerator(None) == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    h200 = machine("cuda:0")
    assert h200[:len(machine())] == machine() and h200[len(machine()):] == ["NVIDIA H200", "sm_90"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert machine("cuda:0") != h200
    model = tiny_llama()
    assert measurement_key(model) == measurement_key(model)  # the CPU model's key asks nothing of CUDA


def test_optimize_leaves_the_cpu_only_routes_out_for_weights_elsewhere():
    model = on_meta()
    optimize(model, mode="on")  # what load_model does for every model: no error, nothing CPU-only applied
    assert not is_applied(model.hf)


@pytest.mark.parametrize("ask", [
    lambda m: small_rows_linear(m.hf, mode="on"),
    lambda m: SmallRowsLinear(m.hf.lm_head, ["mkl"] * 33, list(range(33)), PackedWeight(None)),
    lambda m: tune_routes(m),
])
def test_asking_for_the_small_row_routes_off_the_cpu_is_refused_clearly(ask):
    model = on_meta()
    with pytest.raises(DeviceError, match="small-row linear transform runs on PyTorch's CPU kernels only.*meta"):
        ask(model)
    assert not is_applied(model.hf)  # refused before anything was swapped


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantizing_weights_off_the_cpu_is_refused_clearly(scheme):
    model = on_meta()
    with pytest.raises(DeviceError, match=f"{scheme} quantization .*CPU kernels only.*bfloat16"):
        quantize(model, scheme)
    assert all(type(m) is not torch.nn.Linear or m.weight.device.type == "meta" for m in model.hf.modules())
    assert any(type(m) is torch.nn.Linear for m in model.hf.modules())  # untouched


def test_the_guard_passes_cpu_weights_and_refuses_others():
    assert require_cpu(torch.device("cpu"), "anything", "no fix needed") is None
    with pytest.raises(DeviceError, match="anything runs on PyTorch's CPU kernels only, and the weights are on meta"):
        require_cpu(torch.device("meta"), "anything", "the fix")


def test_bench_repeats_interleave_and_keep_the_first_key():
    runner = Runner(tiny_llama(), max_new_tokens=4)
    prompts = [Prompt("p1", "copy", ("abc abc abc",))]
    methods = [parse_method("plain"), parse_method("lookup")]
    once, _ = run_bench(runner, prompts, methods)
    twice, ran = run_bench(runner, prompts, methods, repeats=2)
    assert ran == 4 and len(twice) == 4
    assert {r["key"] for r in once} < {r["key"] for r in twice}
    assert sorted(r["repeat"] for r in twice) == [0, 0, 1, 1]
