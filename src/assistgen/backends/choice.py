"""Which backend runs a hub-format model's quantized weights faster on this CPU, decided by measuring both.

Contract: a transformers folder or hub id asked with `quantize="int8"|"int4"` and `backend="auto"` on the CPU
(llama.cpp installed, no option only one backend takes) is a *measured case* (`is_measured_case`). For it,
`measured_backend(spec, settings, load)` returns "torch" or "llama.cpp": the choice recorded for this model
(the folder's fingerprint), scheme, processor and thread count, or, where none is, both candidates loaded and
timed through the seam (`measure.step_times`: one decode pass and one verification of `VERIFY_ROWS - 1` drafts
after the same random context, best of rounds): the torch backend's own int8/int4 weights, optimized as
`api.prepare` would, against llama.cpp's nearest GGUF type (`TWINS`: q8_0 for int8, q4_0 for int4; converted on
first use and cached). The faster one-token decode wins; the record (both figures, the date, the reason) is kept
under `$ASSISTGEN_CACHE/choices/`, and `recorded()` lists every record for `assistgen info`. The two candidates
are the same model at the same bit width with their own rounding, so their outputs may differ from each other;
each is exact against its own plain decoding. `backend="torch"` or `"llama.cpp"` skips the measurement.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from assistgen.backends.machine import cpu_name, usable_cores
from assistgen.backends.settings import LoadSettings
from assistgen.paths import cache_root, measurement_file, recalled, remember

TWINS = {"int8": "q8_0", "int4": "q4_0"}  # torch's scheme -> llama.cpp's GGUF type of the same width
VERIFY_ROWS = 5  # one verification pass of four drafts, priced beside the decode pass
CONTEXT = 64  # tokens fed before timing


def is_measured_case(spec: str, settings, llama_available: bool) -> bool:
    """A hub-format spec (not a GGUF file) asked with a torch scheme that llama.cpp has a twin for, on the CPU, with
    no option only the torch backend takes (dtype, a GPU); `settings`: a `LoadSettings`."""
    quantize = settings.quantize
    return (llama_available and isinstance(quantize, str) and quantize.lower() in TWINS
            and settings.dtype is None and settings.on_cpu() and not is_gguf_spec(spec) and is_hub_format(spec))


def is_gguf_spec(spec: str) -> bool:
    from assistgen.backends.embedded import EMBEDDED

    return spec.strip() in EMBEDDED or spec.strip().endswith(".gguf")


def is_hub_format(spec: str) -> bool:
    path = Path(spec).expanduser()
    return (path / "config.json").is_file() if path.is_dir() else (not path.exists() and spec.count("/") == 1)


def record_path(spec: str, quantize: str) -> Path:
    from assistgen.backends.llamacpp.convert import fingerprint, source_folder

    folder = source_folder(spec)
    machine = hashlib.sha256(f"{cpu_name()}|{usable_cores()}".encode()).hexdigest()[:8]
    key = f"{folder.name if Path(spec).expanduser().is_dir() else spec}-{quantize.lower()}"
    return measurement_file("choices", key, f"{fingerprint(folder)}-{machine}")


def measured_backend(spec: str, settings, load: Callable) -> str:
    """The faster backend for `spec` at `settings.quantize` on this machine: recorded, else measured now and
    recorded; `load(spec, settings)` loads a candidate (`loader.load`, given so that this module needs no loader)."""
    path = record_path(spec, settings.quantize)
    record = recalled(path, ("backend", "seconds"))
    if record is None:
        record = measure(spec, settings, load)
        remember(path, record)
    return record["backend"]


def measure(spec: str, settings, load: Callable) -> dict:
    """Both candidates loaded in turn and timed (the budget kept, if any); the record of the comparison."""
    from assistgen.backends.embedded import say

    quantize = settings.quantize.lower()

    say(f"First use of {spec} with quantize={quantize} and backend auto: timing the torch backend's {quantize} "
        f"weights against llama.cpp's {TWINS[quantize]} on this CPU (once; the choice is kept in "
        f"{cache_root() / 'choices'}).")
    seconds = {backend: timed(load, spec, LoadSettings.parse(backend, quantize=twin, max_memory=settings.max_memory))
               for backend, twin in (("torch", quantize), ("llama.cpp", TWINS[quantize]))}
    backend = min(seconds, key=lambda b: seconds[b][0])
    other = "torch" if backend == "llama.cpp" else "llama.cpp"
    speedup = seconds[other][0] / seconds[backend][0]
    reason = (f"{backend} decodes {speedup:.2f}x faster than {other} here ({quantize} on torch, {TWINS[quantize]} on "
              f"llama.cpp: {1 / seconds['torch'][0]:.1f} vs {1 / seconds['llama.cpp'][0]:.1f} tok/s one token at a "
              f"time)")
    say(f"{spec}: {reason}.")
    return {"spec": spec, "quantize": quantize, "twin": TWINS[quantize], "backend": backend, "reason": reason,
            "seconds": seconds, "rows": [1, VERIFY_ROWS], "cpu": cpu_name(), "threads": usable_cores(),
            "measured": datetime.datetime.now().isoformat(timespec="seconds")}


def timed(load: Callable, spec: str, settings) -> list[float]:
    """Seconds of one pass over 1 and over VERIFY_ROWS new tokens of `spec` loaded with `settings`, optimized as
    served."""
    from assistgen.backends.measure import step_times

    model = load(spec, settings)
    model.optimize()
    seconds = step_times(model, context=CONTEXT, rows=[1, VERIFY_ROWS])
    del model
    gc.collect()
    return seconds


def recorded() -> list[dict]:
    """Every recorded choice on disk (for `assistgen info`): spec, quantize, backend, reason, measured."""
    out = []
    for path in sorted((cache_root() / "choices").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out.append({k: record.get(k) for k in ("spec", "quantize", "backend", "reason", "measured", "cpu",
                                               "threads")} | {"path": str(path)})
    return out
