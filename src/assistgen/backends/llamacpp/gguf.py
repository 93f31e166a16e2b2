"""What a GGUF file's header says of its tensors, read without gguf's reader (which builds arrays of the whole
vocabulary, hundreds of MB for a moment): their names, shapes, ggml types and where their data lie.

Contract: `tensor_infos(path)` returns ({name: TensorInfo}, the file's size); `tensor_sizes(path)` {name: bytes}; a
file that is not GGUF of version 2 or later raises `ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from assistgen.backends.embedded import ModelLoadError

# GGUF metadata value types (gguf's GGUFValueType) -> bytes of one value; 8 (string) and 9 (array) are read apart.
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_sizes(path: Path) -> dict[str, int]:
    """{tensor name: bytes} from a GGUF file's header; a tensor's size is the distance to the next one's data."""
    infos, end = tensor_infos(path)
    starts = sorted(info.offset for info in infos.values())
    by_start = dict(zip(starts, starts[1:] + [end], strict=True))
    return {name: by_start[info.offset] - info.offset for name, info in infos.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its shape (ggml's order: the row length first), ggml type id, and where its data
    starts (bytes from the start of the file)."""

    shape: tuple[int, ...]
    ggml_type: int
    offset: int


def tensor_infos(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """({tensor name: TensorInfo}, the file's size) from a GGUF file's header, the metadata skipped over unparsed
    (gguf's reader builds arrays of the whole vocabulary, hundreds of MB for a moment)."""
    import struct

    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

        def skip_string() -> None:
            f.seek(read("Q")[0], 1)

        def skip_value(kind: int) -> None:
            if kind == 8:
                skip_string()
            elif kind == 9:
                inner, count = read("IQ")
                if inner in _GGUF_SCALAR:
                    f.seek(_GGUF_SCALAR[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(inner)
            else:
                f.seek(_GGUF_SCALAR[kind], 1)

        magic, version = f.read(4), read("I")[0]
        if magic != b"GGUF" or version < 2:
            raise ModelLoadError(f"{path} is not a GGUF file of version 2 or later.")
        n_tensors, n_kv = read("QQ")
        alignment = 32
        for _ in range(n_kv):
            key = f.read(read("Q")[0]).decode()
            kind = read("I")[0]
            if key == "general.alignment" and kind == 4:
                alignment = read("I")[0]
            else:
                skip_value(kind)
        raw = {}
        for _ in range(n_tensors):
            name = f.read(read("Q")[0]).decode()
            dims = read("I")[0]
            shape = read("Q" * dims)
            kind, offset = read("IQ")
            raw[name] = (shape, kind, offset)
        data = -(-f.tell() // alignment) * alignment
    infos = {name: TensorInfo(tuple(shape), kind, data + offset) for name, (shape, kind, offset) in raw.items()}
    return infos, path.stat().st_size
