"""Drafter assembly: which drafter a set of drafting options (and a request's own changes to them) makes.

Contract: `make_drafter(target, ...)` composes the drafting sources asked for, cheapest first (a request's predicted
output, suffix, prompt lookup, the n-gram cache, one model: an assistant or early exit) into one drafter, or
`NoDrafter`; `drafter_factory` is the
same options as a server's `DrafterFactory`, declaring the models and context length its drafters need without
making one; `model_drafter` is the drafter of an assistant model (same tokenizer: token ids; another: universal
mode through text), which speech's assistants use too. Namespaced options (`suffix`, `ngram_cache`) name shared
state by a string. Options that do not go together, or a drafter object lacking part of the interface, raise
`ConfigError`.
"""

from __future__ import annotations

import os
from functools import partial

from assistgen.api.names import as_model
from assistgen.backends.base import Computes, LanguageModel
from assistgen.config import ConfigError
from assistgen.drafters.assistant import AssistantDrafter, same_tokenizer
from assistgen.drafters.base import CompositeDrafter, NoDrafter
from assistgen.drafters.early_exit import EarlyExitDrafter
from assistgen.drafters.factory import DrafterFactory
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.drafters.ngram import NGramCache, NGramCacheDrafter, cache_for, shared_cache
from assistgen.drafters.prediction import Prediction, PredictionDrafter
from assistgen.drafters.suffix import SuffixDrafter, SuffixHistory, history_for
from assistgen.drafters.universal import UniversalDrafter
from assistgen.spec.drafts import Drafter


def make_drafter(
    target: LanguageModel,
    assistant: LanguageModel | str | Drafter | None = None,
    lookup: bool = False,
    early_exit: bool | int = False,
    ngram_cache: bool | str | NGramCache | None = False,
    suffix: bool | str | SuffixHistory = False,
    prediction: Prediction | None = None,
) -> Drafter:
    """The drafter for these options; several sources compose, cheapest first (the predicted output, suffix, lookup,
    n-gram cache, a model): the caller's own prediction first, suffix drafting before prompt lookup, whose match it
    extends."""
    if assistant is not None and early_exit:
        raise ConfigError("Choose either an assistant model or early exit (self-drafting), not both.")
    drafters: list = []
    if prediction is not None and prediction.tokens:
        drafters.append(PredictionDrafter(prediction))
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



def model_drafter(target: LanguageModel, assistant: LanguageModel | str | Drafter,
                  prefix: list[int] | None = None) -> Drafter:
    """The drafter of an assistant model (a drafter object as it is): with the target's tokenizer it drafts token
    ids; with another, universal mode translates through text, the assistant starting from `prefix` (its own first
    tokens, `UniversalDrafter`) where given."""
    assistant = as_assistant(assistant)
    if isinstance(assistant, Drafter):
        return assistant
    if same_tokenizer(target, assistant):
        return AssistantDrafter(assistant, target)
    return UniversalDrafter(assistant, target, prefix=prefix)  # different tokenizers: translate through text



