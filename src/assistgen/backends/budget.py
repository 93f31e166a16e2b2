"""A memory budget for a model (`load_model(..., max_memory=...)`, `--max-memory`): parsing it, reading what a process
keeps resident, and the smallest budget a model can run in.

Contract: `parse_budget(value)` takes bytes (an int) or text ("1GB", "512 MiB", "1.5g"; decimal and binary units,
case-insensitive) and returns bytes, or raises `ConfigError` naming the forms it takes. `resident()` is this
process's resident memory by kind (/proc/self/status: anonymous, file-backed), 0s where /proc is missing.
`check_model_budget(model, before, ...)` measures a loaded model's part of that (after one pass) and checks it.
`check_floor(name, budget, parts)` raises `ModelLoadError` when the budget is below the sum of `parts` (what must stay
resident), naming the smallest budget that works and what it is made of. Weights beyond a budget stay file-backed
(memory-mapped): the operating system keeps what fits and reads the rest from the file during each forward pass.
"""

from __future__ import annotations

import ctypes
import re

from assistgen.backends.embedded import ModelLoadError
from assistgen.config import ConfigError

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
FORMS = "bytes, or a number with a unit: 800MB, 1.5GB, 512MiB, 2GiB"


def parse_budget(value, name: str = "max_memory", zero: bool = False) -> int:
    """Bytes from an int or text with a unit; `name` is what messages call it; `zero`: 0 is allowed."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be {FORMS}, got {value!r}.")
    if isinstance(value, int):
        amount = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in UNITS:
            raise ConfigError(f"{name} must be {FORMS}, got {value!r}.")
        amount = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if amount < 0 or (amount == 0 and not zero):
        raise ConfigError(f"{name} must be above 0, got {value!r}.")
    return amount


def resident(trim: bool = False) -> dict[str, int]:
    """This process's resident bytes: {"anon": ..., "file": ...}. `trim`: first hand the heap's free pages back to
    the system (glibc's malloc_trim), so that memory allocated next shows as growth, whatever was freed before."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    out = {"anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    out["anon" if line.startswith("RssAnon") else "file"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def check_floor(name: str, budget: int, parts: dict[str, int]) -> None:
    """Refuse a budget below the sum of `parts` (what must stay resident), naming the smallest that works."""
    floor = sum(parts.values())
    if budget < floor:
        made_of = ", ".join(f"{what} {megabytes(n)}" for what, n in parts.items())
        least = -(-floor // 10**6)  # (MB, rounded up)
        raise ModelLoadError(f"max_memory={megabytes(budget)} is below what {name} must keep resident ({made_of}): "
                             f"give at least {least} MB (--max-memory {least}MB), or a shorter context (--context), "
                             "or a smaller assistant.")


def check_model_budget(model, before: dict[str, int], resident_what: str, block_what: str, block_bytes: int) -> None:
    """Refuse `model.max_memory` below what must stay resident: the anonymous memory its load added since `before`,
    measured after one pass (`resident_what` names what that is on its backend), and its largest weight block."""
    cache = model.new_cache()
    cache.feed(model.tokenizer("Hello")["input_ids"][:1] or [0])
    del cache
    check_floor(model.name, model.max_memory, {resident_what: max(0, resident()["anon"] - before["anon"]),
                                               block_what: block_bytes})
