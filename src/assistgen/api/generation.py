"""`generate()` and `stream()`: a prompt through the one loop in `core/engine.py`.

Contract: the user-facing arguments (a model or its name, a prompt string or token ids, drafting options, a schedule,
the fields of `GenerationConfig` as keywords) become a target model, a drafter (`api.drafting`), a schedule and a
config (`api.arguments`), checked before anything runs, and `engine.stream` runs them: `stream` yields its chunks,
`generate` gathers them into a `Generation`. Bad input raises `ConfigError` or `ModelLoadError` naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from assistgen.api.arguments import as_schedule, default_schedule, encode_prompt, generation_config, predicted
from assistgen.api.drafting import make_drafter
from assistgen.api.names import as_model
from assistgen.backends.base import LanguageModel
from assistgen.config import Cancelled, ConfigError, check_cancelled
from assistgen.core.engine import stream as run_loop
from assistgen.core.logprobs import TokenLogprob
from assistgen.core.prefix import PrefixCache
from assistgen.core.state import Chunk
from assistgen.drafters.ngram import NGramCache
from assistgen.drafters.suffix import SuffixHistory
from assistgen.spec.drafts import Drafter
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
    prediction: str | list[int] | None = None,
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
    `early_exit` (True, or a layer count: the target's own first layers draft). `prediction`: text (or token ids)
    the output is expected to repeat in large part (OpenAI's Predicted Outputs, e.g. the file being edited): drafted
    from first, where the output lines up with it (`drafters.prediction`); the output is the same without it.
    `schedule` defaults
    to the cost-aware `Adaptive` policy; a schedule (its settings: never changed by a generation, so one
    object can serve many: `Constant(k=4)`, `Heuristic()`, `Adaptive(max_k=...)`).
    `settings` are the fields of `GenerationConfig`:
    max_new_tokens, temperature, top_k, top_p, seed, stop, eos_token_ids, logprobs, prompt_logprobs (each chunk
    then carries its tokens' log-probabilities under the target), structure (a `Structure`: the output follows
    a JSON schema, any JSON object, a regex or a grammar; `json_schema=` is a shortcut taking a schema as a dict
    or JSON text). `prefix`: a `PrefixCache` the generation starts from (its longest kept prefix of the prompt) and
    leaves its cache in (`Session` keeps one).
    """
    config = generation_config(settings)
    target = as_model(model)
    prompt_ids = encode_prompt(target, prompt, chat)
    drafter = make_drafter(target, assistant, lookup, early_exit, ngram_cache, suffix,
                           predicted(target, prediction, len(prompt_ids)))
    schedule = as_schedule(schedule) if schedule is not None else default_schedule()
    if prefix is not None and prefix.model is not target:
        raise ConfigError("prefix: the PrefixCache belongs to another model than the one generating.")
    yield from run_loop(target, prompt_ids, drafter, schedule, config, prefix)



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
    prediction: str | list[int] | None = None,
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
                    prediction, **settings)
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



