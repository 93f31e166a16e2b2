"""The OpenAI-compatible wire format: request bodies, error bodies, and turning a body into engine settings.

Contract: pydantic models of the two endpoints' request bodies (`CompletionRequest`, `ChatRequest`). Every
field OpenAI's API defines for them is declared: honoured, or listed in `REFUSED` with the values that mean
"off" (anything else is a 400 naming the field: `refuse_unsupported`), or in `NO_EFFECT` (fields that change
no reply by OpenAI's own definition); unknown extra fields are ignored, as OpenAI's clients send some.
`APIError` is answered with OpenAI's error body `{"error": {"message", "type", "param", "code"}}` by the
handlers `install_error_handlers` puts on an app (a pydantic validation error becomes a 400 naming the field;
anything unexpected a 500 with the same body). `generation_config` turns a checked body into the library's
`GenerationConfig` for one prompt (new tokens bounded by the room the prompt leaves in the context),
`completion_prompts` and `message_dicts` give the prompts (roles checked), with the API's field names in every
message. Nothing here runs a model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from assistgen.chat.tools import Tool
from assistgen.config import MAX_LOGPROBS, ConfigError, GenerationConfig, Structure

FINISH_REASONS = {"length": "length", "context": "length", "eos": "stop", "stop": "stop", "cancelled": "abort"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# Fields OpenAI's API defines that this server does not do: each is accepted only at its "off" values and
# refused with a 400 naming it otherwise (a field accepted and ignored would be a silent wrong answer).
# name -> (the values that mean "off", why it is refused). The README's request-field table lists them.
REFUSED: dict[str, tuple[tuple, str]] = {
    "functions": ((None, []), "functions (deprecated by OpenAI) is not supported: give tools instead."),
    "function_call": ((None, "none"), "function_call (deprecated by OpenAI) is not supported: give tool_choice."),
    "frequency_penalty": ((None, 0, 0.0), "penalties are not supported: leave it at 0."),
    "presence_penalty": ((None, 0, 0.0), "penalties are not supported: leave it at 0."),
    "logit_bias": ((None, {}), "logit_bias is not supported."),
    "best_of": ((None, 1), "best_of must be 1."),
    "suffix": ((None, ""), "suffix (insertion) is not supported."),
    "audio": ((None,), "audio output is not supported."),
    "modalities": ((None, ["text"]), "only the text modality is supported."),
    "prediction": ((None,), "predicted outputs are not supported."),
    "reasoning_effort": ((None,), "this model has no reasoning settings."),
    "web_search_options": ((None,), "web search is not supported."),
    "store": ((None, False), "nothing is stored by this server."),
    "service_tier": ((None, "auto", "default"), "this server has one service tier."),
    # other servers' extensions that change the output (vLLM's sampling parameters): refused, not ignored
    "repetition_penalty": ((None, 1, 1.0), "repetition penalties are not supported: leave it at 1."),
    "min_p": ((None, 0, 0.0), "min_p is not supported: use top_p or top_k."),
    "min_tokens": ((None, 0), "min_tokens is not supported."),
    "ignore_eos": ((None, False), "ignore_eos is not supported."),
    "use_beam_search": ((None, False), "beam search is not supported."),
    "length_penalty": ((None, 1, 1.0), "length_penalty (beam search) is not supported."),
    "guided_choice": ((None,), "guided_choice is not supported: use guided_regex or a json_schema with an enum."),
    "bad_words": ((None, []), "bad_words is not supported."),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported: use completions with echo and logprobs."),
}
# Fields that change nothing in a reply by OpenAI's own definition, accepted as they are.
NO_EFFECT = {"user": "an end-user id for the client's own records", "metadata": "tags for stored replies"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Sampling(BaseModel):
    """Fields both endpoints take; unknown fields (clients send some) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, strict=True)  # None: up to the end of the context (the server's limit)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, strict=True)  # an extension of OpenAI's API
    seed: int | None = Field(None, strict=True, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, strict=True)  # only 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: Any = None  # text | json_object | json_schema (`structure_of` checks it)
    structured_outputs: Any = None  # vLLM's extension: {"json": schema} | {"regex": ...} | {"grammar": ...}
    guided_json: Any = None  # vLLM's older names for the same: a schema, a regex, a grammar
    guided_regex: Any = None
    guided_grammar: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    guided_choice: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    # refused unless "off" (REFUSED): typed loosely so that the 400 names the field, whatever was sent
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def tokens_field(self) -> str:
        """The name of the field that asked for new tokens (errors name it)."""
        return "max_tokens"

    def asked_logprobs(self) -> int | None:
        """How many alternatives to list per emitted token (None: no logprobs)."""
        return None

    def asked_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions with echo)."""
        return None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, strict=True, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def asked_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None
    best_of: Any = None
    suffix: Any = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted: the chat templates have no place for it
    tool_calls: Any = None  # an assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, strict=True)
    metadata: dict[str, str] | None = None
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, strict=True, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None

    def new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                               f"({self.max_completion_tokens}) disagree: give one of them.",
                               param="max_completion_tokens")
            return self.max_completion_tokens
        return self.max_tokens

    def tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def asked_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
            return None
        return self.top_logprobs or 0


def refuse_unsupported(body: Sampling, refused: dict[str, tuple[tuple, str]] = REFUSED) -> None:
    """A 400 naming the first field of `refused` that is set to anything but its "off" values."""
    def same(value, off) -> bool:
        return value == off and isinstance(value, bool) == isinstance(off, bool)

    for name, (off, reason) in refused.items():
        value = getattr(body, name, None)
        if value is not None and not any(same(value, v) for v in off):
            raise APIError(400, f"{name}: {reason}", param=name)


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: the prefix, "_", 24 hex digits (call_..., resp_..., msg_..., fc_...)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as (message, the field it names)."""
    errors = e.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        message, param = validation_message(e)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        return error_response(APIError(500, f"Internal error: {type(e).__name__}: {e}", "server_error"))


