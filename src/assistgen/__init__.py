"""assistgen: exact assisted (speculative) generation for Hugging Face causal language models."""

from assistgen.api import Generation, generate, stream
from assistgen.config import ConfigError, GenerationConfig
from assistgen.drafters import (
    AssistantDrafter,
    CompositeDrafter,
    Draft,
    Drafter,
    NoDrafter,
    PromptLookupDrafter,
    TokenizerMismatchError,
)
from assistgen.early_exit import EarlyExitDrafter
from assistgen.models import Model, ModelLoadError, load_model
from assistgen.ngram import NGramCache, NGramCacheDrafter
from assistgen.schedules import Adaptive, Constant, Heuristic, confidence
from assistgen.stats import Stats
from assistgen.universal import UniversalDrafter

__all__ = [
    "Adaptive", "AssistantDrafter", "CompositeDrafter", "ConfigError", "Constant", "Draft", "Drafter",
    "EarlyExitDrafter", "Generation", "GenerationConfig", "Heuristic", "Model", "ModelLoadError", "NGramCache",
    "NGramCacheDrafter", "NoDrafter", "PromptLookupDrafter", "Stats", "TokenizerMismatchError", "UniversalDrafter",
    "confidence", "generate", "load_model", "stream",
]
