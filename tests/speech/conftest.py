"""Speech clips synthesized with espeak-ng (installed by the Makefile: `helpers.speak`), and the embedded Whispers."""

from __future__ import annotations

import pytest
from helpers import SENTENCE, speak

# A repeated phrase: prompt lookup and the n-gram cache find their drafts in the transcript itself.
REPEATED = "Please hold the line. Please hold the line. Please hold the line. Your call is important to us."
# About 36 s: long-form decoding (two windows or more, the second starting where the first's last segment ended).
LONG = ("The history of the harbor begins with a small fishing village. Over two centuries it grew into a busy port. "
        "Ships arrived from every continent, carrying grain, timber, and spices. The merchants built warehouses along "
        "the river, and the town council paved the streets with stone. In the winter the harbor froze, and the workers "
        "repaired the boats and mended the nets. Every spring the festival of the sea opened the sailing season. "
        "Children ran along the docks, and musicians played on the decks of the ships. Today the old warehouses hold "
        "museums, cafes, and small shops, and visitors walk along the river to watch the sunset over the water.")


@pytest.fixture(scope="session")
def long_clip(tmp_path_factory):
    return speak(LONG, tmp_path_factory.mktemp("speech") / "long.wav")


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
