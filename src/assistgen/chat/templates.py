"""A model's chat template: read, put in place, and rendered into a prompt.

Contract: `read_chat_template(template)` is a template's text from a Jinja file's path or the text itself, checked
to parse (ConfigError otherwise); `use_chat_template(model, template)` is the explicit step that replaces a model's
template; `encode_chat(model, messages, tools)` renders chat messages (and OpenAI tools, where the template renders
them: `chat.syntax.call_syntax`) into token ids with the prompt for the assistant's turn, a refusal by the template
being a ConfigError; `template_prefix(model, messages, ids)` is how many of those ids' first tokens the template
renders alone, from no content of the request (a default system prompt, the first role's header): tokens any
request may share, found by rendering that opening once per template and first role (`template_opening`), so that a
request renders its template once. Nothing here generates.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from assistgen.backends.base import LanguageModel, shared_prefix
from assistgen.chat.syntax import call_syntax
from assistgen.config import ConfigError


def use_chat_template(model, template: str):
    """The explicit step that replaces the model's chat template (`read_chat_template`). Returns the model."""
    model.tokenizer.chat_template = read_chat_template(template)
    return model


def read_chat_template(template: str) -> str:
    """A chat template's text from a Jinja file's path or the template itself (as transformers' `chat_template`);
    a missing file or a template that does not parse is a ConfigError."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(template, str) or not template.strip():
        raise ConfigError("chat template: give a Jinja file's path or the template's text.")
    looks_like_text = "{%" in template or "{{" in template
    if not looks_like_text:
        path = Path(template).expanduser()
        if not path.is_file():
            raise ConfigError(f"chat template: {template} is not a file (give a Jinja file's path or the template's "
                              "text).")
        template = path.read_text()
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ConfigError(f"chat template: line {e.lineno}: {e.message}. Fix the template.") from e
    return template


def encode_chat(model: LanguageModel, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Chat messages ({"role", "content"} dicts; an assistant's may carry "tool_calls", a "tool" message answers
    one) -> token ids through the model's chat template, with the prompt for the assistant's turn appended; `tools`
    (OpenAI function tools) are rendered by the template too. A model without a template, a template that renders
    no tools when tools are given, or messages its template refuses, raise `ConfigError`."""
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{model.name} has no chat template: drop chat=True / --chat.")
    if tools and call_syntax(tok) is None:
        raise ConfigError(f"The chat template of {model.name} renders no tools: serve a model whose template does "
                          "(e.g. qwen2.5-coder-1.5b), or give a template with tools (--chat-template).")
    try:
        ids = tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"The chat template of {model.name} refused the messages: {e}") from e
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def template_prefix(model: LanguageModel, messages: list[dict], ids: list[int]) -> int:
    """How many leading tokens of `ids` (`encode_chat(model, messages)`) the template renders from nothing the request
    holds: the template's opening for the first message's role (what it renders before that message's content,
    whatever the content: the tokens two renderings of one such message, with different contents and no tools,
    share; e.g. a default system prompt and the user's header), as far as `ids` begins with it. 0 where the template
    refuses such a message."""
    if not messages or not isinstance(messages[0], dict):
        return 0
    opening = template_opening(model, messages[0].get("role", "user"))
    return shared_prefix(opening, ids)


_OPENINGS: dict[tuple, list[int]] = {}  # (tokenizer, its template, a role) -> the opening's tokens


def template_opening(model: LanguageModel, role: str) -> list[int]:
    """The tokens the model's chat template renders before a first message of `role`, whatever its content (what two
    renderings with different contents share; [] where the template refuses such a message): rendered once per
    template and role, then kept."""
    tok = model.tokenizer
    key = (id(tok), getattr(tok, "name_or_path", ""), len(tok), getattr(tok, "chat_template", None), str(role))
    if key not in _OPENINGS:
        try:
            blank, other = (encode_chat(model, [{"role": role, "content": text}]) for text in ("", "A"))
            _OPENINGS[key] = blank[: shared_prefix(blank, other)]
        except ConfigError:
            _OPENINGS[key] = []
        if len(_OPENINGS) > 256:  # (a bound: roles are few, but a client may send any string as one)
            _OPENINGS.pop(next(iter(_OPENINGS)))
    return _OPENINGS[key]
