"""transformers' reads of a GGUF file, each file parsed once and without numpy.memmap's per-item overhead.

Contract: inside `parsed_once()`, every `gguf.GGUFReader(path)` that transformers makes (it makes one for the
config, one for the tokenizer and one for the weights, each parsing the whole metadata again: a 262k-token
vocabulary is three arrays of 262k items parsed one item at a time) returns one `_Reader` per file (path, size and
time), the same object each time. `_Reader` is gguf's own reader, its fields and tensors the same values, with the
file's bytes indexed as a plain ndarray view of the memory map (numpy.memmap's Python-level `__getitem__`, called
for every item, was two thirds of the parse). Likewise `gguf.get_tensor_name_map(arch, blocks)`, which transformers
asks again for every submodule of the model, is built once per (arch, blocks). What is built is read-only, and is
dropped when the block ends; outside the block gguf is as it was. Blocks in several threads run one at a time (a
process-wide lock), so that each restores what it replaced.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_ONE_AT_A_TIME = threading.RLock()


def _reader_class():
    import numpy as np
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        """gguf's reader over a plain ndarray view of the file's memory map (the map stays open through it)."""

        @property
        def data(self):
            return self._bytes

        @data.setter
        def data(self, value):
            self._bytes = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _Reader


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """While open, `gguf.GGUFReader(path)` gives one fast reader per file (see the module's contract)."""
    with _ONE_AT_A_TIME:
        yield from _patched()


def _patched() -> Iterator[None]:
    import gguf

    original, reader_class, readers = gguf.GGUFReader, _reader_class(), {}
    original_map, maps = gguf.get_tensor_name_map, {}

    def reader(path, mode="r"):
        if mode != "r":
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = original_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, original_map
