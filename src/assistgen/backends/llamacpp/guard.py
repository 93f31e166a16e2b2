"""The start-up guard: llama.cpp's libraries are tried on this CPU in a child process before this process loads them.

Contract: `check_cpu()` returns the probe's record ({"variant", "extra", "rows"}: the CPU library loaded, the extra
buffer types, and the kernel check's rows as [case, buffer type, switch on, first differing row count or None]) once
the libraries llama-cpp-python would load have multiplied, in a child process, every weight type the shipped models
use (and f16, f32), on every buffer type that takes it, over 1..`PROBE_ROWS` rows, with the row-exact switch on (on
a build that has it) and off. A child killed by a signal means loading them here would kill this process: SIGILL (a
build for another instruction set: a wheel built on another machine, or reused from pip's cache) or another signal
raises `ModelLoadError` naming the fix, unless the child lives with AMX's tile kernels kept off (`$ASSISTGEN_AMX=0`,
which the patched libraries read when they first list their buffer types): then this process sets it too, with a
warning, and runs on the AVX-512 kernels (`"amx_off"` in the record). A child that fails otherwise (a library too
old for the check) is warned about once and the record is empty. A passing probe is remembered per libraries (path,
size, time), forced CPU library and CPU (its name and flags) under the cache folder, so it runs once per machine and
build; `$ASSISTGEN_NO_CPU_PROBE=1` skips it (the child itself runs with it). `exact_rows(record)` is how many rows
of one pass the switch's kernels were seen to keep bitwise equal to the one-row pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

from assistgen.backends.embedded import ModelLoadError
from assistgen.backends.machine import cpu_identity
from assistgen.paths import cache_root, replaced_atomically

SKIP = "ASSISTGEN_NO_CPU_PROBE"
NO_AMX = "ASSISTGEN_AMX"  # "0": the patched libraries do not offer AMX's buffer type (its tile kernels never run)
PROBE_ROWS = 65  # 1 + LONG_K: a copy's longest verification
# The probe: small matmuls (32 output rows: AMX takes multiples of 32) of each type the shipped models use (and f16,
# f32) over 1..PROBE_ROWS rows, each buffer type, both switch states; prints the record as JSON. It loads kernels.py
# by its path (argv[1]) and checks the libraries in argv[2], so it imports numpy and ctypes only (no torch).
PROBE = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("assistgen_kernels", sys.argv[1])
k = sys.modules["assistgen_kernels"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
lib = Path(sys.argv[2])
variant = k.load_backends(lib)
states = (True, False) if k.row_exact_switch(lib) is not None else (False,)
rows = k.check_rows([k.Case(t, 256, 32) for t in (0, 1, 2, 3, 6, 8, 12, 14)], max_rows=int(sys.argv[3]),
                    switch_states=states, lib_dir=lib, threads=2)
print(json.dumps({"variant": variant, "extra": k.extra_buffer_types(lib),
                  "rows": [[r.case.name, r.buffer_type, r.row_exact_switch, r.first_differing_rows] for r in rows]}))
"""
_PASSED: dict[str, dict] = {}


def record_path(lib_dir: Path) -> Path:
    from assistgen.backends.llamacpp.kernels import library_identity

    forced = os.environ.get("ASSISTGEN_GGML_CPU", "")  # a portable build's CPU library, when one is forced
    libraries = library_identity(lib_dir / "libllama.so")
    key = f"{libraries}|{forced}|{cpu_identity()}" + ("|no-amx" if os.environ.get(NO_AMX) == "0" else "")
    key = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / "cpu-probes" / f"llama-cpp-{key}.json"


def check_cpu(lib_dir: Path | None = None, probe: str = PROBE) -> dict:
    """See the module's contract. `probe` is the child's program (a test gives one that dies)."""
    from assistgen.backends.llamacpp.kernels import library_dir

    if os.environ.get(SKIP) == "1":
        return {}
    lib_dir = lib_dir or library_dir()
    path = record_path(lib_dir)
    if str(path) in _PASSED:
        return _PASSED[str(path)]
    if probe is PROBE and path.is_file():
        try:
            return remember(lib_dir, path, keep_amx_off(json.loads(path.read_text())))
        except (OSError, ValueError):
            pass
    try:
        record = run_probe(lib_dir, probe)
    except ProbeDied as died_with:
        if os.environ.get(NO_AMX) == "0":
            raise ModelLoadError(died(lib_dir, died_with.signal)) from None
        try:  # AMX's tile set-up is the one path a CPU that has the instructions can still refuse (llama.cpp #26954)
            record = run_probe(lib_dir, probe, {NO_AMX: "0"})
        except ProbeDied:
            raise ModelLoadError(died(lib_dir, died_with.signal)) from None
        record = keep_amx_off({**record, "amx_off": True}, warn=True)
    if probe is PROBE and record:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as tmp:
            tmp.write_text(json.dumps(record))
        remember(lib_dir, path, record)
    return record


