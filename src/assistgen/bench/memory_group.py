"""A cgroup v1 memory group: a real cap on what a child process may keep resident, page cache included (the offloading
benchmark and its test run a model in one).

Contract: `cgroups_available()` is None where a group can be made (root, the v1 memory controller mounted at
/sys/fs/cgroup/memory), else why not. `MemoryGroup(limit)` makes a fresh group with that limit and no swap;
`add_self` (a child's `preexec_fn`) moves the calling process into it; `peak`, `stat` read it; `remove` deletes it
once its processes are gone. `drop_from_page_cache(path)` evicts a file's cached pages (so that a run starts cold).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def cgroups_available() -> str | None:
    """None when memory groups can be made here, else why not."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    if not (ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 memory controller at {ROOT} (cgroup v2 only, or none)"
    return None


class MemoryGroup:
    """A cgroup v1 memory group limited to `limit` bytes (swap included where the kernel accounts it)."""

    def __init__(self, limit: int):
        self.path = ROOT / f"assistgen-offload-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
        (self.path / "memory.swappiness").write_text("0")

    def add_self(self) -> None:  # (run in the child, before exec)
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def stat(self, name: str) -> int:
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, value = line.split()
            if key == name:
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
