"""A checked body as the library's settings, for any text endpoint.

Contract: `generation_config` turns a body (`common.Sampling`) into the library's `GenerationConfig` for one prompt:
new tokens bounded by the room the prompt leaves in the context and by the server's limit, the structure its tool
calls follow or the one `structure_of` reads from `response_format`, `structured_outputs` or vLLM's guided_* fields
(one of them; `guided_choice`, a list of strings, as a regex of their alternation), the sampling set
(`processing_settings`: penalties, `logit_bias` with token ids as string keys, `min_p`, `min_tokens`, `ignore_eos`,
`bad_words` tokenized as vLLM bans them); a setting the library refuses is a 400 naming the API's field.
"""

from __future__ import annotations

import json

from assistgen.config import ConfigError, GenerationConfig, Structure
from assistgen.core.processing import banned_sequences
from assistgen.serving.wire.common import MAX_STOP, Sampling
from assistgen.serving.wire.errors import APIError


def generation_config(body: Sampling, limit: int | None, room: int,
                      calls: Structure | None = None, tokenizer=None) -> GenerationConfig:
    """The body's GenerationConfig for a prompt that leaves `room` positions of the context: asked-for new tokens
    above `limit` (the server's) or `room` are a 400; none asked for: up to `room`, within `limit` (a prompt that
    leaves no room is refused by the engine's admission, naming the prompt); `calls`:
    the structure its tool calls follow (`chat.grammar.call_structure`), which excludes a response format;
    `tokenizer`: the model's, which `bad_words` are tokenized with. (The endpoints call `refuse_unsupported`
    first.)"""
    asked = body.new_tokens()
    field = body.tokens_field()
    given = {"max_new_tokens": asked, "temperature": body.temperature, "top_p": body.top_p,
             "top_k": body.top_k, "seed": body.seed}
    settings = {k: v for k, v in given.items() if v is not None}
    if body.stop is not None:
        settings["stop"] = body.stop  # (GenerationConfig takes one string or a list)
        if not isinstance(body.stop, str) and len(body.stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(body.stop)}.", param="stop")
    structure = structure_of(body)
    if calls is not None and structure is not None:
        raise APIError(400, "tools and a response format both constrain the output: give one, or tool_choice "
                       '"none".', param="tool_choice")
    settings.update(logprobs=body.asked_logprobs(), prompt_logprobs=body.asked_prompt_logprobs(),
                    structure=structure or calls, **processing_settings(body, tokenizer))
    if asked is None:  # (as OpenAI and vLLM: up to the end of the context, within the server's limit)
        bound = min(room, limit) if limit is not None else room
        settings["max_new_tokens"] = max(1, bound)
    elif isinstance(asked, int) and asked > 0:
        if limit is not None and asked > limit:
            raise APIError(400, f"{field} is {asked}, above this server's limit {limit}.", param=field)
        if 0 < room < asked:  # (room < 1: the prompt does not fit, which admission refuses, naming the prompt)
            raise APIError(400, f"{field} is {asked}, but the prompt leaves room for {room} new tokens in the "
                           f"model's context: ask for at most {room}, or give a shorter prompt.", param=field)
    try:
        return GenerationConfig(**settings)  # (checked as it is built)
    except ConfigError as e:
        message = str(e).replace("max_new_tokens", field)  # GenerationConfig's name -> the API's
        param = next((f for f in type(body).model_fields if message.startswith(f)), None)
        raise APIError(400, message, param=param) from e


PROCESSING = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "ignore_eos")


def processing_settings(body: Sampling, tokenizer) -> dict:
    """The sampling set as GenerationConfig's fields (whose ranges it checks): `logit_bias` {"token id": bias} as
    (id, bias) pairs; `bad_words` each tokenized alone and after a space (a word at the start and inside the text),
    as vLLM bans them."""
    out = {name: getattr(body, name) for name in PROCESSING if getattr(body, name) is not None}
    if body.logit_bias:  # (None or {}: none)
        if not isinstance(body.logit_bias, dict):
            raise APIError(400, "logit_bias: give an object mapping token ids (as strings) to biases from -100 to "
                           "100.", param="logit_bias")
        pairs = []
        for key, bias in body.logit_bias.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise APIError(400, f"logit_bias: {key!r} is not a token id; its keys are token ids as strings, "
                               'e.g. {"1234": -100}.', param="logit_bias")
            pairs.append((int(key), bias))
        out["logit_bias"] = tuple(pairs)
    if body.bad_words:  # (None or []: none)
        words = body.bad_words
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise APIError(400, "bad_words: give a list of non-empty strings.", param="bad_words")
        out["bad_words"] = banned_sequences(tokenizer, words)
    return out


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}  # vLLM's older names
REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")


def structure_of(body: Sampling) -> Structure | None:
    """The grammar `response_format`, `structured_outputs` or a guided_* field asks for (one of them), or None."""
    fmt, extension = body.response_format, body.structured_outputs
    guided = {name: getattr(body, name) for name in GUIDED if getattr(body, name) is not None}
    given = [n for n, v in (("response_format", fmt), ("structured_outputs", extension)) if v is not None]
    given += list(guided)
    if len(given) > 1 and not (given[0] == "response_format" and fmt == {"type": "text"} and len(given) == 2):
        raise APIError(400, f"Give one of {', '.join(given)}: each asks for a structure of its own.",
                       param=given[-1])
    if guided:
        name, value = next(iter(guided.items()))
        return structure_value(GUIDED[name], value, name)
    if extension is not None:
        return extension_structure(extension)
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, 'response_format.json_schema.schema: give the JSON schema as an object, as in '
                           '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}.',
                           param="response_format.json_schema.schema")
        return Structure("json_schema", json.dumps(schema))
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}.",
                   param="response_format")


def extension_structure(extension) -> Structure:
    """vLLM's `structured_outputs`: exactly one of json (a schema object), regex (a string), grammar (EBNF)."""
    given = [k for k, v in extension.items() if v is not None] if isinstance(extension, dict) else None
    if not given or len(given) != 1 or given[0] not in ("json", "regex", "grammar"):
        raise APIError(400, 'structured_outputs: give exactly one of {"json": schema}, {"regex": "..."} or '
                       '{"grammar": "..."}.', param="structured_outputs")
    return structure_value(given[0], extension[given[0]], f"structured_outputs.{given[0]}")


def structure_value(kind: str, value, param: str) -> Structure:
    """json (a schema object or its text), regex or grammar (a non-empty string), choice (a list of strings: one of
    them, exactly) as a Structure; else a 400."""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param}: give a list of non-empty strings, the output being exactly one of them.",
                           param=param)
        escaped = ["".join("\\" + ch if ch in REGEX_SPECIAL else ch for ch in choice) for choice in value]
        return Structure("regex", "(" + "|".join(escaped) + ")")
    if kind == "json":
        if not isinstance(value, (dict, str)) or not value:
            raise APIError(400, f"{param}: give a JSON schema object.", param=param)
        return Structure("json_schema", value if isinstance(value, str) else json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: give a non-empty string.", param=param)
    return Structure(kind, value)
