"""Speech clips synthesized with espeak-ng (installed by the Makefile), and the embedded Whisper models."""

from __future__ import annotations

import shutil
import subprocess

import pytest

SENTENCE = "The quick brown fox jumps over the lazy dog. Speculative decoding makes generation faster."
# A repeated phrase: prompt lookup and the n-gram cache find their drafts in the transcript itself.
REPEATED = "Please hold the line. Please hold the line. Please hold the line. Your call is important to us."


def speak(text: str, path) -> str:
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is missing: `make install` installs it (apt-get install espeak-ng).")
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="session")
def clip(tmp_path_factory):
    return speak(SENTENCE, tmp_path_factory.mktemp("speech") / "sentence.wav")


@pytest.fixture(scope="session")
def repeated_clip(tmp_path_factory):
    return speak(REPEATED, tmp_path_factory.mktemp("speech") / "repeated.wav")


@pytest.fixture(scope="session")
def whisper_base():
    from assistgen.speech.transcribe import as_speech_model

    return as_speech_model("whisper-base")


@pytest.fixture(scope="session")
def whisper_tiny_en():
    from assistgen.speech.transcribe import as_speech_model

    return as_speech_model("whisper-tiny-en")
