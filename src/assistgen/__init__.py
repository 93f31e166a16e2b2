"""assistgen: exact assisted (speculative) generation for causal language models, behind one backend seam."""

from assistgen.api import Conversation, Generation, Session, generate, load_model, prepare, stream
from assistgen.backends.embedded import ModelLoadError
from assistgen.backends.settings import LoadSettings
from assistgen.backends.torch.model import Model
from assistgen.config import Cancelled, ConfigError, GenerationConfig, Structure
from assistgen.core.prefix import PrefixCache
from assistgen.drafters.assistant import AssistantDrafter, TokenizerMismatchError
from assistgen.drafters.base import CompositeDrafter, NoDrafter
from assistgen.drafters.early_exit import EarlyExitDrafter
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.drafters.ngram import NGramCache, NGramCacheDrafter
from assistgen.drafters.universal import UniversalDrafter
from assistgen.policy.adaptive import Adaptive
from assistgen.policy.rules import Constant, Heuristic, confidence
from assistgen.spec.drafts import Draft, Drafter
from assistgen.speech.audio import AudioError
from assistgen.speech.results import Transcription
from assistgen.speech.transcribe import load_speech_model, transcribe
from assistgen.stats import Stats

__all__ = [
    "Adaptive", "AssistantDrafter", "AudioError", "Cancelled", "CompositeDrafter", "ConfigError", "Constant",
    "Conversation", "Draft", "Drafter",
    "EarlyExitDrafter", "Generation", "GenerationConfig", "Heuristic", "LoadSettings", "Model", "ModelLoadError",
    "NGramCache", "NGramCacheDrafter", "NoDrafter", "PrefixCache", "PromptLookupDrafter", "Session", "Stats",
    "Structure", "TokenizerMismatchError", "Transcription", "UniversalDrafter", "confidence", "generate", "load_model",
    "load_speech_model", "prepare", "stream", "transcribe",
]
