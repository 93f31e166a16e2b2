"""What the server's handlers share: its settings (`ServerSettings`) and the app's state (`AppState`: the engine,
its model's context, the metrics, the speech model it transcribes with, whether it is closing, the call syntax of its
model's template), found from a request by `state_of`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from assistgen.chat.syntax import CallSyntax, call_syntax
from assistgen.config import ConfigError
from assistgen.serving.batching import BatchEngine
from assistgen.serving.metrics import Metrics
from assistgen.serving.speech_service import SpeechService
from assistgen.spec.drafts import Drafter


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients give as "model" (requests naming another get 404)
    ngram_cache: bool = False  # an n-gram cache across requests, one per API key
    suffix: bool = False  # suffix drafting over the request and its API key's earlier requests
    share_prefix_cache: bool = False  # kept prefixes serve every request, whatever its key (default: its key's only)
    max_tokens_limit: int | None = None  # the most new tokens a request may ask for (None: no limit)
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown
    max_upload_bytes: int = 25 * 2**20  # the largest audio file a transcription request may upload (OpenAI's)
    max_audio_seconds: float = 600.0  # the longest audio a transcription request may send

    def __post_init__(self):
        if self.max_tokens_limit is not None and not self.max_tokens_limit > 0:
            raise ConfigError(f"max_tokens_limit (--max-tokens-limit) must be above 0, got {self.max_tokens_limit}.")
        if not self.max_upload_bytes > 0:
            raise ConfigError(f"max_upload_bytes must be above 0, got {self.max_upload_bytes}.")
        if not self.max_audio_seconds > 0:
            raise ConfigError(f"max_audio_seconds must be above 0, got {self.max_audio_seconds}.")


@dataclass
class AppState:
    """What the handlers share: the engine and its model's context, the settings, the metrics."""

    engine: BatchEngine
    settings: ServerSettings
    make_drafter: Callable[..., Drafter] | None
    context: int  # the longest sequence the engine's target (and drafter) can take
    metrics: Metrics
    speech: SpeechService | None = None  # the speech model /v1/audio/transcriptions uses (None: none served)
    closing: bool = False

    @functools.cached_property
    def call_syntax(self) -> CallSyntax | None:
        """How the target's chat template writes tool calls, its markers looked up in its tokenizer once (None: the
        template renders no tools)."""
        return call_syntax(self.engine.target.tokenizer)


def state_of(http: HTTPRequest) -> AppState:
    return http.app.state.assistgen
