"""Getting a model ready: `load_model`, `prepare`, and `load_with_assistant`.

Contract: getting a model ready is two explicit steps: loading (`backends.loader.load`, on the chosen backend, its
options parsed once into a `LoadSettings`) and `prepare(model)` (the backend's optimization transforms, then the
policy's cost measurements, kept in the policy's cost book, `policy.costs`); `load_model` runs both, as the CLI, the
server and the bench do; `load_with_assistant` loads a target and its assistant within the target's memory budget.
Bad options raise `ConfigError`, a model that does not load `ModelLoadError` (ValueErrors naming the fix).
"""

from __future__ import annotations

from assistgen.backends.budget import megabytes, resident
from assistgen.backends.embedded import say
from assistgen.backends.loader import LoadSettings, load
from assistgen.config import ConfigError
from assistgen.policy.costs import calibrate


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





def load_with_assistant(model: str, settings: LoadSettings, assistant: str | None = None,
                        assistant_settings: LoadSettings | None = None, fast_linear: bool | str = "auto",
                        calibration: str = "now") -> tuple:
    """(target, assistant or None), each loaded and prepared as `load_model` does. Where the target has a memory
    budget (`settings.max_memory`: its weights offloaded) the assistant is loaded first and stays resident: what it
    added (its anonymous memory and the file pages it maps, measured after its load's passes) is taken from the
    budget, and the target gets the rest; a budget the assistant fills is a ConfigError."""
    if not assistant:
        return load_model(model, fast_linear, calibration=calibration, settings=settings), None
    before = resident()
    drafting = load_model(assistant, fast_linear, calibration=calibration,
                          settings=assistant_settings or LoadSettings())
    if settings.max_memory is not None:
        budget = settings.max_memory
        after = resident()  # (its load ran passes: every weight it reads is resident, in its file's pages or copied)
        kept = max(0, after["anon"] + after["file"] - before["anon"] - before["file"])
        if budget <= kept:
            raise ConfigError(f"--max-memory {megabytes(budget)} leaves nothing for the target: the assistant "
                              f"{assistant} keeps {megabytes(kept)} resident. Give more, or a smaller assistant.")
        settings = settings.with_budget(budget - kept)
        say(f"--max-memory {megabytes(budget)}: the assistant {assistant} keeps {megabytes(kept)} resident; the "
            f"target {model} gets {megabytes(budget - kept)}.")
    return load_model(model, fast_linear, calibration=calibration, settings=settings), drafting
