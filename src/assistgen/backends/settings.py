"""How a model is loaded, parsed once at the edge: `LoadSettings.parse(backend, **options)`.

Contract: `parse` takes `load_model`'s keyword arguments (or the command line's, `cli/options.py`) and returns a
frozen `LoadSettings` in which every option is checked and in its final form: `backend` one of `BACKENDS`,
`max_memory` in bytes (`budget.parse_budget`), `dtype` a torch dtype (a `DTYPES` name is taken too), `device` text;
an unknown option raises `ModelLoadError` listing each backend's. llama.cpp's own options (`LlamaSettings`' fields:
context, sequences, threads, repack, flash_attention, exact_prompts, ...) are kept as given, in `llama`. `given`
names every option the caller set, so that the loader refuses an option of the other backend (`backends.loader`)
instead of dropping it; None is "the backend's default" and counts as not given. One object loads any number of
models; a changed budget is `with_budget` (the assistant's share of `--max-memory`). Nothing below the loader
parses an option again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from assistgen.backends.budget import parse_budget
from assistgen.backends.embedded import ModelLoadError
from assistgen.backends.llamacpp.model import LlamaSettings

BACKENDS = ("auto", "torch", "llama.cpp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the names --dtype takes
SHARED = ("quantize", "max_memory")  # both backends'
TORCH_ONLY = ("dtype", "device")
LLAMA_ONLY = tuple(f.name for f in fields(LlamaSettings) if f.name not in SHARED)


@dataclass(frozen=True)
class LoadSettings:
    backend: str = "auto"  # "auto" | "torch" | "llama.cpp" (`loader.choose_backend`)
    dtype: torch.dtype | None = None  # torch: weights and activations (None: float32)
    device: str | None = None  # torch: "cpu", "cuda", "cuda:N" (None: the CPU)
    quantize: str | None = None  # torch: "int8" | "int4"; llama.cpp: a GGUF type a hub-format model is converted to
    max_memory: int | None = None  # bytes the model may keep resident: offloaded weights (None: not offloaded)
    llama: tuple[tuple[str, Any], ...] = ()  # llama.cpp's own options given, (name, value) in `LLAMA_ONLY`
    given: frozenset[str] = frozenset()  # the options the caller set (not None)

    @classmethod
    def parse(cls, backend: str = "auto", **options) -> LoadSettings:
        known = (*TORCH_ONLY, *SHARED, *LLAMA_ONLY)
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ModelLoadError(f"Unknown loading option {', '.join(unknown)}: the torch backend takes "
                                 f"{', '.join((*TORCH_ONLY, *SHARED))}; the llama.cpp backend takes "
                                 f"{', '.join((*SHARED, *LLAMA_ONLY))}.")
        if backend not in BACKENDS:
            raise ModelLoadError(f"Unknown backend {backend!r}: use one of {', '.join(BACKENDS)}.")
        given = {k: v for k, v in options.items() if v is not None}
        return cls(backend=backend, dtype=dtype_of(given.get("dtype")),
                   device=None if "device" not in given else str(given["device"]),
                   quantize=given.get("quantize"),
                   max_memory=parse_budget(given["max_memory"]) if "max_memory" in given else None,
                   llama=tuple((k, given[k]) for k in LLAMA_ONLY if k in given), given=frozenset(given))

    def with_budget(self, max_memory: int | None) -> LoadSettings:
        given = self.given | {"max_memory"} if max_memory is not None else self.given - {"max_memory"}
        return replace(self, max_memory=max_memory, given=given)

    def with_backend(self, backend: str) -> LoadSettings:
        return replace(self, backend=backend)

    def on_cpu(self) -> bool:
        return self.device is None or self.device == "cpu"

    def llama_settings(self) -> LlamaSettings:
        """llama.cpp's settings: its own options as given, the shared ones, its defaults for the rest."""
        settings = LlamaSettings(**dict(self.llama), quantize=self.quantize, max_memory=self.max_memory)
        return settings if self.max_memory is None else replace(settings, repack=False)  # (file-backed weights)


def dtype_of(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise ModelLoadError(f"dtype must be a torch dtype or one of {', '.join(DTYPES)}, got {value!r}.")
