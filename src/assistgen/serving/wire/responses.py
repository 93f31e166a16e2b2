"""The Responses API's wire format (`POST /v1/responses`): its request body, and a generation's text as the
Responses API's output items, whole or as its stream of events. Nothing here runs a model.

Contract: `ResponsesRequest` is the body: `input` (a string, or a list of message, function_call and
function_call_output items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (as chat's
`response_format`), flat function `tools`, `tool_choice`, `parallel_tool_calls`; `messages()` gives the chat
messages the model's template renders, `chat_tools()` the tools in chat's shape. Fields this server does not do are
in `RESPONSES_REFUSED` (a 400 naming the field unless "off", as on the other endpoints). `Reply` follows one
generation's chunks (text read in its tool-call syntax, `chat.parser.CallParser`, or plain text without tools) and
gives the events OpenAI streams (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, `response.function_call_arguments.delta` and their
`.done` events, then `response.completed`, or `response.incomplete` when the reply ran out of tokens or was
cancelled, or `response.failed`), each with its `sequence_number`; an item the reply ended inside is "incomplete".
The response object they end with (`Reply.response`) is the non-streamed reply, built from the same items, so a
stream and a whole reply agree.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import Field

from assistgen.chat.parser import Arguments, CallParser, CallStart, Content
from assistgen.chat.syntax import CallSyntax
from assistgen.serving.wire.chat import Message, call_dict, message_dicts
from assistgen.serving.wire.common import MAX_MESSAGES, Sampling, new_id
from assistgen.serving.wire.errors import APIError

# --- the request ---------------------------------------------------------------------------------------------

# Fields of POST /v1/responses this server does not do, accepted only at their "off" values (as common.REFUSED,
# which is checked too: penalties, store, service_tier). metadata, user, safety_identifier and prompt_cache_key
# change no reply (prefixes are kept per API key whatever the cache key) and are accepted.
RESPONSES_REFUSED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((None,), "nothing is stored by this server: send the whole conversation as input."),
    "conversation": ((None,), "nothing is stored by this server: send the whole conversation as input."),
    "store": ((None, False), "nothing is stored by this server: leave store false."),
    "background": ((None, False), "background responses are not supported."),
    "reasoning": ((None, {}, {"effort": None}, {"effort": None, "summary": None}),
                  "this model has no reasoning settings."),
    "include": ((None, []), "include lists extra outputs this server does not produce."),
    "prompt": ((None,), "stored prompt templates are not supported: send the input."),
    "truncation": ((None, "disabled"), "truncation must be disabled: a long input is a 400, never cut."),
    "max_tool_calls": ((None,), "max_tool_calls is not supported: use parallel_tool_calls false for one call."),
    "top_logprobs": ((None, 0), "top_logprobs is not supported on /v1/responses: use chat completions."),
    "n": ((None, 1), "the Responses API answers one output per request: send several requests, or use chat "
          "completions' n."),
}


class ResponsesRequest(Sampling):
    """POST /v1/responses: `input` (a string or a list of items: messages, function calls and their outputs),
    `instructions` (a system message first), `max_output_tokens`, `text.format` (as chat's response_format),
    function `tools` (flat: {"type": "function", "name", "parameters"}), `tool_choice`, `parallel_tool_calls`."""

    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, strict=True)
    text: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    store: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    prompt: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    service_tier: Any = None

    def new_tokens(self) -> int | None:
        if self.max_tokens is not None:
            raise APIError(400, "max_tokens: /v1/responses bounds the reply with max_output_tokens.",
                           param="max_tokens")
        return self.max_output_tokens

    def tokens_field(self) -> str:
        return "max_output_tokens"

    def checked_format(self) -> None:
        """text.format (text | json_object | json_schema {name, schema, strict}) read as chat's response_format
        (strict or not, the output follows the schema); anything else is a 400 naming text.format."""
        if self.response_format is not None:
            raise APIError(400, "response_format: /v1/responses takes the output's format as text.format.",
                           param="response_format")
        if self.text is None:
            return
        if not isinstance(self.text, dict):
            raise APIError(400, 'text: give {"format": {"type": "text" | "json_object" | "json_schema"}}.',
                           param="text")
        if self.text.get("verbosity") not in (None, "medium"):
            raise APIError(400, "text.verbosity: this server has no verbosity setting.", param="text.verbosity")
        fmt = self.text.get("format")
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if fmt is None or kind == "text":
            return
        if kind == "json_object":
            self.response_format = {"type": "json_object"}
        elif kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise APIError(400, 'text.format.schema: give the JSON schema as an object, as in {"type": '
                               '"json_schema", "name": "...", "schema": {...}}.', param="text.format.schema")
            self.response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                           "schema": fmt["schema"]}}
        else:
            raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}.",
                           param="text.format.type")

    def text_format(self) -> dict:
        """The output's format as the reply states it."""
        fmt = self.text.get("format") if isinstance(self.text, dict) else None
        return fmt if isinstance(fmt, dict) else {"type": "text"}

    def chat_tools(self) -> list | None:
        """The flat function tools as chat's ({"type": "function", "function": {...}}); other kinds are a 400."""
        if not isinstance(self.tools, list):
            return self.tools
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"tools[{i}]: only function tools are supported here, got {kind!r}.",
                               param=f"tools.{i}")
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def messages(self) -> list[dict]:
        """The input as chat messages: `instructions` first, a function call (or several in a row) as an assistant
        message's tool_calls, a call's output as a tool message."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise APIError(400, "input: give a string or a non-empty list of items.", param="input")
        if len(items) > MAX_MESSAGES:
            raise APIError(400, f"input: at most {MAX_MESSAGES} items, got {len(items)}.", param="input")
        for i, item in enumerate(items):
            out_item = input_message(item, f"input.{i}")
            if "tool_calls" in out_item and out and out[-1]["role"] == "assistant":  # (one turn: its text, calls)
                out[-1].setdefault("tool_calls", []).extend(out_item["tool_calls"])
            else:
                out.append(out_item)
        return message_dicts([Message(**m) for m in out])


def input_message(item, param: str) -> dict:
    """One Responses input item as a chat message dict."""
    if not isinstance(item, dict):
        raise APIError(400, f"{param}: give a message, function_call or function_call_output item.", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                    raise APIError(400, f"{param}.content.{j}: only text parts are supported (input_text, "
                                   "output_text).", param=f"{param}.content.{j}")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"{param}.content: give a string or a list of text parts.", param=f"{param}.content")
        if role not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"{param}.role: {role!r} is not a role; use system, developer, user or assistant.",
                           param=f"{param}.role")
        return {"role": role, "content": content}
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str) or not item["call_id"]:
            raise APIError(400, f"{param}: a function_call item has call_id, name and arguments.", param=param)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
        return {"role": "assistant", "content": None, "tool_calls": [call_dict(call, param)]}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
        if not isinstance(item.get("call_id"), str) or not item["call_id"] or not isinstance(output, str):
            raise APIError(400, f"{param}: a function_call_output item has call_id and output.", param=param)
        return {"role": "tool", "content": output, "tool_call_id": item["call_id"]}
    raise APIError(400, f"{param}.type: {kind!r} items are not supported (message, function_call, "
                   "function_call_output).", param=f"{param}.type")


# --- the reply -----------------------------------------------------------------------------------------------

# the engine's finish reason -> (the response's status, why it is incomplete)
STATUS = {"eos": ("completed", None), "stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
          "context": ("incomplete", "max_output_tokens"), "cancelled": ("cancelled", None),
          "timeout": ("incomplete", "timeout"),
          "error": ("failed", None)}


def responses_usage(usage: dict) -> dict:
    """Chat's usage (prompt/completion tokens) as the Responses API names it (input/output tokens)."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def snapshot(item: dict) -> dict:
    return json.loads(json.dumps(item))  # (an event shows an item as it is now; the item grows afterwards)


