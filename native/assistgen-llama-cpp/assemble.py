"""Make assistgen-llama-cpp's sdist from llama-cpp-python's: its `llama_cpp` package, the llama.cpp sources
that build libllama and libggml (tests, tools, docs and model files left out) and llama.cpp's converter from
Hugging Face folders (`llama_cpp/convert/convert_hf_to_gguf.py`, with its gguf-py), patched with
`patches/llama.cpp-assistgen.patch`, under this folder's pyproject.toml and CMakeLists.txt.

    python native/assistgen-llama-cpp/assemble.py [--source llama_cpp_python-0.3.36.tar.gz] [--out build/dist]

Without --source, pip downloads llama-cpp-python's sdist of the version pyproject.toml names. Prints the sdist's
path. `pip wheel --no-deps SDIST` (or `pip install` of assistgen's llamacpp extra with the sdist found) builds it.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCH = HERE.parent.parent / "patches" / "llama.cpp-assistgen.patch"
KEPT = ("CMakeLists.txt", "LICENSE", "cmake/", "ggml/", "include/", "licenses/", "src/", "vendor/")  # of llama.cpp
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/LICENSE")  # of llama.cpp, the same
# release's converter from Hugging Face folders to GGUF (with its own gguf-py, which it puts on its path)


def placed(name: str) -> str | None:
    """Where a member (a path under the sdist's top folder) goes in ours: None for left out. The converter goes
    into the package (`llama_cpp/convert/`), so that the wheel carries it."""
    if name.startswith("llama_cpp/") or name == "LICENSE.md":
        return name
    inner = name.removeprefix("vendor/llama.cpp/")
    if inner == name:
        return None
    if any(inner == k or inner.startswith(k) for k in KEPT):
        return name
    if any(inner == k or inner.startswith(k) for k in CONVERTER):
        return f"llama_cpp/convert/{inner}"
    return None


def download(version: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(folder)], check=True)
    return next(folder.glob("llama_cpp_python-*.tar.gz"))


def pkg_info(project: dict) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}",
             f"Summary: {project['description']}", "License: MIT",
             f"Requires-Python: {project['requires-python']}"]
    lines += [f"Requires-Dist: {d}" for d in project["dependencies"]]
    return "\n".join(lines) + "\n\n" + (HERE / "README.md").read_text()


def assemble(source: Path, out: Path) -> Path:
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    upstream = project["version"].rsplit(".", 1)[0]  # (the last part is the patch's revision)
    top = f"{project['name'].replace('-', '_')}-{project['version']}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / top
        with tarfile.open(source) as sdist:
            prefix = f"llama_cpp_python-{upstream}/"
            members = []
            for m in sdist.getmembers():
                if m.isfile() and m.name.startswith(prefix) and (name := placed(m.name.removeprefix(prefix))):
                    m.name = name
                    members.append(m)
            if not members:
                raise SystemExit(f"{source} is not llama-cpp-python {upstream}'s sdist")
            sdist.extractall(root, members=members, filter="data")
        subprocess.run(["patch", "-p1", "-s", "-d", str(root / "vendor" / "llama.cpp"), "-i", str(PATCH)],
                       check=True)
        for name in ("pyproject.toml", "CMakeLists.txt", "README.md"):
            shutil.copy(HERE / name, root / name)
        shutil.copy(PATCH, root / PATCH.name)
        (root / "PKG-INFO").write_text(pkg_info(project))
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{top}.tar.gz"
        with tarfile.open(target, "w:gz") as tar:
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    info = tar.gettarinfo(path, f"{top}/{path.relative_to(root)}")
                    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                    with path.open("rb") as f:
                        tar.addfile(info, io.BytesIO(f.read()))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="llama-cpp-python's sdist (default: downloaded by pip)")
    parser.add_argument("--out", type=Path, default=Path("build/dist"))
    args = parser.parse_args()
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source or download(project["version"].rsplit(".", 1)[0], Path(tmp))
        print(assemble(source, args.out))


if __name__ == "__main__":
    main()
