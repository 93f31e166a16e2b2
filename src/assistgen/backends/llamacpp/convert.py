"""Hugging Face models on llama.cpp's kernels: a transformers folder or hub id converted to GGUF on first use,
quantized to the type asked, and cached.

Contract: `converted_gguf(spec, quantize)` returns the path of a GGUF file of `spec` (a local folder holding a
config.json, or a hub id fetched with huggingface_hub) in the GGUF type `quantize` (`GGUF_TYPES`; None: "auto",
the folder's own 16-bit type), made once and kept under `$ASSISTGEN_CACHE/gguf/hub/`, keyed by the spec, the
folder's config and weight files (names and sizes) and the converter's version, so that a changed model is
converted again. The conversion is llama.cpp's own converter (`convert_hf_to_gguf.py` of the same release as
the loaded libraries, which assistgen-llama-cpp carries as `llama_cpp/convert/`), run in a subprocess to a 16-bit
(or f32 or q8_0) file; the other types are made from that by llama.cpp's quantizer (`llama_model_quantize`).
`is_gguf_type` says whether a `quantize` value names a GGUF type. Every failure is a `ModelLoadError` that names
the cause and the way out (the torch backend reads any transformers model).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from assistgen.backends.embedded import ModelLoadError, say
from assistgen.backends.machine import usable_cores
from assistgen.paths import cache_root, safe_name

CONVERTER_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")  # what the converter writes itself
# what llama.cpp's quantizer makes from them, with the name of its LLAMA_FTYPE_MOSTLY_* constant
QUANTIZER_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q2_k": "Q2_K", "q3_k_s": "Q3_K_S",
                   "q3_k_m": "Q3_K_M", "q3_k_l": "Q3_K_L", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S",
                   "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS"}
GGUF_TYPES = (*CONVERTER_TYPES, *QUANTIZER_TYPES)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def is_gguf_type(quantize: str | None) -> bool:
    return isinstance(quantize, str) and quantize.lower() in GGUF_TYPES


def converted_gguf(spec: str, quantize: str | None, lib) -> tuple[Path, Path]:
    """(the GGUF file, the source folder) for a folder or hub id in type `quantize`, converted when not cached."""
    kind = (quantize or "auto").lower()
    if kind not in GGUF_TYPES:
        raise ModelLoadError(f"quantize={quantize!r} is not a GGUF type llama.cpp makes: use one of "
                             f"{', '.join(GGUF_TYPES)} (int8 and int4 are the torch backend's: --backend torch).")
    folder = source_folder(spec)
    name = safe_name(folder.name if Path(spec).expanduser().is_dir() else spec)
    target = cache_root() / "gguf" / "hub" / f"{name}-{fingerprint(folder)}.{kind}.gguf"
    if target.is_file():
        return target, folder
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    say(f"First use of {spec} on llama.cpp: converting it to GGUF ({kind}) with llama.cpp's converter; the result "
        f"is cached in {target}.")
    direct = kind in CONVERTER_TYPES
    written = target.with_suffix(".tmp") if direct else target.with_name(target.stem + ".16bit.tmp")
    try:
        run_converter(folder, written, kind if direct else "auto")
        if not direct:
            quantize_file(lib, written, target.with_suffix(".tmp"), QUANTIZER_TYPES[kind])
            written.unlink()
            written = target.with_suffix(".tmp")
        os.replace(written, target)
    finally:
        for leftover in target.parent.glob(target.stem + "*.tmp"):
            leftover.unlink()
    say(f"Converted {spec} in {time.perf_counter() - start:.0f} s.")
    return target, folder


def source_folder(spec: str) -> Path:
    """The local folder of a spec: the folder itself, or the hub snapshot huggingface_hub keeps."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: the llama.cpp backend converts transformers model "
                                 "folders (config.json, weights, tokenizer) or runs .gguf files.")
        return path
    if path.exists() or spec.count("/") != 1:
        raise ModelLoadError(f"{spec!r} is neither a model folder, a .gguf file, an embedded alias nor a hub id "
                             "(owner/name).")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.tiktoken", "*.jinja"]))
    except Exception as e:  # huggingface_hub raises many kinds: offline, gated, not found
        raise ModelLoadError(f"Could not fetch {spec} from the Hugging Face hub ({type(e).__name__}: {e}); give a "
                             "local model folder instead.") from e


def fingerprint(folder: Path) -> str:
    """A short hash of what the conversion depends on: the config, the weight files' names and sizes, the converter."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.iterdir()):
        if f.suffix in WEIGHT_SUFFIXES or f.name.startswith("tokenizer"):
            digest.update(f"{f.name}:{f.stat().st_size}".encode())
    digest.update(converter_version().encode())
    return digest.hexdigest()[:12]


def converter_path() -> Path:
    """llama.cpp's converter as assistgen-llama-cpp installs it beside the bindings."""
    spec = importlib.util.find_spec("llama_cpp")
    path = Path(spec.origin).parent / "convert" / "convert_hf_to_gguf.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError("This llama-cpp-python has no GGUF converter beside it (a stock build): `pip uninstall "
                             "llama-cpp-python`, then `pip install 'assistgen[llamacpp]'` (assistgen-llama-cpp carries "
                             "llama.cpp's converter), or load the model with backend='torch' (--backend torch).")
    return path


def converter_version() -> str:
    try:
        return importlib.metadata.version("assistgen-llama-cpp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_converter(folder: Path, out: Path, outtype: str) -> None:
    script = converter_path()
    done = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", outtype],
                          capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        said = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise ModelLoadError(f"llama.cpp's converter could not convert {folder}:\n{said}\nIf llama.cpp does not run "
                             "this architecture, load it with backend='torch' (--backend torch).")


def quantize_file(lib, source: Path, out: Path, ftype: str, requantize: bool = False) -> None:
    """llama.cpp's quantizer, as `llama-quantize` runs it, on all cores; `requantize`: from a quantized file, every
    matrix (the head too) to `ftype` (`--allow-requantize --pure`)."""
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = usable_cores()
    params.allow_requantize = params.pure = requantize
    if lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        hint = ": some row lengths may not fit that type's blocks; try q8_0 or q4_0" if requantize else ""
        raise ModelLoadError(f"llama.cpp's quantizer could not make {ftype} from {source.name}{hint}.")
