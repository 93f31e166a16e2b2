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
Bad specs raise `ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import fields

from assistgen.backends import choice
from assistgen.backends.embedded import EMBEDDED, ModelLoadError
from assistgen.backends.llamacpp import loading as llama_loading
from assistgen.backends.llamacpp.convert import is_gguf_type
from assistgen.backends.llamacpp.model import LlamaSettings

BACKENDS = ("auto", "torch", "llama.cpp")
TORCH_OPTIONS = ("dtype", "device", "quantize", "max_memory")
LLAMA_OPTIONS = tuple(f.name for f in fields(LlamaSettings))
SHARED = set(TORCH_OPTIONS) & set(LLAMA_OPTIONS)


def choose_backend(spec: str, backend: str = "auto", **options) -> str:
    """The backend `load` would use for `spec` with these options (a measured case is measured here, once)."""
    if backend not in BACKENDS:
        raise ModelLoadError(f"Unknown backend {backend!r}: use one of {', '.join(BACKENDS)}.")
    if backend != "auto":
        return backend
    if any(options.get(k) is not None for k in LLAMA_OPTIONS if k not in SHARED):
        return "llama.cpp"
    if isinstance(spec, str) and choice.is_measured_case(spec, options, llama_loading.available()):
        return choice.measured_backend(spec, options["quantize"], options, load)
    gguf = isinstance(spec, str) and (spec.strip() in EMBEDDED or spec.strip().endswith(".gguf"))
    quantize = options.get("quantize")
    torch_only = options.get("dtype") is not None or (quantize is not None and not is_gguf_type(quantize)) or \
        str(options.get("device") or "cpu") != "cpu"
    return "llama.cpp" if (gguf or is_gguf_type(quantize)) and not torch_only and llama_loading.available() \
        else "torch"


def load(spec: str, backend: str = "auto", **options):
    """Load `spec` on the chosen backend; `options` are the backend's own (None: its default)."""
    unknown = set(options) - set(TORCH_OPTIONS) - set(LLAMA_OPTIONS)
    if unknown:
        raise ModelLoadError(f"Unknown loading option {', '.join(sorted(unknown))}: the torch backend takes "
                             f"{', '.join(TORCH_OPTIONS)}; the llama.cpp backend takes {', '.join(LLAMA_OPTIONS)}.")
    chosen = choose_backend(spec, backend, **options)
    given = {k: v for k, v in options.items() if v is not None}
    if chosen == "llama.cpp" and backend == "auto" and choice.is_measured_case(spec, given, True):
        given["quantize"] = choice.TWINS[given["quantize"].lower()]  # the width asked, in llama.cpp's type
    if chosen == "llama.cpp":
        wrong = [k for k in given if k in TORCH_OPTIONS and k not in SHARED
                 and not (k == "device" and str(given[k]) == "cpu")]
        if "quantize" in given and not is_gguf_type(given["quantize"]):
            wrong.append("quantize")
        if wrong:
            raise ModelLoadError(f"{', '.join(wrong)} belong to the torch backend; llama.cpp runs a GGUF file's own "
                                 "weight types on the CPU (quantize there names a GGUF type a transformers folder is "
                                 "converted to: q4_k_m, q8_0, ...). Use backend='torch' (--backend torch) for them.")
        return llama_loading.load(spec, LlamaSettings(**{k: v for k, v in given.items() if k in LLAMA_OPTIONS}))
    wrong = [k for k in given if k in LLAMA_OPTIONS and k not in SHARED]
    if is_gguf_type(given.get("quantize")):
        raise ModelLoadError(f"quantize={given['quantize']!r} is a GGUF type, which llama.cpp's quantizer makes: use "
                             "backend='llama.cpp' (--backend llama.cpp); the torch backend quantizes to int8 or int4.")
    if wrong:
        raise ModelLoadError(f"{', '.join(wrong)} belong to the llama.cpp backend: use backend='llama.cpp' "
                             "(--backend llama.cpp) with a GGUF file.")
    from assistgen.backends.torch.loading import load as torch_load

    return torch_load(spec, **given)
