"""Loading a model into llama.cpp: embedded aliases and `.gguf` paths memory-mapped as they are, transformers
folders and hub ids converted to GGUF once (`convert.py`, to the type `LlamaSettings.quantize` names); a GGUF file
given a `quantize` type or a kept `head` is derived once (`derive.py`: requantized, its head kept to the most frequent
tokens) and the derived file loaded.

Contract: `load(spec, settings)` returns a `LlamaModel` or raises `ModelLoadError` naming the way out:
llama-cpp-python not installed (the install command), a spec that is neither a GGUF file nor a convertible
model, a file llama.cpp cannot load (its own message, and `backend="torch"`).
The tokenizer is the Hugging Face tokenizer transformers builds from the same GGUF (the torch backend's,
or a converted model's own folder's,
so that a model on either backend drafts for the other with token ids as they are), saved once under the
cache folder; it is checked to give llama.cpp's own ids on a test text (`check_tokenizer`), and a file
on which the two differ is refused rather than decoded with ids llama.cpp would not produce.
With `LlamaSettings.max_memory` (a budget, `backends.budget`) the file is memory-mapped explicitly and not
repacked, and a budget below what must stay resident (the context's own memory, measured after one pass, and the
largest layer's weights) is refused naming the smallest that works (`check_budget`).
`available()` says whether the backend can be used here, without loading anything.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
from dataclasses import replace
from pathlib import Path

from assistgen.backends.budget import check_model_budget, resident
from assistgen.backends.embedded import EMBEDDED, ModelLoadError, say
from assistgen.backends.gguf_reads import parsed_once
from assistgen.backends.llamacpp.convert import converted_gguf
from assistgen.backends.llamacpp.derive import derived_gguf
from assistgen.backends.llamacpp.exactness import kernel_switch
from assistgen.backends.llamacpp.gguf import tensor_sizes
from assistgen.backends.llamacpp.guard import check_cpu
from assistgen.backends.llamacpp.kernels import kernel_families, load_backends
from assistgen.backends.llamacpp.model import LlamaModel, cell_bytes
from assistgen.backends.llamacpp.settings import DEFAULT_CONTEXT, LlamaSettings
from assistgen.config import DEFAULT_PREFIX_CACHE
from assistgen.paths import cache_root, replaced_atomically, safe_name

INSTALL = "pip install 'assistgen[llamacpp]' (it compiles llama.cpp's two libraries: a few minutes)"

# Text on which the Hugging Face tokenizer must give llama.cpp's ids: code, whitespace runs, digits,
# accents, CJK and an emoji (byte fallback), punctuation.
CHECK_TEXT = ("def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)  # 3.14159\n\n\n"
              "Ünïcödé naïve café — 東京の天気 🙂! 'quotes' \"double\"\t tabs   spaces 12345 ¿Qué?")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a spec names (an embedded alias or a `.gguf` path), or None for other specs."""
    if spec in EMBEDDED:
        return EMBEDDED[spec].gguf_path()
    if spec.endswith(".gguf"):
        return Path(spec).expanduser()
    return None


