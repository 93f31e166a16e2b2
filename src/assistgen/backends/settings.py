"""How a model is loaded, parsed once at the edge: `LoadSettings.parse(backend, **options)`.

Contract: `parse` takes `load_model`'s keyword arguments (or the command line's, `cli/options.py`) and returns a
frozen `LoadSettings` (built directly, it is checked the same way) in which every option is checked and in its
final form: `backend` one of `BACKENDS`,
`max_memory` in bytes (`budget.parse_budget`), `dtype` a torch dtype (a `DTYPES` name is taken too), `device` text;
an unknown option raises `ModelLoadError` listing each backend's. llama.cpp's own options (`LlamaSettings`' fields:
context, sequences, threads, repack, flash_attention, exact_prompts, ...) are kept as given, in `llama`. `given`
names every option set (not None), so that the loader refuses an option of the other backend (`backends.loader`)
instead of dropping it; None is "the backend's default" and counts as not given. One object loads any number of
models; a changed budget is `with_budget` (the assistant's share of `--max-memory`), added llama.cpp options
`with_llama`. Nothing below the loader
parses an option again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from assistgen.backends.budget import parse_budget
from assistgen.backends.embedded import ModelLoadError
from assistgen.backends.llamacpp.settings import LlamaSettings

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

    def __post_init__(self):  # (built directly or by `parse`: every field checked and normalised here)
        if self.backend not in BACKENDS:
            raise ModelLoadError(f"Unknown backend {self.backend!r}: use one of {', '.join(BACKENDS)}.")
        unknown = sorted(k for k, _ in self.llama if k not in LLAMA_ONLY)
        if unknown:
            raise ModelLoadError(f"Unknown llama.cpp option {', '.join(unknown)}: it takes {', '.join(LLAMA_ONLY)}.")
        object.__setattr__(self, "dtype", dtype_of(self.dtype))
        if self.device is not None:
            object.__setattr__(self, "device", str(self.device))
        if self.max_memory is not None:
            object.__setattr__(self, "max_memory", parse_budget(self.max_memory))
        object.__setattr__(self, "llama", tuple((k, v) for k, v in self.llama if v is not None))

    @classmethod
    def parse(cls, backend: str = "auto", **options) -> LoadSettings:
        known = (*TORCH_ONLY, *SHARED, *LLAMA_ONLY)
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ModelLoadError(f"Unknown loading option {', '.join(unknown)}: the torch backend takes "
                                 f"{', '.join((*TORCH_ONLY, *SHARED))}; the llama.cpp backend takes "
                                 f"{', '.join((*SHARED, *LLAMA_ONLY))}.")
        return cls(backend=backend, dtype=options.get("dtype"), device=options.get("device"),
                   quantize=options.get("quantize"), max_memory=options.get("max_memory"),
                   llama=tuple((k, options[k]) for k in LLAMA_ONLY if options.get(k) is not None))

    @property
    def given(self) -> frozenset[str]:
        """The options set (not None): an option of the backend not chosen is refused, not dropped."""
        return frozenset([k for k in (*TORCH_ONLY, *SHARED) if getattr(self, k) is not None] +
                         [k for k, _ in self.llama])

    def with_budget(self, max_memory: int | None) -> LoadSettings:
        return replace(self, max_memory=max_memory)

    def with_llama(self, **options) -> LoadSettings:
        """The same settings with these llama.cpp options set too (options a command adds once the backend is
        known, e.g. a server's cells for kept prefixes), checked as any."""
        return replace(self, llama=tuple({**dict(self.llama), **options}.items()))

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
