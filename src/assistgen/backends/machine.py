"""What names this machine's processor for measurement keys, for every backend.

Contract: `cpu_name()` is the processor's model name (from /proc/cpuinfo, else `platform.processor()`),
read once per process.
"""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