def load(spec: str, settings: LlamaSettings | None = None) -> LlamaModel:
    settings = settings or LlamaSettings()  # (parsed: `backends.settings`; a budget in bytes)
    if settings.max_memory is not None:
        settings = replace(settings, repack=False)  # file-backed weights: repacked layouts are anonymous copies
    lib = library()
    errors = _capture_log(lib)
    path, source = gguf_file(spec.strip()), None
    if path is None:  # a transformers folder or hub id: converted (and quantized) on first use
        path, source = converted_gguf(spec.strip(), settings.quantize, lib)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    given = path  # (its tokenizer is the derived file's)
    if settings.head is not None or (source is None and settings.quantize is not None):
        path = derived_gguf(path, settings.quantize if source is None else None, settings.head, lib)
    before = resident(trim=True)  # (growth measured from here: see check_budget)
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = settings.repack
    if settings.max_memory is not None:  # weights file-backed: never locked, never read into buffers of their own
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP
    errors.clear()
    model_ptr = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model_ptr:
        raise ModelLoadError(f"llama.cpp could not load {path}: {_said(errors)}. If its architecture is one llama.cpp "
                             "does not run, load it with backend='torch' (--backend torch).")
    trained = lib.llama_model_n_ctx_train(model_ptr)
    context = settings.context or min(trained, DEFAULT_CONTEXT)
    per_cell = cell_bytes(lib, model_ptr)
    if settings.kept_bytes != "auto" and (isinstance(settings.kept_bytes, bool) or
                                          not isinstance(settings.kept_bytes, int) or settings.kept_bytes < 0):
        lib.llama_model_free(model_ptr)
        raise ModelLoadError(f"kept_bytes must be a number of bytes >= 0 or 'auto', got {settings.kept_bytes!r}.")
    settings = replace(settings, context=context, kept_bytes=max(DEFAULT_PREFIX_CACHE, context * per_cell)
                       if settings.kept_bytes == "auto" else settings.kept_bytes)
    kept = settings.kept_bytes // per_cell  # cells for finished sequences kept for reuse
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = context + kept
    cparams.n_batch = context  # any one feed of a sequence fits one llama_decode
    cparams.n_ubatch = min(settings.ubatch, context)
    cparams.n_seq_max = settings.sequences
    cparams.n_threads = cparams.n_threads_batch = settings.thread_count()
    cparams.flash_attn_type = 1 if settings.flash_attention else 0
    cparams.kv_unified = True  # one pool of cells: a fork copies metadata only
    cparams.swa_full = True  # sliding-window layers keep every position, so a rollback never needs a lost one
    cparams.no_perf = True
    errors.clear()
    context_ptr = lib.llama_init_from_model(model_ptr, cparams)
    if not context_ptr:
        lib.llama_model_free(model_ptr)
        raise ModelLoadError(f"llama.cpp could not make a context of {context} positions and {settings.sequences} "
                             f"sequences for {path.name}: {_said(errors)}. Ask for a shorter context (--context).")
    name = spec if spec in EMBEDDED or source is not None else path.name
    key = safe_name(f"{path.stem}-{path.stat().st_size}")
    tokenizer = _tokenizer(given, safe_name(f"{given.stem}-{given.stat().st_size}")) if source is None else \
        _folder_tokenizer(source)
    model = LlamaModel(lib, model_ptr, context_ptr, tokenizer, name, path, settings, cache_key=f"llama.cpp-{key}")
    check_tokenizer(model)
    if settings.max_memory is not None:
        check_budget(model, before)
    return model


def check_budget(model: LlamaModel, before: dict[str, int]) -> None:
    """Refuse a budget below what must stay resident: the context's own memory (KV cells, compute buffers, measured
    after one pass as the anonymous memory the load added, the tokenizer included) and the largest layer's weights."""
    check_model_budget(model, before, "KV cache, buffers and tokenizer", "one layer's weights",
                       largest_layer_bytes(model.path))


def largest_layer_bytes(path: Path) -> int:
    """The bytes of the largest transformer block's tensors in a GGUF file (`blk.N.*`)."""
    sizes: dict[str, int] = collections.Counter()
    for name, size in tensor_sizes(path).items():
        if name.startswith("blk."):
            sizes[name.split(".")[1]] += size
    return max(sizes.values(), default=0)


def library():
    """llama-cpp-python's low-level module, with llama.cpp's log kept quiet (errors are kept for messages)."""
    if not available():
        raise ModelLoadError(f"The llama.cpp backend needs llama-cpp-python: {INSTALL}. Or use backend='torch'.")
    import os

    # ggml's tiled K-quant matmul (taken for 8 or more rows of weights that are not repacked) gives a row other
    # bits than the one-row kernel, and measured slower here: off unless the user set it (docs/benchmarks.md).
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    check_cpu()  # the libraries tried in a child process first: a build this CPU cannot run is an error, not SIGILL
    import llama_cpp.llama_cpp as lib

    try:
        load_backends()  # a portable build's CPU library for this CPU
    except RuntimeError as e:  # ASSISTGEN_GGML_CPU naming one this CPU cannot run, or none there
        raise ModelLoadError(f"{e}. Unset ASSISTGEN_GGML_CPU to let ggml choose.") from e
    return lib