def generation_config(body: Sampling, limit: int | None, room: int,
                      calls: Structure | None = None) -> GenerationConfig:
    """The body's GenerationConfig for a prompt that leaves `room` positions of the context: asked-for new tokens
    above `limit` (the server's) or `room` are a 400; none asked for: up to `room`, within `limit`; `calls`:
    the structure its tool calls follow (`chat.grammar.call_structure`), which excludes a response format. (The
    endpoints call `refuse_unsupported` first.)"""
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per prompt), got {body.n}.", param="n")
    asked = body.new_tokens()
    field = body.tokens_field()
    given = {"max_new_tokens": asked, "temperature": body.temperature, "top_p": body.top_p,
             "top_k": body.top_k, "seed": body.seed}
    settings = {k: v for k, v in given.items() if v is not None}
    if body.stop is not None:
        settings["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    structure = structure_of(body)
    if calls is not None and structure is not None:
        raise APIError(400, "tools and a response format both constrain the output: give one, or tool_choice "
                       '"none".', param="tool_choice")
    settings.update(logprobs=body.asked_logprobs(), prompt_logprobs=body.asked_prompt_logprobs(),
                    structure=structure or calls)
    config = GenerationConfig(**settings)
    if asked is None:  # (as OpenAI and vLLM: up to the end of the context, within the server's limit)
        bound = min(room, limit) if limit is not None else room
        config = GenerationConfig(**{**settings, "max_new_tokens": max(1, bound)})
    elif isinstance(asked, int) and asked > 0:
        if limit is not None and asked > limit:
            raise APIError(400, f"{field} is {asked}, above this server's limit {limit}.", param=field)
        if asked > room:
            raise APIError(400, f"{field} is {asked}, but the prompt leaves room for {room} new tokens in the "
                           f"model's context: ask for at most {room}, or give a shorter prompt.", param=field)
    try:
        return config.validate()
    except ConfigError as e:
        message = str(e).replace("max_new_tokens", field)  # GenerationConfig's name -> the API's
        param = next((f for f in type(body).model_fields if message.startswith(f)), None)
        raise APIError(400, message, param=param) from e


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}  # vLLM's older names


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
    """json (a schema object or its text), regex or grammar (a non-empty string) as a Structure; else a 400."""
    if kind == "json":
        if not isinstance(value, (dict, str)) or not value:
            raise APIError(400, f"{param}: give a JSON schema object.", param=param)
        return Structure("json_schema", value if isinstance(value, str) else json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: give a non-empty string.", param=param)
    return Structure(kind, value)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a list of either (one choice each)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: give a prompt (a string, token ids, or a list of them), not an empty list.",
                       param="prompt")
    return list(prompt)