class Reply:
    """One generation as a Responses reply: output items built as its text comes (see the module's contract)."""

    def __init__(self, body: ResponsesRequest, model: str, syntax: CallSyntax | None):
        self.body, self.model = body, model
        self.id, self.created = new_id("resp"), int(time.time())
        self.parser = CallParser(syntax) if syntax is not None else None
        self.output: list[dict] = []  # the items so far; `open` (the last) still grows
        self.open: dict | None = None
        self.sequence = 0
        self.status, self.incomplete, self.error = "in_progress", None, None
        self.usage: dict | None = None
        self.metrics: dict | None = None

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def read(self, text: str, finish_reason: str | None = None, usage: dict | None = None,
             metrics: dict | None = None, error: str | None = None) -> list[dict]:
        """The events for one more piece of generated text; `finish_reason` (the engine's) ends the reply."""
        last = finish_reason is not None
        pieces = [Content(text)] if self.parser is None else self.parser.read(text, last)
        events = [e for piece in pieces for e in self.add(piece)]
        if finish_reason is None:
            return events
        self.status, reason = STATUS[finish_reason]
        self.incomplete = {"reason": reason} if reason else None
        self.error = {"code": "server_error", "message": error} if error else None
        self.usage = responses_usage(usage) if usage is not None else None
        self.metrics = metrics
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.status,
                                                                                   "response.incomplete")
        cut = self.parser is not None and self.parser.ended_in_call
        return events + self.close(cut=cut) + [self.event(kind, response=self.response())]

    def add(self, piece) -> list[dict]:
        if isinstance(piece, Content):
            if not piece.text:
                return []
            events = [] if self.open is not None and self.open["type"] == "message" else self.close() + self.begin(
                {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                 "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.open["content"][0]["text"] += piece.text
            return events + [self.event("response.output_text.delta", **self.where(), content_index=0,
                                        delta=piece.text, logprobs=[])]
        if isinstance(piece, CallStart):
            return self.close() + self.begin({"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"),
                                              "name": piece.name, "arguments": "", "status": "in_progress"})
        assert isinstance(piece, Arguments) and self.open is not None and self.open["type"] == "function_call"
        self.open["arguments"] += piece.text
        return [self.event("response.function_call_arguments.delta", **self.where(), delta=piece.text)]

    def begin(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        added = {**snapshot(item), "content": []} if item["type"] == "message" else snapshot(item)  # (as OpenAI:
        # the part comes with content_part.added)
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                     part=snapshot(item["content"][0])))
        return events

    def close(self, cut: bool = False) -> list[dict]:
        """The .done events of the open item (none open: none); `cut`: the reply ended inside it."""
        if self.open is None:
            return []
        item, where = self.open, self.where()
        done = self.status in ("in_progress", "completed") and not cut
        item["status"] = "completed" if done else "incomplete"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=snapshot(part))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        self.open = None
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=snapshot(item))]

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def response(self) -> dict:
        """The response object as it stands (the whole reply once finished)."""
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "error": self.error, "incomplete_details": self.incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model, "output": snapshot(self.output),
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": body.temperature if body.temperature is not None else 0.0,
                "text": {"format": body.text_format()},
                "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
                "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
                "truncation": "disabled", "usage": self.usage, "metadata": body.metadata or {}, "user": body.user,
                "metrics": self.metrics}
