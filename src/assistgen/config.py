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
    stop: tuple[str, ...] = ()  # stop strings, matched on decoded text, not emitted (one string or a list: a tuple)
    eos_token_ids: tuple[int, ...] | None = None  # None: from the model's generation config
    logprobs: int | None = None  # None: none; n >= 0: each emitted token's log-probability and its n most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (from the first on), on the first chunk
    structure: Structure | None = None  # None: free text; else the grammar every emitted token must follow
    # How many new tokens the caller expects, when it knows better than max_new_tokens (a transcript's length follows
    # its audio's); None: max_new_tokens. A hint only: one-off costs of a drafter (its catch-up, its start-up) are
    # priced against it; the generation still stops at max_new_tokens, an end token or a stop string.
    expected_new_tokens: int | None = None
    # The sampling set's history-dependent fields (`core/processing.py`: applied at every verified position as plain
    # decoding applies them there) and min-p (`spec.sampling`):
    frequency_penalty: float = 0.0  # OpenAI's: a token's logit less this times its count in the output so far
    presence_penalty: float = 0.0  # OpenAI's: less this once it has occurred in the output
    repetition_penalty: float = 1.0  # HF's and vLLM's: a logit of a token in the prompt or output divided (> 0)
    # or multiplied (< 0) by this
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    min_p: float = 0.0  # after temperature, tokens below this times the likeliest one's probability are dropped
    min_tokens: int = 0  # the end tokens are forbidden until this many new tokens
    ignore_eos: bool = False  # an end token does not end the generation (it is emitted and decoding goes on)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never generated (the last token forbidden after
    # the others)

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
        if isinstance(self.stop, (str, list)):  # (one stop string is itself, not its characters)
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or s == "" for s in self.stop):
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
        self.validate_processing()
        if self.structure is not None:
            if not isinstance(self.structure, Structure) or self.structure.kind not in STRUCTURES:
                raise ConfigError(f"structure must be a Structure whose kind is one of {', '.join(STRUCTURES)}, "
                                  f"got {self.structure!r}.")
            spec = self.structure.spec
            if self.structure.kind != "json_object" and not (isinstance(spec, str) and spec):
                raise ConfigError(f"a {self.structure.kind} structure needs its text in `spec`.")
        return self

    def validate_processing(self) -> None:
        """The sampling set's ranges: OpenAI's for its fields (penalties in [-2, 2], biases in [-100, 100]), vLLM's
        for its extensions."""
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise ConfigError(f"{name} must be a number from -2 to 2 (0: none), got {value!r}.")
        if not is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ConfigError(f"repetition_penalty must be a number above 0 (1: none), got "
                              f"{self.repetition_penalty!r}.")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be a number from 0 to 1 (0: none), got {self.min_p!r}.")
        if not is_count(self.min_tokens) or self.min_tokens > self.max_new_tokens:
            raise ConfigError(f"min_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), got "
                              f"{self.min_tokens!r}.")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}.")
        if self.ignore_eos and self.structure is not None:
            raise ConfigError("ignore_eos cannot go with a structure: a finished structure allows only the end token; "
                              "drop one of them.")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and is_count(pair[0]) and is_number(pair[1])
                    and -100.0 <= pair[1] <= 100.0):
                raise ConfigError(f"logit_bias maps token ids (integers >= 0) to biases from -100 to 100, got "
                                  f"{pair!r}.")
        for word in self.bad_words:
            if not (isinstance(word, tuple) and word and all(is_count(t) for t in word)):
                raise ConfigError(f"bad_words are non-empty sequences of token ids, got {word!r}.")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
