"""What a request passes before any handler runs: its API key, and the size of its body.

Contract: `Gate(app, settings)` is ASGI middleware around the server's app. With `ServerSettings.api_keys`, every
HTTP request but `OPEN_PATHS` (and `/metrics` unless `ServerSettings.metrics_need_key`) must carry one of them as
`Authorization: Bearer KEY`, compared in constant time against every key; otherwise it is answered 401 with OpenAI's
error body (`invalid_api_key`) before its body is read. Paths are the app's own (a reverse proxy's `root_path`
taken off). A body longer than `ServerSettings.max_body` is answered 413 before it is parsed: at once where
`Content-Length` says so (h11 holds a body to it), else (a chunked body) as soon as the bytes received pass the
limit, the body taken in here and handed on whole, so that no request holds more than its limit in memory. A body
taken in is then counted (`json_items`): one holding more JSON items than one per `BYTES_PER_ITEM` of the limit is
answered 400 before it is parsed, so that what parsing and validating a body allocates is bounded by a multiple of
the limit (each parsed item costs tens of bytes; a million empty lists in 4 MiB would cost hundreds of MiB). The
transcription endpoint caps its own upload as it reads it, naming the file (`body_limit`). Without keys, every
request gets in (`openness`: what `serve` says at start). It knows nothing of the handlers.
"""

from __future__ import annotations

import hmac
import json

import numpy as np

from assistgen.serving.app_state import ServerSettings
from assistgen.serving.wire.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe needs no key
TRANSCRIPTIONS = "/v1/audio/transcriptions"
BYTES_PER_ITEM = 16  # a body may hold one JSON item per this many bytes of the limit (4 MiB: 262,144 items)
WINDOW = 1 << 18  # bytes counted at a time (`json_items`)


class Gate:
    """ASGI middleware: the API key, then the body's size (see the module's contract)."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.settings = settings
        self.keys = [key.encode() for key in settings.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # (behind a proxy's prefix: the app's own path, as Starlette routes it)
            path = path[len(root):]
        headers = dict(scope.get("headers") or [])
        if self.keys and self.needs_key(path) and not self.known(headers.get(b"authorization", b"")):
            given = bool(headers.get(b"authorization"))
            message = ("Incorrect API key provided." if given else
                       "You didn't provide an API key: give it as 'Authorization: Bearer KEY' (the openai client's "
                       "api_key).")
            return await answer(send, 401, error_body(message, "invalid_request_error", None, "invalid_api_key"),
                                [(b"www-authenticate", b"Bearer")])
        limit = body_limit(self.settings, path)
        if limit is None:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):  # (h11 holds a body to it)
            return await answer(send, 413, too_large(limit))
        messages, received = [], 0  # the body taken in here, up to the limit, counted, then handed on
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > limit:
                return await answer(send, 413, too_large(limit))
            if not message.get("more_body", False):
                break
        chunks = [m.get("body", b"") for m in messages if m["type"] == "http.request"]
        most = limit // BYTES_PER_ITEM
        if (count := json_items(b"".join(chunks), most)) > most:
            return await answer(send, 400, too_many_items(count, most))

        async def replayed():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replayed, send)

    def needs_key(self, path: str) -> bool:
        return path not in OPEN_PATHS and (path != "/metrics" or self.settings.metrics_need_key)

    def known(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        found = False
        for key in self.keys:  # (every key compared, each in constant time: the answer's timing names none)
            found |= hmac.compare_digest(token, key)
        return found and scheme.lower() == b"bearer"


def body_limit(settings: ServerSettings, path: str) -> int | None:
    """The most bytes a request's body may have on `path` (None: the endpoint caps its own body as it reads it)."""
    return None if path == TRANSCRIPTIONS else settings.max_body


def json_items(body: bytes, most: int) -> int:
    """How many JSON items (values and object members) `body` holds: its commas and opening brackets outside strings,
    plus one (an upper bound on its values). Counted at C speed in a few MiB: in the raw bytes first, an upper bound
    returned when it is within `most`; otherwise again outside strings, window by window."""
    raw = body.count(b",") + body.count(b"[") + body.count(b"{") + 1
    if raw <= most:
        return raw
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # (escapes gone: each quote left opens or closes a string)
    found, inside = 1, False
    for start in range(0, len(text), WINDOW):
        window = np.frombuffer(text, np.uint8, count=min(WINDOW, len(text) - start), offset=start)  # (W,)
        within = np.cumsum(window == ord('"'), dtype=np.int32) & 1 != inside  # (W,) in a string (at a quote: either)
        marks = (window == ord(",")) | (window == ord("[")) | (window == ord("{"))  # (W,)
        found += int(np.count_nonzero(marks & ~within))
        inside = bool(within[-1])
    return found


def too_many_items(count: int, most: int) -> dict:
    return error_body(f"The request body holds {count:,} JSON items (values and members); this server takes at most "
                      f"{most:,} (one per {BYTES_PER_ITEM} bytes of its --max-body): send a shorter list, or text in "
                      "place of a long list.", "invalid_request_error", None, "too_many_items")


def too_large(limit: int) -> dict:
    return error_body(f"The request body is larger than this server takes ({limit:,} bytes): send a shorter one "
                      "(the server's --max-body sets the limit).", "invalid_request_error", None, "body_too_large")


async def answer(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


def openness(settings: ServerSettings, host: str, port: int) -> str:
    """What `serve` says at start of who may use it."""
    if settings.api_keys:
        n = len(settings.api_keys)
        return (f"assistgen: {n} API key{'s' if n > 1 else ''}: requests without one are answered 401 (/health"
                f"{'' if settings.metrics_need_key else ' and /metrics'} open).")
    return (f"assistgen: no API key given (--api-key, --api-key-file, ASSISTGEN_API_KEY): anyone who reaches "
            f"{host}:{port} can use this server.")
