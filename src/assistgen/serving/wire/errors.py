"""OpenAI's error body for every endpoint.

Contract: `APIError` is answered with OpenAI's error body `{"error": {"message", "type", "param", "code"}}` by the
handlers `install_error_handlers` puts on an app (a pydantic validation error becomes a 400 naming the field; an
HTTP error keeps its status; anything unexpected a 500 with the same body); `error_body` is that body, for a
stream's error event.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


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
