"""The public API: `generate()` and `stream()`, thin wrappers around the one loop in `engine.py`.

Contract: turns user-facing arguments (model names or objects, a prompt string or token ids, an
assistant, sampling settings) into a target `Model`, a drafter, a schedule and a
`GenerationConfig`, checks them, and runs `engine.stream`. Bad input raises an `AssistgenError`
subclass whose message says what is wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from assistgen.config import ConfigError, GenerationConfig
from assistgen.drafters import AssistantDrafter, Drafter, NoDrafter, PromptLookupDrafter, same_tokenizer
from assistgen.engine import Chunk
from assistgen.engine import stream as run_loop
from assistgen.models import Model, load_model
from assistgen.schedules import Heuristic
from assistgen.stats import Stats
from assistgen.universal import UniversalDrafter


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only
    prompt_ids: list[int]
    finish_reason: str
    stats: Stats


def as_model(model: Model | str) -> Model:
    return model if isinstance(model, Model) else load_model(model)


def encode_prompt(model: Model, prompt: str | list[int], chat: bool = False) -> list[int]:
    """A prompt string (optionally wrapped in the chat template) or token ids -> token ids."""
    if isinstance(prompt, (list, tuple)):
        if chat:
            raise ConfigError("chat=True needs a text prompt, not token ids.")
        if not all(isinstance(t, int) for t in prompt):
            raise ConfigError("A token-id prompt must be a list of integers.")
        return list(prompt)
    if not isinstance(prompt, str):
        raise ConfigError(f"The prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
    if not prompt.strip():
        raise ConfigError("The prompt is empty: give some text to continue.")
    tok = model.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"{model.name} has no chat template: drop chat=True / --chat.")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok(prompt)["input_ids"])


def make_drafter(target: Model, assistant: Model | str | Drafter | None, lookup: bool) -> Drafter:
    if assistant is not None and lookup:
        raise ConfigError("Choose either an assistant model or prompt lookup, not both.")
    if lookup:
        return PromptLookupDrafter()
    if assistant is None:
        return NoDrafter()
    if hasattr(assistant, "propose") and hasattr(assistant, "observe"):
        return assistant
    assistant = as_model(assistant)
    if same_tokenizer(target, assistant):
        return AssistantDrafter(assistant, target)
    return UniversalDrafter(assistant, target)  # different tokenizers: translate through text


DEFAULT_MAX_K = 6  # on 2 CPU cores a verification of more than ~7 rows costs almost linearly more


def default_schedule(drafter: Drafter):
    """The reference heuristic (start 5, +2 / -1), capped at DEFAULT_MAX_K draft tokens."""
    return Heuristic(max_k=DEFAULT_MAX_K)


def stream(
    model: Model | str,
    prompt: str | list[int],
    assistant: Model | str | Drafter | None = None,
    lookup: bool = False,
    schedule=None,
    chat: bool = False,
    **settings,
) -> Iterator[Chunk]:
    """Stream `Chunk`s (tokens and text per verification step); the last one carries the stats.

    `settings` are the fields of `GenerationConfig`: max_new_tokens, temperature, top_k, top_p,
    seed, stop, eos_token_ids.
    """
    try:
        if isinstance(settings.get("stop"), str):
            settings["stop"] = (settings["stop"],)  # one stop string, not its characters
        config = GenerationConfig(**{k: (tuple(v) if k == "stop" else v) for k, v in settings.items()})
    except TypeError as e:
        allowed = ", ".join(GenerationConfig.__dataclass_fields__)
        raise ConfigError(f"Unknown generation setting: {e}. Allowed: {allowed}.") from e
    config.validate()
    target = as_model(model)
    prompt_ids = encode_prompt(target, prompt, chat)
    drafter = make_drafter(target, assistant, lookup)
    schedule = schedule.fresh() if schedule is not None else default_schedule(drafter)
    yield from run_loop(target, prompt_ids, drafter, schedule, config)


def generate(
    model: Model | str,
    prompt: str | list[int],
    assistant: Model | str | Drafter | None = None,
    lookup: bool = False,
    schedule=None,
    chat: bool = False,
    **settings,
) -> Generation:
    """Generate a continuation of `prompt`; same arguments as `stream`."""
    target = as_model(model)
    prompt_ids = encode_prompt(target, prompt, chat)
    tokens: list[int] = []
    text: list[str] = []
    last = None
    for chunk in stream(target, prompt_ids, assistant, lookup, schedule, **settings):
        tokens.extend(chunk.tokens)
        text.append(chunk.text)
        last = chunk
    return Generation("".join(text), tokens, prompt_ids, last.finish_reason, last.stats)
