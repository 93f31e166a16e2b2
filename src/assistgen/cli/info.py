"""`assistgen info`: what this installation is and has, for a bug report or a first look.

Contract: `collect()` returns one JSON-ready dict (versions, backends, CPU, cache); `report(info)` is its text.
Nothing is loaded but the llama.cpp libraries (to ask them whether they are row-exact) and nothing is written.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from assistgen.backends.machine import cpu_name, usable_cores
from assistgen.paths import cache_root

PACKAGES = ("assistgen", "torch", "transformers", "assistgen_llama_cpp", "llama_cpp_python", "llguidance", "fastapi",
            "uvicorn", "openai", "prometheus_client", "accelerate", "ray")
SHOWN = 6  # the largest entries of a cache folder the text names (--json lists all)
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "neon")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_flags() -> list[str]:
    """The features in CPU_FLAGS this processor reports (`backends.machine.cpu_flags`)."""
    from assistgen.backends.machine import cpu_flags as reported

    have = reported()
    return [flag for flag in CPU_FLAGS if flag in have]


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cache_contents(root: Path) -> list[dict]:
    """[{"kind", "path", "bytes", "entries": [{"name", "bytes"}]}] for each folder under the cache root."""
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        entries = [{"name": e.name, "bytes": size_of(e)} for e in sorted(folder.iterdir())]
        out.append({"kind": folder.name, "path": str(folder), "bytes": sum(e["bytes"] for e in entries),
                    "entries": entries})
    return out


def collect() -> dict:
    import torch

    from assistgen.backends.choice import recorded
    from assistgen.backends.llamacpp.loading import library_report

    root = cache_root()
    folders = cache_contents(root)
    loose = sum(p.stat().st_size for p in root.iterdir() if p.is_file()) if root.is_dir() else 0
    threads = usable_cores()
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "packages": {name: version(name) for name in PACKAGES},
        "backends": {
            "torch": {"available": True, "cuda": torch.cuda.is_available(), "threads": torch.get_num_threads()},
            "llama.cpp": library_report(),
        },
        "cpu": {"name": cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(), "usable": threads,
                "flags": cpu_flags()},
        "cache": {"root": str(root), "bytes": loose + sum(f["bytes"] for f in folders), "folders": folders},
        "choices": recorded(),
    }


def human_size(n: int) -> str:
    """A size in the largest unit under which it is at least 1 (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def kernel_lines(llama: dict) -> list[str]:
    """Which kernel families ggml's CPU backend uses here, and what the start-up probe's kernel check found: for each
    type and buffer type, whether 1-5 rows in one pass give each row the one-row pass's bits."""
    pad = " " * 21
    families = ", ".join(f"{name} {'yes' if used else 'no'}" for name, used in llama["families"].items())
    why = " (AMX kept off: its tile set-up crashed on this machine; ASSISTGEN_AMX=0)" if llama.get("amx_off") else ""
    lines = [f"{pad}kernel families in use: {families}{why}"]
    for switch, label in ((True, "row-exact switch on"), (False, "fast kernels")):
        rows = [r for r in llama["kernel_check"] if r[2] is switch]
        differ = [f"{name} in {buft} from {n} rows" for name, buft, _, n in rows if n is not None]
        lines.append(f"{pad}kernel check, {label}: " + (f"{len(rows) - len(differ)} of {len(rows)} row-exact"
                     + (f"; not: {', '.join(differ)}" if differ else "")))
    return lines


def report(info: dict) -> str:
    lines = [f"assistgen {info['packages']['assistgen']} on Python {info['python']} ({info['platform']})", "",
             "packages:"]
    lines += [f"  {name:<20} {v or 'not installed'}" for name, v in info["packages"].items() if name != "assistgen"]
    torch_, llama = info["backends"]["torch"], info["backends"]["llama.cpp"]
    lines += ["", "backends:",
              f"  torch              yes ({'CUDA available' if torch_['cuda'] else 'CPU'}, "
              f"{torch_['threads']} threads)"]
    if not llama["available"]:
        lines.append(f"  llama.cpp          no: {llama['install']}")
    else:
        exact = ("row-exact (patched: greedy output is plain decoding's)" if llama["row_exact"] else
                 "STOCK build, not row-exact: assisted greedy output may differ from plain decoding; "
                 "`pip uninstall llama-cpp-python` then `pip install 'assistgen[llamacpp]'` (or `make llamacpp`) "
                 "installs the patched ones")
        lines += [f"  llama.cpp          yes, {exact}", f"                     libraries: {llama['library']}",
                  f"                     CPU library: {llama['cpu_library']}", *kernel_lines(llama),
                  f"                     ggml: {llama['system_info']}"]
    cpu = info["cpu"]
    lines += ["", f"cpu: {cpu['name']} ({cpu['machine']}), {cpu['usable']} of {cpu['cores']} cores usable",
              f"  features: {' '.join(cpu['flags']) or 'none reported'}"]
    measured = "the faster on this CPU, measured once per model" if llama["available"] else \
        "torch (llama.cpp is not installed)"
    lines += ["", "backend auto, for a transformers folder or hub id:",
              "  --quantize q4_k_m, q8_0 (a GGUF type): llama.cpp, converted on first use",
              f"  --quantize int8, int4: {measured}",
              "  no --quantize: torch, on the model's own weights"]
    for c in info.get("choices", []):
        lines.append(f"  {c['spec']} {c['quantize']}: {c['backend']}: {c['reason']} (measured {c['measured']})")
    cache = info["cache"]
    lines += ["", f"cache: {cache['root']} ({human_size(cache['bytes'])}; ASSISTGEN_CACHE moves it)"]
    for folder in cache["folders"]:
        lines.append(f"  {folder['kind']:<12} {human_size(folder['bytes']):>14}  {len(folder['entries'])} entries")
        largest = sorted(folder["entries"], key=lambda e: -e["bytes"])
        lines += [f"    {e['name'][:56]:<56} {human_size(e['bytes']):>14}" for e in largest[:SHOWN]]
        if len(largest) > SHOWN:
            rest = largest[SHOWN:]
            lines.append(f"    ... and {len(rest)} more ({human_size(sum(e['bytes'] for e in rest))})")
    if not cache["folders"]:
        lines.append("  (empty)")
    lines.append(f"  to clear it: rm -rf {cache['root']} (or one folder of it: everything there is derived and "
                 "is made again on next use)")
    return "\n".join(lines)
