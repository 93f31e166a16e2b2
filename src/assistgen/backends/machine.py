"""What this machine's processor is, for measurement keys, probes and reports, for every backend.

Contract: `cpu_name()` is the processor's model name (from /proc/cpuinfo, else `platform.processor()`) and
`cpu_flags()` its feature flags (/proc/cpuinfo's `flags`, or `Features` on ARM; empty where there is none), each
read once per process; `cpu_identity()` is both in one string (name, then the flags sorted), what a probe's record
is keyed by.
"""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpuinfo_fields() -> dict[str, str]:
    """/proc/cpuinfo's first processor's fields (name -> value; empty where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # (the first processor's block ends here)
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    return cpuinfo_fields().get("model name") or platform.processor()


def cpu_flags() -> frozenset[str]:
    fields = cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_identity() -> str:
    return f"{cpuinfo_fields().get('model name', '')}|{' '.join(sorted(cpu_flags()))}"
