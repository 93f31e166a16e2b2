"""Loading causal language models: embedded aliases, hub ids, local folders and `.gguf` files.

Contract: `load(spec)` returns a `Model` (`model.py`: a Hugging Face causal LM in eval mode plus its
tokenizer, behind the backend seam) or raises `ModelLoadError` with a message that names the problem and the way out. It
knows where models come from and how to cache converted GGUF files; it knows nothing about
decoding. GGUF files are dequantized once (slow) and the float32 result is kept under the cache
folder (`$ASSISTGEN_CACHE`, default `~/.cache/assistgen`) so that later loads take seconds; a GGUF
split over numbered packages (`SplitGGUF`) is joined there once, checked by size and sha256. With
`quantize=`, the model is quantized once (`quantize.py`) and read back from its quantized copy.
With `device=`, it is moved to that device (a GPU asked for where there is none is refused first).
With `max_memory=`, the weights are offloaded (`offload.py`): file-backed on the CPU, partly in CPU memory on a GPU.
Loading only: optimizing for speed (`transforms.optimize`) and measuring costs are separate explicit steps.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from assistgen.backends.budget import resident
from assistgen.backends.embedded import EMBEDDED, EmbeddedModel, ModelLoadError
from assistgen.backends.embedded import say as _say
from assistgen.backends.gguf_reads import parsed_once
from assistgen.backends.torch import offload
from assistgen.backends.torch.devices import DeviceError, resolve_device
from assistgen.backends.torch.model import Model
from assistgen.paths import cache_root, replaced_atomically, safe_name


def converted_dir(alias: str) -> Path:
    return cache_root() / "models" / alias


def is_cached(alias: str) -> bool:
    return (converted_dir(alias) / "config.json").exists()


def load(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantize: str | None = None,
    max_memory: int | None = None,
) -> Model:
    """Load `spec`: an embedded alias, a `.gguf` file, a local model folder or a hub id.

    `device`: "cpu", "cuda" or "cuda:N", checked before anything is read (a GPU where this machine or this
    PyTorch build has none is refused, naming the fix); the model is moved there after loading.
    `quantize` ("int8" | "int4" | None): weight-only quantization (`quantize.py`, CPU only); the quantized
    model is cached on disk, so later loads read it directly and never hold float weights.
    `max_memory` (bytes): offloaded weights (`offload.py`): on the CPU the weights stay
    file-backed and the budget is checked against what must stay resident; on a GPU, layers beyond the budget stay
    in CPU memory and are moved to the GPU per forward pass.
    Loading only: the optimization step (`transforms.optimize`) and the policy's measurements are separate
    explicit steps (`assistgen.api.prepare`).
    """
    from assistgen.backends.torch.quantization_schemes import check_scheme
    from assistgen.backends.torch.quantize import is_saved, load_quantized, save_quantized
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
    budget = max_memory  # (parsed into bytes: `backends.settings`)
    before = resident(trim=True)  # (growth measured from here: see check_budget)
    source = _source(spec)
    offloaded = budget is not None and place.type != "cpu"
    if offloaded:
        model = source.load(dtype, placement=offload.device_map(place, budget))
    elif scheme is None:
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
            if budget is not None:  # read back from its file: file-backed weights, not the copies quantizing made
                del model
                model = load_quantized(folder, dtype, source.name)
    if not offloaded:
        model.hf.to(place)
    model.max_memory = budget
    if budget is not None and not offloaded:
        offload.check_budget(model, before)
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

    def load(self, dtype: torch.dtype, for_quantizing: bool = False, placement: dict | None = None) -> Model:
        """placement: from_pretrained's device_map= and max_memory= (accelerate's), or None."""
        if self.hub is not None:
            return _load_hub(self.hub, dtype, placement)
        if self.folder is not None:
            return _load_folder(self.folder, dtype, self.name, placement)
        if (self.converted / "config.json").exists():
            return _load_folder(self.converted, dtype, self.name, placement)
        gguf = self.gguf or self.entry.gguf_path()
        if for_quantizing:  # straight from the GGUF file: no float folder written for a model used quantized
            hf, tokenizer = _read_gguf(gguf, dtype, self.entry)
            return Model(hf.eval(), tokenizer, self.name)
        _say(f"First use of {self.name}: converting its GGUF file to float32 (dequantizing takes about half a minute); "
             f"the result is cached in {self.converted}.")
        _convert_gguf(gguf, self.converted, self.entry)
        return _load_folder(self.converted, dtype, self.name, placement)


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


def _read_gguf(path: Path, dtype: torch.dtype, entry: EmbeddedModel | None = None):
    """(hf, tokenizer) dequantized from a GGUF file by transformers; a file it cannot read is reported
    (and, when it was assembled from packages, removed so that the next use joins it again)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with parsed_once():  # (transformers parses the file for the config, the weights and the tokenizer)
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


def _load_folder(folder: Path, dtype: torch.dtype, name: str, placement: dict | None = None) -> Model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{folder} is not a model folder (no config.json).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **(placement or {}))
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


def _load_hub(spec: str, dtype: torch.dtype, placement: dict | None = None) -> Model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool) -> Model:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=local_only)
        hf = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=local_only, **(placement or {}))
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
