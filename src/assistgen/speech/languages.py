"""The language a Whisper decodes in: a given one checked against the model, or detected from the first window.

Contract: `check_language` is the code the model knows for a given language (None for an English-only model asked
for English), a `ConfigError` naming the fix otherwise; `detect_language` is transformers' `detect_language`: the
most likely language token after <|startoftranscript|>.
"""

from __future__ import annotations

from assistgen.backends.torch.speech import HeardModel, SpeechModel
from assistgen.config import ConfigError


def check_language(speech: SpeechModel, language: str | None) -> str | None:
    if language is None:
        return None
    if not speech.multilingual:
        if language.strip().lower() in ("en", "english"):
            return None
        raise ConfigError(f"{speech.name} is English-only: it cannot take language={language!r}. Leave it out, or use "
                          "a multilingual model (whisper-base).")
    code = language.strip().lower()
    if code not in speech.languages:
        raise ConfigError(f"{speech.name} does not know the language {language!r}: give an ISO 639-1 code it knows "
                          f"({', '.join(sorted(speech.languages)[:12])}, ...).")
    return code



def detect_language(speech: SpeechModel, heard: HeardModel) -> str:
    """The most likely language token after <|startoftranscript|> (transformers' `detect_language`)."""
    logits = heard.new_cache().feed([speech.generation.decoder_start_token_id])[-1]
    codes = list(speech.languages)
    ids = [speech.languages[c] for c in codes]
    return codes[int(logits[ids].argmax())]



