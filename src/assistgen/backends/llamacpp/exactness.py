"""Whether greedy output on a llama.cpp model is exact, and the one warning when it is not.

Contract: `kernel_switch(lib)` is the function that turns the row-exact kernels of `make llamacpp`'s build on or off
(None on a stock build). `inexact_reason(switch, settings, rows, probe)` says why a model on this library, settings
and CPU (the start-up kernel check's record, `guard.py`) is not row-exact, with the fix, or "" when it is;
`warn_inexact(reason)` warns once per process and reason.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from assistgen.backends.base import MAX_K
from assistgen.backends.llamacpp.guard import not_row_exact
from assistgen.backends.llamacpp.kernels import row_exact_switch
from assistgen.backends.llamacpp.settings import LlamaSettings


def inexact_reason(switch, settings: LlamaSettings, rows: int | None = None, probe: dict | None = None) -> str:
    """Why a model on this library and settings is not row-exact, with the fix ("" when it is); `rows`: how many
    rows of one pass the start-up kernel check saw kept exact on this CPU (`probe` its record; None: unchecked)."""
    if switch is not None and rows is not None and rows < 1 + MAX_K:
        culprits = ", ".join(not_row_exact(probe or {}))
        return (f"on this CPU the start-up kernel check found kernels that give a row of a wide pass other bits than "
                f"a one-row pass ({culprits}), so assisted greedy output can differ from plain decoding; please report "
                "it with `assistgen info`'s output")
    if switch is None:
        return ("this llama.cpp library has no row-exact kernel switch (a stock llama-cpp-python build): passes run on "
                "ggml's fast kernels, whose rounding depends on the rows beside a token, so assisted greedy output can "
                "differ from plain decoding; install the patched libraries (`pip uninstall llama-cpp-python`, then "
                "`pip install 'assistgen[llamacpp]'`, which builds assistgen-llama-cpp; or `make llamacpp`)")
    if not settings.flash_attention:
        return ("flash attention is off: a row's attention depends on where its sequence's cells lie in the shared "
                "pool, so assisted greedy output can differ from plain decoding; leave flash_attention on")
    return ""


_WARNED: set[str] = set()


def warn_inexact(reason: str) -> None:
    """Say once per process and reason that greedy output is not guaranteed to be plain decoding's."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"assistgen: greedy output is not exact on this model: {reason}.", RuntimeWarning, stacklevel=3)


def kernel_switch(lib):
    """The function that turns ggml's row-exact CPU kernels on or off for the passes that follow (the one that
    `make llamacpp`'s patch adds to ggml's CPU backend), or None on a build without it."""
    return row_exact_switch(Path(lib._lib._name).resolve().parent)


