"""POST /v1/chat/completions: its body, its messages as chat templates take them, its choices' log-probabilities.

Contract: `ChatRequest` is the body (messages, `max_completion_tokens`, `logprobs` and `top_logprobs`, the tool fields
checked by `wire.tools`, the fields refused unless "off"); `message_dicts` gives the messages as {"role", "content"}
dicts with the API's field names (roles checked; an assistant's calls with their arguments parsed, `call_dict`; a
tool message's `tool_call_id`), a malformed message being a 400 naming it; `chat_logprobs` is a choice's `logprobs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from assistgen.config import MAX_LOGPROBS
from assistgen.core.logprobs import TokenLogprob
from assistgen.serving.wire.common import FAIL_FAST, MAX_MESSAGES, Sampling, token_text
from assistgen.serving.wire.errors import APIError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = None  # accepted: the chat templates have no place for it
    tool_calls: Any = None  # an assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None


class Predicted(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat in large part (drafted from, never
    changing the answer)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["content"]
    content: str | Annotated[list[TextPart], FAIL_FAST]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
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
    prediction: Predicted | None = None
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


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}
