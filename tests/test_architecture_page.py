"""docs/architecture.md names only what exists, and lists every subpackage in its layers; the current results page,
docs/results.md, names only files that exist too.

Contract: every backticked path on either page that ends in `.py` or `/` exists: relative to the repository root when
it starts with `tests/`, `benchmarks/` or `docs/`, else relative to src/assistgen. Every subpackage of src/assistgen
(a directory holding an `__init__.py` directly under it) is named, as `name/` in backticks, in the architecture page's
"The layers" section.
Nothing is imported: the page and the tree are read as text.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "assistgen"
PAGE = ROOT / "docs" / "architecture.md"
RESULTS = ROOT / "docs" / "results.md"


def named_paths(text: str) -> set[str]:
    return {p for p in re.findall(r"`([^`\s]+)`", text) if p.endswith((".py", "/"))}


def where(path: str) -> Path:
    return ROOT / path if path.startswith(("tests/", "benchmarks/", "docs/")) else PACKAGE / path


def layers_section(text: str) -> str:
    found = re.search(r"^## The layers$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, "docs/architecture.md has no '## The layers' section"
    return found.group(1)


def test_every_path_the_pages_name_exists():
    for page in (PAGE, RESULTS):
        paths = named_paths(page.read_text())
        assert paths, f"{page.name} names no file"
        assert sorted(p for p in paths if not where(p).exists()) == [], page.name


def test_the_layers_name_every_subpackage():
    section = layers_section(PAGE.read_text())
    subpackages = sorted(d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file())
    assert subpackages, "no subpackage found under src/assistgen"
    assert [name for name in subpackages if f"`{name}/`" not in section] == []
