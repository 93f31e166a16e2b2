"""The public API: `load_model`, `prepare`, `generate()` and `stream()`, thin wrappers around the one loop in
`core/engine.py`.

Contract: turns user-facing arguments (model names or objects, a prompt string or token ids, an
assistant, sampling settings) into a target model (`backends.base.LanguageModel`), a drafter, a schedule
and a `GenerationConfig`, checks them, and runs `engine.stream` (a chat prompt rendered by `chat.templates`;
`drafter_factory`: the same drafting options as a server's `DrafterFactory`). Bad input raises `ConfigError` or
`ModelLoadError` (ValueErrors) whose message says what is wrong and how to fix it. Getting a model ready is two
explicit steps: loading (`backends.loader.load`, on the chosen backend) and
`prepare(model)` (the backend's optimization transforms, then the policy's cost measurements, kept in
the policy's cost book, `policy.costs`); `load_model` runs both, as the CLI, the server and the bench do, its options
parsed once into a `LoadSettings`. `generate`, `stream` and a drafter never load a model per call: a name they are
given is resolved once per process and the loaded model reused (`as_model`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from assistgen.backends.base import Computes, LanguageModel
from assistgen.backends.loader import LoadSettings, load
from assistgen.chat.templates import encode_chat
from assistgen.config import Cancelled, ConfigError, GenerationConfig, Structure, check_cancelled
from assistgen.core.engine import stream as run_loop
from assistgen.core.logprobs import TokenLogprob
from assistgen.core.prefix import PrefixCache, check_capacity, default_capacity
from assistgen.core.state import Chunk
from assistgen.drafters.assistant import AssistantDrafter, same_tokenizer
from assistgen.drafters.base import CompositeDrafter, NoDrafter
from assistgen.drafters.early_exit import EarlyExitDrafter
from assistgen.drafters.factory import DrafterFactory
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.drafters.ngram import NGramCache, NGramCacheDrafter, cache_for, shared_cache
from assistgen.drafters.suffix import SuffixDrafter, SuffixHistory, history_for
from assistgen.drafters.universal import UniversalDrafter
from assistgen.policy.adaptive import Adaptive
from assistgen.policy.costs import calibrate
from assistgen.spec.drafts import Drafter
from assistgen.spec.steps import Schedule
from assistgen.stats import Stats


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only
    prompt_ids: list[int]
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # per new token, when asked for (`logprobs=n`)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., when asked for (`prompt_logprobs=n`)


def load_model(spec: str, fast_linear: bool | str = "auto", backend: str = "auto", calibration: str = "now",
               settings: LoadSettings | None = None, **loading):
    """Load `spec` (an embedded alias, a `.gguf` file, a local model folder or a hub id) on `backend` ("auto":
    llama.cpp for a GGUF file on the CPU when it is installed, or a GGUF type as `quantize`; for a folder or hub
    id with quantize int8/int4 the faster of the two here, measured once; else torch: `backends.loader`), with that
    backend's options (torch: `dtype`, `device`, `quantize`; llama.cpp: `context`, `sequences`, `threads`, ...;
    both: `max_memory`, offloaded weights; their defaults are the backend's), parsed once into a `LoadSettings`
    (or that object itself as `settings`), then `prepare` it unless `fast_linear` is False (`calibration`: as
    `prepare` takes it)."""
    if settings is None:
        settings = LoadSettings.parse(backend, **loading)
    elif loading or backend != "auto":
        raise ConfigError("load_model: give the loading options either as keywords or as "
                          "settings=LoadSettings.parse(...), not both.")
    model = load(spec, settings)
    if fast_linear:
        prepare(model, fast_linear, calibration=calibration)
    return model


def prepare(model, fast_linear: bool | str = "auto", refresh: bool = False, calibration: str = "now"):
    """The explicit step after loading: the backend's optimization transforms (attention variant, and on the CPU
    the small-row linear routes, only where they measure faster with "auto"; none with False), then the policy's
    cost curve, measured once per machine (cached on disk) so that no request pays for it: "now", or "later"
    (a server's: a provisional conservative curve from a few passes, the full measurement while it is idle,
    `policy.costs.pending`). Returns the model."""
    if calibration not in ("now", "later"):
        raise ConfigError(f'calibration must be "now" or "later", got {calibration!r}.')
    if fast_linear:
        model.optimize(mode="auto" if fast_linear == "auto" else "on", refresh=refresh)
    calibrate(model, refresh=refresh, later=calibration == "later")
    return model


_NAMED: dict[tuple[str, str], Any] = {}  # (kind, spec) -> the model a name given to generate/stream/... resolved to
_NAMING = threading.Lock()


def resolved_once(kind: str, spec: str, load: Callable[[str], Any]):
    """The model of this kind ("text", "speech") that `spec` names: `load(spec)` on first use in this process, then
    the same model for every later call that names it."""
    with _NAMING:
        key = (kind, spec.strip())
        if key not in _NAMED:
            _NAMED[key] = load(key[1])
        return _NAMED[key]


def as_model(model) -> LanguageModel:
    """A backend model as it is; a name (an alias, a file, a folder or a hub id) is resolved once per process: loaded
    and prepared with the default settings on first use, then the same model for every later call that names it
    (load it with `load_model` to choose its settings, or to free it). A bad name raises `ModelLoadError`."""
    if isinstance(model, Computes):
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ConfigError(f"A model must be a loaded model (assistgen.load_model) or its name, got "
                          f"{type(model).__name__}.")
    return resolved_once("text", model, load_model)


def encode_prompt(model: LanguageModel, prompt: str | list[int], chat: bool = False) -> list[int]:
    """A prompt string (optionally wrapped in the chat template) or token ids -> token ids."""
    if isinstance(prompt, (list, tuple)):
        if chat:
            raise ConfigError("chat=True needs a text prompt, not token ids.")
        if not all(isinstance(t, int) for t in prompt):
            raise ConfigError("A token-id prompt must be a list of integers.")
        return list(prompt)
    if not isinstance(prompt, str):
        raise ConfigError(f"The prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
    if not prompt.strip():
        raise ConfigError("The prompt is empty: give some text to continue.")
    if chat:
        return encode_chat(model, [{"role": "user", "content": prompt}])
    return list(model.tokenizer(prompt)["input_ids"])


def make_drafter(
    target: LanguageModel,
    assistant: LanguageModel | str | Drafter | None = None,
    lookup: bool = False,
    early_exit: bool | int = False,
    ngram_cache: bool | str | NGramCache | None = False,
    suffix: bool | str | SuffixHistory = False,
) -> Drafter:
    """The drafter for these options; several sources compose, cheapest first (suffix, lookup, n-gram cache, a
    model): suffix drafting before prompt lookup, whose match it extends."""
    if assistant is not None and early_exit:
        raise ConfigError("Choose either an assistant model or early exit (self-drafting), not both.")
    drafters: list = []
    if suffix is not None and suffix is not False:
        drafters.append(SuffixDrafter(suffix_history_of(suffix)))
    if lookup:
        drafters.append(PromptLookupDrafter())
    cache = ngram_cache_of(ngram_cache)
    if cache is not None:
        drafters.append(NGramCacheDrafter(cache))
    if early_exit:
        layers = None if early_exit is True else int(early_exit)
        try:
            drafters.append(EarlyExitDrafter(target, layers=layers))
        except ValueError as e:
            raise ConfigError(f"early exit: {e}") from e
    elif assistant is not None:
        drafters.append(model_drafter(target, assistant))
    if not drafters:
        return NoDrafter()
    return drafters[0] if len(drafters) == 1 else CompositeDrafter(drafters)


def drafter_factory(
    target: LanguageModel,
    assistant: LanguageModel | str | Drafter | None = None,
    lookup: bool = False,
    early_exit: bool | int = False,
    ngram_cache: bool | str | NGramCache | None = False,
    suffix: bool | str | SuffixHistory = False,
) -> DrafterFactory:
    """`make_drafter` with these options as a `DrafterFactory` (a server's: a fresh drafter per request, the options
    a request's own changes given as keywords), declaring without making a drafter the models its drafters run
    besides the target (an assistant's) and the shortest context among them (an assistant's; early exit's is the
    target's own, the others have none)."""
    assistant = None if assistant is None else as_assistant(assistant)  # (a name resolved here, once)
    model = assistant.model if isinstance(assistant, Drafter) else assistant
    models = () if early_exit or model is None else (model,)
    context = None if early_exit or assistant is None else assistant.context_length
    return DrafterFactory(partial(make_drafter, target, assistant, lookup, early_exit, ngram_cache=ngram_cache,
                                  suffix=suffix), models, context)


def namespaced(value, option: str, kind: type, of_namespace, when_true, true_means: str):
    """What a namespaced option names: `when_true()` for True, `of_namespace(name)` for a non-empty string (requests
    share state only when they name the same namespace), or an object of `kind` itself."""
    if value is True:
        return when_true()
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"{option}: a namespace must be a non-empty string (e.g. the user's id).")
        return of_namespace(value)
    if isinstance(value, kind):
        return value
    raise ConfigError(f"{option} must be True ({true_means}), a namespace string or a {kind.__name__}, "
                      f"got {type(value).__name__}.")


def suffix_history_of(suffix) -> SuffixHistory | None:
    """The earlier text suffix drafting searches besides the sequence's own (`suffix.history_for`)."""
    return namespaced(suffix, "suffix", SuffixHistory, history_for, lambda: None, "this sequence's own text")


def ngram_cache_of(ngram_cache) -> NGramCache | None:
    """The `NGramCache` that `ngram_cache` names (`ngram.cache_for`); None for False/None."""
    if ngram_cache is None or ngram_cache is False:
        return None
    return namespaced(ngram_cache, "ngram_cache", NGramCache, cache_for, shared_cache, "the process-wide cache")


DRAFTER_PARTS = ("propose", "observe", "finish", "report", "name", "context_length", "model", "acceptance_prior")


def as_assistant(assistant: LanguageModel | str | Drafter) -> LanguageModel | Drafter:
    """A drafter object as it is, or a model (its name resolved: `as_model`); anything else is a ConfigError naming
    what a drafter lacks of its interface."""
    if isinstance(assistant, Drafter):
        return assistant
    if not isinstance(assistant, (Computes, str, os.PathLike)):  # neither a model nor its name: part of a drafter?
        missing = [m for m in DRAFTER_PARTS if m not in dir(assistant)]
        raise ConfigError(f"The drafter {type(assistant).__name__} lacks {', '.join(missing)}: a drafter "
                          "implements propose, name, context_length, model (None without one) and "
                          "acceptance_prior (None without one), and observe, finish and report, which "
                          "subclassing assistgen.Drafter gives it (spec/drafts.py); a model is a loaded model "
                          "(assistgen.load_model) or its name.")
    return as_model(assistant)


def model_drafter(target: LanguageModel, assistant: LanguageModel | str | Drafter) -> Drafter:
    assistant = as_assistant(assistant)
    if isinstance(assistant, Drafter):
        return assistant
    if same_tokenizer(target, assistant):
        return AssistantDrafter(assistant, target)
    return UniversalDrafter(assistant, target)  # different tokenizers: translate through text


def default_schedule() -> Schedule:
    """The cost-aware policy: k (0 included) chosen before every step from measured costs and acceptance."""
    return Adaptive()


def stream(
    model: LanguageModel | str,
    prompt: str | list[int],
    assistant: LanguageModel | str | Drafter | None = None,
    lookup: bool = False,
    schedule=None,
    chat: bool = False,
    early_exit: bool | int = False,
    ngram_cache: bool | str | NGramCache | None = False,
    prefix: PrefixCache | None = None,
    suffix: bool | str | SuffixHistory = False,
    **settings,
) -> Iterator[Chunk]:
    """Stream `Chunk`s (tokens and text per verification step); the last one carries the stats.

    Drafting sources, cheapest first when several are given: `suffix` (the longest earlier match of the sequence's
    tail, continued by what most often followed it: True for the sequence's own text, a namespace string for that
    namespace's earlier requests too, `drafters.suffix`), `lookup` (prompt lookup),
    `ngram_cache` (an n-gram cache that learns across requests: a namespace string, e.g. a user's id, whose
    cache only requests naming the same namespace share (`ngram.cache_for`); True: the process-wide shared
    namespace; or an `NGramCache` object), then one
    model: `assistant` (a model, name or drafter; another tokenizer switches to universal mode) or
    `early_exit` (True, or a layer count: the target's own first layers draft). `schedule` defaults
    to the cost-aware `Adaptive` policy; a schedule (its settings: never changed by a generation, so one
    object can serve many: `Constant(k=4)`, `Heuristic()`, `Adaptive(max_k=...)`).
    `settings` are the fields of `GenerationConfig`:
    max_new_tokens, temperature, top_k, top_p, seed, stop, eos_token_ids, logprobs, prompt_logprobs (each chunk
    then carries its tokens' log-probabilities under the target), structure (a `Structure`: the output follows
    a JSON schema, any JSON object, a regex or a grammar; `json_schema=` is a shortcut taking a schema as a dict
    or JSON text). `prefix`: a `PrefixCache` the generation starts from (its longest kept prefix of the prompt) and
    leaves its cache in (`Session` keeps one).
    """
    if "json_schema" in settings:
        settings["structure"] = json_schema_structure(settings.pop("json_schema"))
    try:
        if isinstance(settings.get("stop"), str):
            settings["stop"] = (settings["stop"],)  # one stop string, not its characters
        config = GenerationConfig(**{k: (tuple(v) if k == "stop" else v) for k, v in settings.items()})
    except TypeError as e:
        allowed = ", ".join(GenerationConfig.__dataclass_fields__)
        raise ConfigError(f"Unknown generation setting: {e}. Allowed: {allowed}.") from e
    target = as_model(model)
    prompt_ids = encode_prompt(target, prompt, chat)
    drafter = make_drafter(target, assistant, lookup, early_exit, ngram_cache, suffix)
    schedule = as_schedule(schedule) if schedule is not None else default_schedule()
    if prefix is not None and prefix.model is not target:
        raise ConfigError("prefix: the PrefixCache belongs to another model than the one generating.")
    yield from run_loop(target, prompt_ids, drafter, schedule, config, prefix)


def json_schema_structure(schema) -> Structure:
    """A JSON schema (a dict, or its JSON text) as the structure the output must follow."""
    if isinstance(schema, dict):
        return Structure("json_schema", json.dumps(schema))
    if isinstance(schema, str) and schema.strip():
        return Structure("json_schema", schema)
    raise ConfigError(f"json_schema must be a JSON schema: a dict or its JSON text, got {type(schema).__name__}.")


def as_schedule(schedule) -> Schedule:
    """A schedule object (settings; each generation gets its own run from `prepare`)."""
    if isinstance(schedule, str):
        raise ConfigError(f"schedule={schedule!r} is the command line's form (--schedule); in Python give a schedule "
                          "object: assistgen.Adaptive(max_k=...), Constant(k=...), Heuristic() or confidence(k, "
                          "threshold) (assistgen.cli.schedule.parse_schedule turns the text into one).")
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule must be a schedule object (assistgen.Adaptive, Constant, Heuristic or "
                          f"confidence(...)), got {type(schedule).__name__}.")
    return schedule


def generate(
    model: LanguageModel | str,
    prompt: str | list[int],
    assistant: LanguageModel | str | Drafter | None = None,
    lookup: bool = False,
    schedule=None,
    chat: bool = False,
    early_exit: bool | int = False,
    ngram_cache: bool | str | NGramCache | None = False,
    prefix: PrefixCache | None = None,
    suffix: bool | str | SuffixHistory = False,
    cancelled: Callable[[], bool] | None = None,
    **settings,
) -> Generation:
    """Generate a continuation of `prompt`; same arguments as `stream`, and `cancelled`: asked after every
    verification step; once it answers True the generation stops there and raises `Cancelled` (a caller gone)."""
    check_cancelled(cancelled)
    target = as_model(model)
    prompt_ids = encode_prompt(target, prompt, chat)
    tokens: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs = None
    last = None
    chunks = stream(target, prompt_ids, assistant, lookup, schedule, False, early_exit, ngram_cache, prefix, suffix,
                    **settings)
    for chunk in chunks:
        if cancelled is not None and cancelled():
            chunks.close()
            raise Cancelled("The generation was cancelled by its caller.")
        tokens.extend(chunk.tokens)
        text.append(chunk.text)
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + chunk.logprobs
        prompt_logprobs = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else prompt_logprobs
        last = chunk
    return Generation("".join(text), tokens, prompt_ids, last.finish_reason, last.stats, logprobs, prompt_logprobs)


class Session:
    """Generations on one model that keep their keys and values between calls: each call feeds only what follows
    the longest prefix of its prompt an earlier call of the session computed (a `PrefixCache` of at most `capacity`
    bytes; None: `prefix.default_capacity`). `generate` and `stream` take `generate`'s arguments; `defaults` are
    given to every call (a call's own arguments win). The output is what the same call gives without the session
    (on llama.cpp, load the model with `exact_prompts=True` for that to hold bit for bit: prompts then run on the
    row-exact kernels, as decoding does)."""

    def __init__(self, model: LanguageModel | str, capacity: int | None = None, **defaults):
        self.model = as_model(model)
        capacity = default_capacity(self.model) if capacity is None else capacity
        check_capacity(self.model, capacity)
        limit = self.model.max_sequences  # (leave sequences for the generation and its forks)
        self.prefix = PrefixCache(self.model, capacity, None if limit is None else max(1, limit // 2))
        self.defaults = defaults

    def stream(self, prompt: str | list[int], **arguments) -> Iterator[Chunk]:
        return stream(self.model, prompt, prefix=self.prefix, **{**self.defaults, **arguments})

    def generate(self, prompt: str | list[int], **arguments) -> Generation:
        return generate(self.model, prompt, prefix=self.prefix, **{**self.defaults, **arguments})


class Conversation:
    """A chat with a model that remembers its turns and their keys and values: `say(text)` adds a user message,
    generates the assistant's reply through the chat template (feeding only the new turn when the template renders
    the earlier turns as before) and adds it. `system` starts the conversation; `defaults` as for `Session`."""

    def __init__(self, model: LanguageModel | str, system: str | None = None, capacity: int | None = None,
                 **defaults):
        self.session = Session(model, capacity, **defaults)
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]

    def say(self, text: str, **arguments) -> Generation:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("say() needs the user's message as non-empty text.")
        messages = [*self.messages, {"role": "user", "content": text}]
        reply = self.session.generate(encode_chat(self.session.model, messages), **arguments)
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]
        return reply