def remember(lib_dir: Path, path: Path, record: dict) -> dict:
    """The record for this process, under its path and under the path it has once AMX is kept off (the key reads
    `$ASSISTGEN_AMX`, which `keep_amx_off` may just have set): the later calls of this process find it either way."""
    _PASSED[str(path)] = _PASSED[str(record_path(lib_dir))] = record
    return record


class ProbeDied(Exception):
    def __init__(self, number: int):
        super().__init__(number)
        self.signal = number


def keep_amx_off(record: dict, warn: bool = False) -> dict:
    """For a record whose probe lived only without AMX: keep AMX off in this process before it loads the libraries."""
    if record.get("amx_off"):
        os.environ[NO_AMX] = "0"
        if warn:
            warnings.warn("assistgen: llama.cpp's AMX kernels crashed on this machine (AMX tile set-up refused); its "
                          f"AVX-512 kernels run instead ({NO_AMX}=0).", RuntimeWarning, stacklevel=4)
    return record


def run_probe(lib_dir: Path, probe: str, extra_env: dict | None = None) -> dict:
    env = {**os.environ, SKIP: "1", **(extra_env or {})}
    kernels = Path(__file__).with_name("kernels.py")
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(kernels), str(lib_dir), str(PROBE_ROWS)], env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise ModelLoadError(f"The llama.cpp libraries in {lib_dir} did not finish a test multiplication in 300 s on "
                             f"this CPU; set {SKIP}=1 to skip the test.") from e
    if done.returncode < 0:
        raise ProbeDied(-done.returncode)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])
        warnings.warn(f"assistgen: the start-up kernel check could not run on the llama.cpp libraries in {lib_dir} "
                      f"({tail}); they are used unchecked.", RuntimeWarning, stacklevel=4)
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


def exact_rows(record: dict) -> int | None:
    """The row counts 1..n of one pass the probe saw the switch's kernels keep bitwise the one-row pass's: n (the
    probe's bound when every kernel held), or None without a record (skipped, or the check could not run)."""
    rows = [row for row in record.get("rows", []) if row[2]]
    if not rows:
        return None
    return min([PROBE_ROWS] + [row[3] - 1 for row in rows if row[3] is not None])


def not_row_exact(record: dict) -> list[str]:
    """The probe's kernels that are not row-exact with the switch on: "q6_K[256] in CPU from 4 rows", ..."""
    return [f"{name} in {buft} from {n} rows" for name, buft, on, n in record.get("rows", []) if on and n is not None]


REBUILD = ("pip install --force-reinstall --no-deps --no-cache-dir --no-binary assistgen-llama-cpp "
           "'assistgen-llama-cpp=={version}'")


def died(lib_dir: Path, number: int) -> str:
    """The message for a probe killed by signal `number`: what it means and how to get libraries that run here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rebuild = REBUILD.format(version=version("assistgen-llama-cpp"))
    except PackageNotFoundError:
        rebuild = "pip uninstall llama-cpp-python, then pip install 'assistgen[llamacpp]'"
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    if number == signal.SIGILL:
        why = ("use an instruction this CPU does not have: they were built for another CPU (a wheel built on another "
               "machine, or reused from pip's cache)")
    else:
        why = "crashed"
    return (f"The llama.cpp libraries in {lib_dir} {why} (a test multiplication in a child process died with {name}), "
            f"so loading them here would kill this process. Build them on this machine: {rebuild} (or `make "
            "llamacpp`); or build the portable libraries, which choose their kernels for the CPU at run time: "
            "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON\" with the same command. "
            f"Or use backend='torch' (--backend torch); {SKIP}=1 skips this test (and then nothing stops the crash).")
