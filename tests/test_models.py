"""Model loading from a local folder, and the embedded aliases' cache."""

from __future__ import annotations

from conftest import encode, tiny_llama

from assistgen import generate, load_model
from assistgen.models import EMBEDDED, converted_dir


def test_local_model_folder_loads_and_generates_the_same(tmp_path):
    model = tiny_llama()
    model.hf.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), fast_linear=False)
    ids = encode("hello world")
    a = generate(model, ids, max_new_tokens=20, eos_token_ids=()).token_ids
    b = generate(loaded, ids, max_new_tokens=20, eos_token_ids=()).token_ids
    assert a == b


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    assert converted_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    assert set(EMBEDDED) == {"smollm2-135m", "gemma3-270m"}
