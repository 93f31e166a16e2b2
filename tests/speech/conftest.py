"""Speech clips synthesized with espeak-ng (installed by the Makefile: `helpers.speak`), and the embedded Whispers."""

from __future__ import annotations

import pytest
from helpers import SENTENCE, speak

# A repeated phrase: prompt lookup and the n-gram cache find their drafts in the transcript itself.
REPEATED = "Please hold the line. Please hold the line. Please hold the line. Your call is important to us."


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
