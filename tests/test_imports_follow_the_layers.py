"""The tree is the architecture: assistgen's imports form no cycle, and no layer imports one above it.

Every import in the package's source is read (module-level and function-local alike: a local import
still ties the two modules together), without importing anything. Layers, lowest first:
    0  config, stats, paths              plain settings, counters and file locations
    1  backends                          the seam (`backends/base.py`) and what computes logits
    2  spec                              the loop's vocabulary: drafts, the drafter and schedule protocols, the sampler
    3  policy                            how much to draft and verify
    4  drafters                          what drafts (early exit sizes its draft with the policy's optimizer)
    5  core                              the loop
    6  chat                              the edge between the library's loop and the wire: chat templates, the
                                         tool-call grammar and the call parser (the loop never imports it; the
                                         public surface renders chat prompts with it, the server reads calls with it)
    7  api, speech                       the public surface
    8  serving, bench                    the server and the benchmark library
    9  cli, __init__                     the commands, and the package's exports
A module may import its own layer and those below; above the backends nothing touches a model's
PyTorch modules (`torch.nn`, transformers' model classes, the `.hf` attribute of the torch backend's
`Model`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "assistgen"
LAYERS = {"config": 0, "stats": 0, "paths": 0, "backends": 1, "spec": 2, "policy": 3, "drafters": 4, "core": 5,
          "chat": 6, "api": 7, "speech": 7, "serving": 8, "bench": 8, "cli": 9, "__init__": 9}
MODEL_MODULES = ("torch.nn", "transformers", "llama_cpp")  # what only the backends may import


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, node.lineno))
            # `from assistgen.x import y` may name the submodule assistgen.x.y
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for target, _ in imports(path):
            if target in files and target != module:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})" for m, targets in sorted(graph.items())
            for t in sorted(targets) if layer(t) > layer(m) and not t.startswith(f"{m}.")]


def model_internals_above_the_backends() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if layer(module) <= LAYERS["backends"]:
            continue
        for target, line in imports(path):
            if any(target == m or target.startswith(m + ".") for m in MODEL_MODULES):
                found.append(f"{module}:{line} imports {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "hf":
                found.append(f"{module}:{node.lineno} reads .hf")
    return found


def test_the_package_has_no_import_cycle():
    assert find_cycle(package_graph()) is None, " -> ".join(find_cycle(package_graph()))


def test_no_layer_imports_one_above_it():
    assert upward_imports(package_graph()) == []


def test_nothing_above_the_backends_touches_a_models_torch_modules():
    assert model_internals_above_the_backends() == []


def test_every_module_belongs_to_a_layer():
    unknown = [m for m in package_graph() if m.count(".") and m.split(".")[1] not in LAYERS]
    assert unknown == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert find_cycle(graph) == expected


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"assistgen.core.engine": {"assistgen.serving.server"}, "assistgen.serving.server": set()})
