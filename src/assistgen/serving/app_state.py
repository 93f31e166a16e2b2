"""What the server's handlers share: its settings (`ServerSettings`) and the app's state (`AppState`: the engine,
its model's context, the metrics, the speech model it transcribes with, whether it is closing, the call syntax of its
model's template), found from a request by `state_of`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown (new ones: 503)
    max_upload_bytes: int = 25 * 2**20  # the largest audio file a transcription request may upload (OpenAI's)
    max_audio_seconds: float = 600.0  # the longest audio a transcription request may send
    # The keys a request must carry as its bearer token (`gate.Gate`; none: the server answers anyone who reaches it)
    api_keys: tuple[str, ...] = ()
    metrics_need_key: bool = False  # /metrics behind the keys too (default: open, as /health, for a scraper)
    max_body: int = 4 * 2**20  # the largest body a JSON endpoint takes (larger: 413 before it is read)
    request_timeout: float | None = None  # seconds a request may take, queued or running; then it ends ("timeout")
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets call it ("*": any); none: no CORS headers
    root_path: str = ""  # the path prefix a reverse proxy serves it under (uvicorn's root_path)
    tls_keyfile: str | None = None  # TLS through uvicorn: both files, or neither
    tls_certfile: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        for key in self.api_keys:
            if not isinstance(key, str) or not key.strip() or key != key.strip() or not key.isprintable():
                raise ConfigError("An API key must be printable text without spaces at its ends; got one that is "
                                  "empty or is not.")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout (--shutdown-grace) must be 0 or more seconds, got "
                              f"{self.shutdown_timeout}.")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if (self.tls_keyfile is None) != (self.tls_certfile is None):
            raise ConfigError("TLS needs both --ssl-keyfile and --ssl-certfile.")
        for name in ("tls_keyfile", "tls_certfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--{name.replace('tls', 'ssl').replace('_', '-')} {path}: no such file.")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"--root-path must start with / and not end with one, got {self.root_path!r}.")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ConfigError(f"request_timeout (--request-timeout) must be above 0 seconds, got "
                              f"{self.request_timeout}.")
        if self.metrics_need_key and not self.api_keys:
            raise ConfigError("--metrics-need-key puts /metrics behind the API keys: give --api-key too.")
        if not self.max_body > 0:
            raise ConfigError(f"max_body (--max-body) must be above 0, got {self.max_body}.")
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
    def longest_token(self) -> int:
        """An upper bound on the bytes any one token of the model stands for: its vocabulary's longest entry in UTF-8
        (a byte-level entry's characters are each one byte or more, a byte-fallback entry's name is longer than its
        byte), so that text's bytes over it bound its tokens from below (`jobs.fits_untokenized`)."""
        vocab = self.engine.target.tokenizer.get_vocab()
        return max(1, max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1))

    @functools.cached_property
    def call_syntax(self) -> CallSyntax | None:
        """How the target's chat template writes tool calls, its markers looked up in its tokenizer once (None: the
        template renders no tools)."""
        return call_syntax(self.engine.target.tokenizer)


def state_of(http: HTTPRequest) -> AppState:
    return http.app.state.assistgen
