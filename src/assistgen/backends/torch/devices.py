"""Where a model runs: the one home of its device, and the guard of the CPU-only pieces.

Contract: `model_device(model)` is the device of a model's first parameter (or buffer); the tensors
the package makes for a forward pass (ids, positions) and the generators it draws with live there.
`resolve_device(name)` checks a device a user asked for ("cpu", "cuda", "cuda:1") against this
machine before anything is loaded. `require_cpu(device, what, fix)` refuses, with a message naming
the problem and the way out, to run a CPU-only kernel (the small-row linear routes, int8/int4
packing) on weights that live elsewhere. `accelerator(device)` names the GPU behind a device, for
the fingerprints under which timings are cached. It imports nothing of assistgen.
"""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A device cannot be used for what was asked; the message names the fix."""


def model_device(model) -> torch.device:
    """The device of a model's (a `Model` or a torch module) first parameter or buffer; CPU when it has none."""
    module = model if isinstance(model, torch.nn.Module) else model.hf
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


class OnDevice:
    """For a wrapper of a torch module `hf` (`model.Model`, `speech.SpeechModel`): where its weights are, and their
    dtype."""

    @property
    def device(self) -> torch.device:
        return model_device(self.hf)

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype


def resolve_device(name: str | torch.device) -> torch.device:
    """The device `name` stands for, or a `DeviceError` when this machine (or this PyTorch build) has none."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"Unknown device {name!r}: use 'cpu', 'cuda' or 'cuda:N'.") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise DeviceError(f"device={str(name)!r} asks for a GPU, but this PyTorch ({torch.__version__}, {build}) "
                              "sees no CUDA device. Use device='cpu', or run on a machine with an NVIDIA GPU and a "
                              "CUDA build of torch (pip install torch==2.13.0 from PyPI on Linux).")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device={str(name)!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"numbered from 0.")
    elif device.type != "cpu":
        raise DeviceError(f"device={str(name)!r}: assistgen runs on 'cpu' or 'cuda' devices.")
    return device


def require_cpu(device: torch.device, what: str, fix: str) -> None:
    """Refuse to run `what` (a CPU-only kernel) on weights whose `device` is not the CPU."""
    if device.type != "cpu":
        raise DeviceError(f"{what} runs on PyTorch's CPU kernels only, and the weights are on {device}: {fix}")


def accelerator(device: torch.device | str | None) -> list[str]:
    """[GPU name, compute capability] behind a CUDA device, [] for the CPU: what a fingerprint adds for a GPU."""
    if device is None or torch.device(device).type != "cuda":
        return []
    major, minor = torch.cuda.get_device_capability(device)
    return [torch.cuda.get_device_name(device), f"sm_{major}{minor}"]
