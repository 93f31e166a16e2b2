"""The OpenAI-compatible wire format: request bodies, error bodies, and turning a body into engine settings.

Contract: pydantic models of the two endpoints' request bodies (`CompletionRequest`, `ChatRequest`; unknown
fields are ignored, as OpenAI's clients send some); `APIError`, answered with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` by the handlers `install_error_handlers` puts on an app
(a pydantic validation error becomes a 400 naming the field; anything unexpected a 500 with the same
body); `generation_config` and the prompt helpers turn a checked body into the library's
`GenerationConfig` and prompt, with the API's field names in every message. Nothing here runs a model.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from assistgen.config import ConfigError, GenerationConfig

FINISH_REASONS = {"length": "length", "context": "length", "eos": "stop", "stop": "stop", "cancelled": "abort"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints take; unknown fields (clients send some) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, strict=True)  # None: GenerationConfig's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, strict=True)  # an extension of OpenAI's API
    seed: int | None = Field(None, strict=True, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, strict=True)  # only 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


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


def generation_config(body: Sampling, limit: int | None) -> GenerationConfig:
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}.", param="n")
    given = {"max_new_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
             "top_k": body.top_k, "seed": body.seed}
    settings = {k: v for k, v in given.items() if v is not None}
    if body.stop is not None:
        settings["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    config = GenerationConfig(**settings)
    if limit is not None and config.max_new_tokens > limit:
        if body.max_tokens is not None:
            raise APIError(400, f"max_tokens is {body.max_tokens}, above this server's limit {limit}.",
                           param="max_tokens")
        config = GenerationConfig(**{**settings, "max_new_tokens": limit})
    try:
        return config.validate()
    except ConfigError as e:
        message = str(e).replace("max_new_tokens", "max_tokens")  # GenerationConfig's name -> the API's
        param = next((f for f in Sampling.model_fields if message.startswith(f)), None)
        raise APIError(400, message, param=param) from e


def completion_prompt(prompt: str | list[str] | list[int]) -> str | list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: give one prompt per request, got {len(prompt)}.", param="prompt")
        return prompt[0]
    return prompt


def message_dicts(messages: list[Message]) -> list[dict]:
    def content(m: Message) -> str:
        if isinstance(m.content, list):
            return "".join(part.text for part in m.content)
        return m.content or ""

    return [{"role": m.role, "content": content(m)} for m in messages]
