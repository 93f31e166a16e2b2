"""The torch backend's clock and machine fingerprint.

Contract: `clock(device)` reads a monotonic clock after the device has finished its queued work (a GPU
runs asynchronously, so an unsynchronized clock would time kernel launches; on the CPU it is the bare
clock): `Model.clock()`, through which every figure the policy or a benchmark uses is read, is this.
`machine(device)` names what makes timings on this machine differ from another's, and
`measurement_key(model, *extra)` fingerprints a model on it (`Model.fingerprint`). It knows nothing about
policies or routes.
"""

from __future__ import annotations

import hashlib
import platform
import time

import torch

from assistgen.backends.machine import cpu_name
from assistgen.backends.torch.devices import accelerator, model_device


def clock(device: torch.device | str | None = None) -> float:
    """Seconds on a monotonic clock, once `device`'s queued work is done."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def machine(device: torch.device | str | None = None) -> list[str]:
    """Software versions, processor, threads, and for a `device` on a GPU its name and compute capability."""
    from transformers import __version__ as transformers_version

    return [torch.__version__, transformers_version, platform.machine(), cpu_name(), str(torch.get_num_threads()),
            *accelerator(device)]


def measurement_key(model, *extra: str) -> str:
    """A fingerprint of a model on this machine: its identity, size and software set-up, plus `extra`."""
    parts = [model.cache_key or model.name, str(sum(p.numel() for p in model.hf.parameters())),
             *machine(model_device(model.hf)), *extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