_LOG: collections.deque[str] = collections.deque(maxlen=20)
_CALLBACK = None


def _capture_log(lib) -> collections.deque[str]:
    """Route llama.cpp's log into `_LOG` (errors and warnings only), once per process."""
    global _CALLBACK
    if _CALLBACK is None:
        import os

        verbose = bool(os.environ.get("ASSISTGEN_LLAMA_LOG"))

        def on_log(level: int, text: bytes, _user) -> None:
            line = text.decode(errors="replace")
            if level in (2, 3):  # GGML_LOG_LEVEL_WARN, _ERROR
                _LOG.append(line.strip())
            if verbose:
                print(line, end="", flush=True)

        _CALLBACK = lib.llama_log_callback(on_log)
        lib.llama_log_set(_CALLBACK, ctypes.c_void_p(0))
        lib.llama_backend_init()
    return _LOG


def _said(errors: collections.deque[str]) -> str:
    return " | ".join(line for line in errors if line) or "no reason given"


def _tokenizer(path: Path, key: str):
    """The Hugging Face tokenizer of a GGUF file, built once by transformers and kept under the cache folder."""
    from transformers import AutoTokenizer

    folder = cache_root() / "tokenizers" / key
    if (folder / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(folder))
    say(f"First use of {path.name} on llama.cpp: reading its tokenizer (cached in {folder}).")
    try:
        with parsed_once():  # (transformers parses the file for the config and for the tokenizer)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds on a file it cannot read
        raise ModelLoadError(f"Could not read the tokenizer of {path}: {type(e).__name__}: {e}") from e
    with replaced_atomically(folder) as tmp:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(tmp)
    return tokenizer


def _folder_tokenizer(folder: Path):
    """A converted model's tokenizer: its own folder's (checked against llama.cpp's ids like any other)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds on a folder it cannot read
        raise ModelLoadError(f"Could not read the tokenizer of {folder}: {type(e).__name__}: {e}") from e


def llama_tokenize(model: LlamaModel, text: str) -> list[int]:
    """llama.cpp's own ids for `text` (no special tokens added or parsed)."""
    lib, raw = model.lib, text.encode()
    room = len(raw) + 8
    out = (lib.llama_token * room)()
    n = lib.llama_tokenize(model._vocab, raw, len(raw), out, room, False, False)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} slots")
    return list(out[:n])


def check_tokenizer(model: LlamaModel, text: str = CHECK_TEXT) -> None:
    ours = list(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    theirs = llama_tokenize(model, text)
    if ours != theirs:
        pairs = enumerate(zip(ours, theirs, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
        raise ModelLoadError(
            f"The tokenizer transformers builds from {model.path.name} differs from llama.cpp's own on a test text "
            f"(first at token {at}: {ours[at:at + 3]} vs {theirs[at:at + 3]}), so text and ids would not match "
            "what llama.cpp computes: load it with backend='torch' (--backend torch).")


def library_report() -> dict:
    """What `assistgen info` says of the llama.cpp libraries: where they are, whether they have the row-exact switch
    (`make llamacpp`'s build) and what ggml found of the CPU. {"available": False} without llama-cpp-python."""
    if not available():
        return {"available": False, "install": INSTALL}
    lib = library()
    _capture_log(lib)
    probe = check_cpu()
    system_info = lib.llama_print_system_info().decode(errors="replace").strip()
    return {"available": True, "library": str(Path(lib._lib._name).resolve().parent),
            "row_exact": kernel_switch(lib) is not None, "system_info": system_info,
            "cpu_library": probe.get("variant") or "built in", "extra_buffer_types": probe.get("extra", []),
            "families": kernel_families(system_info, probe.get("extra", [])), "kernel_check": probe.get("rows", []),
            "amx_off": bool(probe.get("amx_off"))}
