"""Settings for one generation, as a frozen dataclass: the one home of every default.

Contract: `GenerationConfig` holds what the user asked for and checks it when it is built (`__post_init__`, which
runs `validate`: a config that exists is a valid one, so nothing downstream checks it again), raising `ConfigError`
with a message that names the bad value and the fix. The CLI, the API and the server build it; none re-declares a
default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_PREFIX_CACHE = 256 * 2**20  # bytes of finished requests' keys and values a server keeps for reuse (at least
# one sequence of the model's full context): several conversations of a small model
MAX_LOGPROBS = 20  # the most alternatives a generation may ask for per token (OpenAI's and vLLM's bound)
STRUCTURES = ("json_object", "json_schema", "regex", "grammar")  # what `Structure.kind` may name


class ConfigError(ValueError):
    """A generation setting is out of range; the message names it and says what is allowed."""


class Cancelled(Exception):
    """A generation (or transcription) stopped because its caller's `cancelled()` said so."""


def check_cancelled(cancelled) -> None:
    """`cancelled` must be None or a callable taking nothing (asked between steps: True stops the generation)."""
    if cancelled is not None and not callable(cancelled):
        raise ConfigError(f"cancelled must be a callable taking no arguments that returns True to stop (e.g. "
                          f"threading.Event().is_set), got {type(cancelled).__name__}.")


@dataclass(frozen=True)
class Structure:
    """What the output must match: "json_object" (any JSON object), "json_schema" (`spec`: the schema's JSON text),
    "regex" (`spec`: a regular expression, Rust's syntax) or "grammar" (`spec`: a GBNF grammar, llama.cpp's, or a
    Lark one in llguidance's syntax, whose lazy lexemes leave text free until a trigger opens a structure, as tool
    calls are built by `chat.grammar`). `core/constraint.py` compiles it; a spec that does not compile is a
    ConfigError there."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy (argmax); never approximated by a tiny temperature
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    seed: int | None = None  # seeds the torch.Generator used for sampling
    stop: tuple[str, ...] = ()  # stop strings, matched on decoded text and not emitted
    eos_token_ids: tuple[int, ...] | None = None  # None: from the model's generation config
    logprobs: int | None = None  # None: none; n >= 0: each emitted token's log-probability and its n most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (from the first on), on the first chunk
    structure: Structure | None = None  # None: free text; else the grammar every emitted token must follow
    # How many new tokens the caller expects, when it knows better than max_new_tokens (a transcript's length follows
    # its audio's); None: max_new_tokens. A hint only: one-off costs of a drafter (its catch-up, its start-up) are
    # priced against it; the generation still stops at max_new_tokens, an end token or a stop string.
    expected_new_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def budget(self) -> int:
        """The new tokens one-off costs are priced against: `expected_new_tokens`, at most `max_new_tokens`."""
        return min(self.max_new_tokens, self.expected_new_tokens or self.max_new_tokens)

    def __post_init__(self):
        self.validate()

    def validate(self) -> GenerationConfig:
        """Raise ConfigError naming the first bad setting; returns the config (run once, when it is built)."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}.")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}.")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if math.isinf(self.temperature):
            raise ConfigError("temperature must be finite.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}.")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be None or an integer from 0 to {MAX_LOGPROBS} (the alternatives "
                                  f"to list per token), got {value!r}.")
        if self.expected_new_tokens is not None and (isinstance(self.expected_new_tokens, bool)
                                                     or not isinstance(self.expected_new_tokens, int)
                                                     or self.expected_new_tokens < 1):
            raise ConfigError(f"expected_new_tokens must be None or an integer >= 1, got {self.expected_new_tokens!r}.")
        if self.structure is not None:
            if not isinstance(self.structure, Structure) or self.structure.kind not in STRUCTURES:
                raise ConfigError(f"structure must be a Structure whose kind is one of {', '.join(STRUCTURES)}, "
                                  f"got {self.structure!r}.")
            spec = self.structure.spec
            if self.structure.kind != "json_object" and not (isinstance(spec, str) and spec):
                raise ConfigError(f"a {self.structure.kind} structure needs its text in `spec`.")
        return self
