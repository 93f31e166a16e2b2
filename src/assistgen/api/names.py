"""Models named by a string: resolved once per process.

Contract: `as_model(x)` is a loaded model as it is, or the model a name (an embedded alias, a `.gguf` file, a folder,
a hub id) resolves to: loaded and prepared with the default settings on its first use in this process, the same
object for every later call naming it (`resolved_once`, which speech's names share under their own kind). A value
that is neither raises `ConfigError`, a name that does not load `ModelLoadError`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from assistgen.api.loading import load_model
from assistgen.backends.base import Computes, LanguageModel
from assistgen.config import ConfigError

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



