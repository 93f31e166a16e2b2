"""The public API: `load_model`, `prepare`, `generate()` and `stream()`, sessions and conversations: thin wrappers
around the one loop in `core/engine.py`.

Contract: user-facing arguments (model names or objects, a prompt string or token ids, an assistant, sampling
settings) become a target model (`backends.base.LanguageModel`), a drafter, a schedule and a `GenerationConfig`,
checked before anything runs; bad input raises `ConfigError` or `ModelLoadError` (ValueErrors) whose message says
what is wrong and how to fix it. One idea per module: getting a model ready (`loading`: load, then `prepare`), names
resolved once per process (`names`), what the arguments mean (`arguments`), drafter assembly (`drafting`, a server's
`DrafterFactory` included), the generation itself (`generation`) and sessions (`sessions`). `generate`, `stream` and
a drafter never load a model per call.
"""

from assistgen.api.arguments import (
    as_schedule,
    default_schedule,
    encode_prompt,
    generation_config,
    json_schema_structure,
)
from assistgen.api.drafting import (
    as_assistant,
    drafter_factory,
    make_drafter,
    model_drafter,
    ngram_cache_of,
    suffix_history_of,
)
from assistgen.api.generation import Generation, generate, stream
from assistgen.api.loading import load_model, prepare
from assistgen.api.names import as_model, resolved_once
from assistgen.api.sessions import Conversation, Session

__all__ = ["Conversation", "Generation", "Session", "as_assistant", "as_model", "as_schedule", "default_schedule",
           "drafter_factory", "encode_prompt", "generate", "generation_config", "json_schema_structure",
           "load_model", "make_drafter", "model_drafter", "ngram_cache_of", "prepare", "resolved_once", "stream",
           "suffix_history_of"]
