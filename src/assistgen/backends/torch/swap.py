"""Swapping one layer of a model for another: the one verb every module-swap transform uses.

Contract: `replace_module(root, name, module)` puts `module` where `root.get_submodule(name)` is, by setting the
attribute on its parent; nothing else of `root` changes. The small-row linear routes (`small_rows.py`),
quantization (`quantize.py`) and speech's copies for drafting swap their layers through it. It imports nothing of
assistgen.
"""

from __future__ import annotations

import torch


def replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where `root.get_submodule(name)` is: the one way a transform swaps a layer."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