def message_dicts(messages: list[Message]) -> list[dict]:
    """{"role", "content"} dicts for the chat template (an assistant's with its "tool_calls", their arguments
    parsed; a tool message's with its "tool_call_id"); an unknown role, a function_call, or malformed calls are a
    400 naming the message."""
    def content(m: Message) -> str:
        if isinstance(m.content, list):
            return "".join(part.text for part in m.content)
        return m.content or ""

    out = []
    for i, m in enumerate(messages):
        if m.role == "function" or m.function_call is not None:
            raise APIError(400, f"messages[{i}]: function messages and function_call (deprecated by OpenAI) are not "
                           "supported: use tool_calls and tool messages.", param=f"messages.{i}")
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role: {m.role!r} is not a role; use one of "
                           f"{', '.join(ROLES)}.", param=f"messages.{i}.role")
        message = {"role": ROLES[m.role], "content": content(m)}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls: only an assistant message makes calls.",
                               param=f"messages.{i}.tool_calls")
            if not isinstance(m.tool_calls, list):
                raise APIError(400, f"messages[{i}].tool_calls: give a list of calls.",
                               param=f"messages.{i}.tool_calls")
            message["tool_calls"] = [call_dict(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(400, f"messages[{i}].tool_call_id: a tool message names the call it answers.",
                               param=f"messages.{i}.tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def call_dict(call, param: str) -> dict:
    """An OpenAI tool call as chat templates take it: {"id", "type", "function": {"name", "arguments": object}}."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f'{param}: give {{"id": ..., "type": "function", "function": {{"name": ..., '
                       f'"arguments": "<JSON text>"}}}}.', param=param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param}.function.arguments: not JSON ({e.msg} at character {e.pos}).",
                           param=f"{param}.function.arguments") from e
    if not isinstance(arguments, dict):
        raise APIError(400, f"{param}.function.arguments: the arguments are a JSON object.",
                       param=f"{param}.function.arguments")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}  # (arguments parsed: what templates take)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask for."""

    tools: list[Tool]
    specs: list[dict]  # the tools as OpenAI gives them (what the chat template renders)
    choice: str  # "auto" | "required" | "none" | a tool's name
    parallel: bool


def tool_plan(tools, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """The checked tool fields (None: no tools); a malformed one is a 400 naming it."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls: give true or false.", param="parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools: give the tools it chooses from.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: give a list of function tools.", param="tools")
    checked = []
    for i, spec in enumerate(tools):
        try:
            checked.append(Tool.of(spec, f"tools[{i}]"))
        except ConfigError as e:
            raise APIError(400, str(e), param=f"tools.{i}") from e
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name.", param="tools")
    return ToolPlan(checked, tools, tool_choice_name(tool_choice, names), parallel_tool_calls is not False)


def tool_choice_name(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "required", "none"):
        return choice
    named = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else choice.get("name")
    if not isinstance(named, str):
        raise APIError(400, 'tool_choice: give "auto", "none", "required" or {"type": "function", "function": '
                       '{"name": ...}}.', param="tool_choice")
    if named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)}).",
                       param="tool_choice")
    return named
