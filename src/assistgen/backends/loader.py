"""Choosing a backend and loading a model on it: `load(spec, backend="auto" | "torch" | "llama.cpp", ...)`.

Contract: "auto" picks llama.cpp for a GGUF file (an embedded alias or a `.gguf` path) on the CPU when
llama-cpp-python is installed and nothing only the torch backend does was asked for (`dtype`, `quantize="int8"|
"int4"`, a GPU), and for any model when `quantize` names a GGUF type (`llamacpp.convert.GGUF_TYPES`: a
transformers folder or hub id converted on first use). A transformers folder or hub id with `quantize="int8"|"int4"`
goes to whichever backend runs that width faster on this CPU, measured once and recorded (`choice`); everything
else loads on torch. Options that belong to
one backend are refused on the other with a message naming the fix, never ignored: `dtype` and `device` are the
torch backend's; `context`, `sequences`, `threads`, `repack`, `flash_attention` and `exact_prompts`
(`LlamaSettings`) are llama.cpp's. `max_memory` (a memory budget, `backends.budget`: offloaded weights) and
`quantize` (int8/int4 on torch, a GGUF type on llama.cpp) are both backends'.
The options arrive parsed (`settings.LoadSettings`). Bad specs raise `ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import replace

from assistgen.backends import choice
from assistgen.backends.embedded import EMBEDDED, ModelLoadError
from assistgen.backends.llamacpp import loading as llama_loading
from assistgen.backends.llamacpp.convert import is_gguf_type
from assistgen.backends.settings import BACKENDS, LLAMA_ONLY, TORCH_ONLY, LoadSettings

__all__ = ["BACKENDS", "LoadSettings", "choose_backend", "load"]


def choose_backend(spec: str, settings: LoadSettings) -> str:
    """The backend `load` would use for `spec` with these settings (a measured case is measured here, once)."""
    if settings.backend != "auto":
        return settings.backend
    if settings.given & set(LLAMA_ONLY):
        return "llama.cpp"
    if isinstance(spec, str) and choice.is_measured_case(spec, settings, llama_loading.available()):
        return choice.measured_backend(spec, settings, load)
    gguf = isinstance(spec, str) and (spec.strip() in EMBEDDED or spec.strip().endswith(".gguf"))
    quantize = settings.quantize
    torch_only = settings.dtype is not None or (quantize is not None and not is_gguf_type(quantize)) or \
        not settings.on_cpu()
    return "llama.cpp" if (gguf or is_gguf_type(quantize)) and not torch_only and llama_loading.available() \
        else "torch"


def load(spec: str, settings: LoadSettings | None = None):
    """Load `spec` on the backend `settings` choose (`LoadSettings()`: auto, each backend's defaults)."""
    settings = settings or LoadSettings()
    chosen = choose_backend(spec, settings)
    if chosen == "llama.cpp" and settings.backend == "auto" and choice.is_measured_case(spec, settings, True):
        settings = replace(settings, quantize=choice.TWINS[settings.quantize.lower()])  # the width, in llama.cpp's type
    if chosen == "llama.cpp":
        wrong = [k for k in TORCH_ONLY if k in settings.given and not (k == "device" and settings.on_cpu())]
        if settings.quantize is not None and not is_gguf_type(settings.quantize):
            wrong.append("quantize")
        if wrong:
            raise ModelLoadError(f"{', '.join(wrong)} belong to the torch backend; llama.cpp runs GGUF weight types "
                                 "on the CPU (quantize there names one: a transformers folder is converted to it, a "
                                 "GGUF file requantized to it: q4_0, q4_k_m, q8_0, ...). Use backend='torch' "
                                 "(--backend torch) for them.")
        return llama_loading.load(spec, settings.llama_settings())
    if is_gguf_type(settings.quantize):
        raise ModelLoadError(f"quantize={settings.quantize!r} is a GGUF type, which llama.cpp's quantizer makes: use "
                             "backend='llama.cpp' (--backend llama.cpp); the torch backend quantizes to int8 or int4.")
    wrong = [k for k in LLAMA_ONLY if k in settings.given]
    if wrong:
        raise ModelLoadError(f"{', '.join(wrong)} belong to the llama.cpp backend: use backend='llama.cpp' "
                             "(--backend llama.cpp) with a GGUF file.")
    from assistgen.backends.torch.loading import load as torch_load

    return torch_load(spec, **{k: v for k in ("dtype", "device", "quantize", "max_memory")
                               if (v := getattr(settings, k)) is not None})
