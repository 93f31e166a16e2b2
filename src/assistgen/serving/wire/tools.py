"""The tool fields of chat and responses: `tools`, `tool_choice` and `parallel_tool_calls`.

Contract: `tool_plan` checks them into a `ToolPlan` (each tool by `chat.tools.Tool.of`; the choice "auto",
"required", "none" or a name; None: no tools), a malformed field being a 400 naming it. The grammar the calls
then follow is `chat.grammar`'s, which is also the one place a named choice is checked against the tools
(`ToolChoiceError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from assistgen.chat.tools import Tool
from assistgen.config import ConfigError
from assistgen.serving.wire.common import MAX_TOOLS
from assistgen.serving.wire.errors import APIError


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
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: at most {MAX_TOOLS} tools, got {len(tools)}.", param="tools")
    checked = []
    for i, spec in enumerate(tools):
        try:
            checked.append(Tool.of(spec, f"tools[{i}]"))
        except ConfigError as e:
            raise APIError(400, str(e), param=f"tools.{i}") from e
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name.", param="tools")
    return ToolPlan(checked, tools, tool_choice_name(tool_choice), parallel_tool_calls is not False)


def tool_choice_name(choice) -> str:
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
    return named  # (whether it is among the tools: `chat.grammar.call_structure`, `ToolChoiceError`)
