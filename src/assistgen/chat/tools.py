"""One OpenAI function tool, checked: `Tool.of(spec, where)` reads {"type": "function", "function": {"name",
"description", "parameters"}} into a `Tool` (its name by OpenAI's rule, its parameters a JSON schema of type object,
none: no arguments), or raises ConfigError naming `where` and the fix. Nothing here compiles a schema
(`chat.grammar`) or knows a template's syntax (`chat.syntax`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from assistgen.config import ConfigError

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str = ""

    @classmethod
    def of(cls, spec, where: str) -> Tool:
        """An OpenAI function tool {"type": "function", "function": {"name", "description", "parameters"}}."""
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(spec.get("function"), dict):
            raise ConfigError(f'{where}: give a function tool, {{"type": "function", "function": {{"name": ..., '
                              f'"parameters": {{...}}}}}}.')
        function = spec["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(f"{where}.function.name: a function name is 1-64 letters, digits, _ or -, got "
                              f"{name!r}.")
        parameters = function.get("parameters")
        if not parameters:  # (None or {}: no arguments)
            parameters = dict(EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ConfigError(f'{where}.function.parameters: give a JSON schema of type "object" (the arguments '
                              f"are a JSON object), got {json.dumps(parameters)[:80]}.")
        parameters = {**parameters, "type": "object"}  # (the arguments are an object, whatever else it allows)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ConfigError(f"{where}.function.description: give a string.")
        return cls(name, parameters, description)
