"""What the user-facing arguments of `generate`/`stream` mean: the prompt's token ids, the generation settings, a
JSON schema's structure and the schedule.

Contract: each function turns one argument as a user gives it (a prompt string or ids, keyword settings, a schema
as a dict or text, a schedule object) into what the loop takes, or raises `ConfigError` naming what is wrong and how
to write it instead.
"""

from __future__ import annotations

import json

from assistgen.backends.base import LanguageModel
from assistgen.chat.templates import encode_chat
from assistgen.config import ConfigError, GenerationConfig, Structure
from assistgen.drafters.prediction import Prediction
from assistgen.policy.adaptive import Adaptive
from assistgen.spec.steps import Schedule


def encode_prompt(model: LanguageModel, prompt: str | list[int], chat: bool = False) -> list[int]:
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
    if chat:
        return encode_chat(model, [{"role": "user", "content": prompt}])
    return list(model.tokenizer(prompt)["input_ids"])



def predicted(model: LanguageModel, prediction: str | list[int] | None, prompt_length: int) -> Prediction | None:
    """`prediction` (text, tokenized without special tokens, or token ids) as the prediction drafter's `Prediction`
    of an output that begins after `prompt_length` tokens; None without one."""
    if prediction is None:
        return None
    if isinstance(prediction, str):
        ids = list(model.tokenizer(prediction, add_special_tokens=False)["input_ids"]) if prediction else []
    elif isinstance(prediction, (list, tuple)):
        vocab = model.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prediction):
            raise ConfigError(f"prediction: token ids must be integers from 0 to {vocab - 1} (the model's "
                              "vocabulary); or give the predicted text as a string.")
        ids = list(prediction)
    else:
        raise ConfigError(f"prediction must be the predicted text (a string) or its token ids, got "
                          f"{type(prediction).__name__}.")
    return Prediction(tuple(ids), prompt_length)


def generation_config(settings: dict) -> GenerationConfig:
    """The `GenerationConfig` of `generate`'s keyword settings (`json_schema=` as a structure, `logit_bias` as a dict
    {token id: bias} too, `bad_words` as lists of token ids);
    an unknown setting is a ConfigError listing the known ones."""
    settings = dict(settings)
    if "json_schema" in settings:
        settings["structure"] = json_schema_structure(settings.pop("json_schema"))
    if isinstance(settings.get("logit_bias"), dict):
        settings["logit_bias"] = tuple(settings["logit_bias"].items())
    if isinstance(settings.get("bad_words"), (list, tuple)):
        settings["bad_words"] = tuple(tuple(w) if isinstance(w, (list, tuple)) else w for w in settings["bad_words"])
    try:
        return GenerationConfig(**settings)
    except TypeError as e:
        allowed = ", ".join(GenerationConfig.__dataclass_fields__)
        raise ConfigError(f"Unknown generation setting: {e}. Allowed: {allowed}.") from e


def default_schedule() -> Schedule:
    """The cost-aware policy: k (0 included) chosen before every step from measured costs and acceptance."""
    return Adaptive()



def json_schema_structure(schema) -> Structure:
    """A JSON schema (a dict, or its JSON text) as the structure the output must follow."""
    if isinstance(schema, dict):
        return Structure("json_schema", json.dumps(schema))
    if isinstance(schema, str) and schema.strip():
        return Structure("json_schema", schema)
    raise ConfigError(f"json_schema must be a JSON schema: a dict or its JSON text, got {type(schema).__name__}.")



def as_schedule(schedule) -> Schedule:
    """A schedule object (settings; each generation gets its own run from `prepare`)."""
    if isinstance(schedule, str):
        raise ConfigError(f"schedule={schedule!r} is the command line's form (--schedule); in Python give a schedule "
                          "object: assistgen.Adaptive(max_k=...), Constant(k=...), Heuristic() or confidence(k, "
                          "threshold) (assistgen.cli.schedule.parse_schedule turns the text into one).")
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule must be a schedule object (assistgen.Adaptive, Constant, Heuristic or "
                          f"confidence(...)), got {type(schedule).__name__}.")
    return schedule



