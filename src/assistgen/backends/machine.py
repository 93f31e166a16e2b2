"""What this machine's processor is, for measurement keys, probes and reports, for every backend.

Contract: `cpu_name()` is the processor's model name (from /proc/cpuinfo, else `platform.processor()`) and
`cpu_flags()` its feature flags (/proc/cpuinfo's `flags`, or `Features` on ARM; empty where there is none), each
read once per process; `cpu_identity()` is both in one string (name, then the flags sorted), what a probe's record
is keyed by; `cpu_summary()` is the name, the widest vector extension and the usable cores, for a figure's
heading. `cpu_ticks()` reads the clock ticks spent so far on the CPUs this process may run on, and
`others_share(end - start)` is the share of them that other processes took between two readings: how contended a
measurement taken in between was.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass


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


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), the one count of them every layer reads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads() -> int:
    """The threads a backend runs on by default: OMP_NUM_THREADS when it is set to a positive number (Ray sets it
    per replica), else `usable_cores()`."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else usable_cores()


def cpu_summary() -> str:
    """The processor, its widest vector extension and the cores this process may use, for a figure's heading."""
    flags = cpu_flags()
    widest = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                   if flag in flags), "no AVX2")
    return f"{cpu_name()} ({widest}), {usable_cores()} cores"


def cpu_identity() -> str:
    return f"{cpuinfo_fields().get('model name', '')}|{' '.join(sorted(cpu_flags()))}"


@dataclass(frozen=True)
class CpuTicks:
    """Clock ticks so far: `busy` and `total` summed over the CPUs this process may run on (/proc/stat; steal counts
    as busy: another machine's work on the same cores), `own` this process's (all its threads, /proc/self/stat)."""

    busy: int
    total: int
    own: int

    def __sub__(self, other: CpuTicks) -> CpuTicks:
        return CpuTicks(self.busy - other.busy, self.total - other.total, self.own - other.own)

    def __add__(self, other: CpuTicks) -> CpuTicks:
        return CpuTicks(self.busy + other.busy, self.total + other.total, self.own + other.own)


def cpu_ticks() -> CpuTicks | None:
    """The ticks now, or None where /proc gives none (not Linux)."""
    try:
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name in allowed:
                    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
                    busy += user + nice + system + irq + softirq + steal
                    total += user + nice + system + irq + softirq + steal + idle + iowait
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # (the name may hold spaces; fields 14, 15 follow it)
        own = int(fields[11]) + int(fields[12])
    except (OSError, ValueError, AttributeError):
        return None
    return CpuTicks(busy, total, own) if total else None


def others_share(spent: CpuTicks | None) -> float | None:
    """The share of this process's CPUs that other processes (and other machines, as steal) kept busy over `spent`
    (the ticks between two readings, or a sum of such spans): 0 on a quiet machine, 0.75 where three other busy
    processes share two cores. None where there is no reading or too few ticks passed to say (under half a second
    of one CPU)."""
    if spent is None or spent.total < 50:
        return None
    return min(1.0, max(0.0, (spent.busy - spent.own) / spent.total))
