"""Where assistgen keeps what it derives from models on disk, and how it writes there.

Contract: `cache_root()` is the one home (`$ASSISTGEN_CACHE`, default `~/.cache/assistgen`) of converted
and quantized models, measured costs and linear routes. `measurement_file(kind, key, fingerprint)` is
where a measurement of one kind ("costs", "routes") of a model on this machine is cached;
`remembered(path, measure, required, keep=...)` reads it, or measures and saves it when `keep` says the
record may be kept (a record without the `required` keys, or unreadable, is measured again).
`replaced_atomically(dest)` gives a temporary path beside `dest` to write a file or folder into, and
puts it in place only when the block succeeds, so a reader never sees half of one. Nothing here knows about models.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ASSISTGEN_CACHE", Path.home() / ".cache" / "assistgen"))


def safe_name(text: str, limit: int = 80) -> str:
    """`text` as a file name: letters, digits, - _ . kept, everything else _ (at most `limit` characters)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)[:limit]


def measurement_file(kind: str, key: str, fingerprint: str) -> Path:
    return cache_root() / kind / f"{safe_name(key)}-{fingerprint}.json"


def remembered(path: Path | None, measure: Callable[[], dict], required: tuple[str, ...] = (),
               refresh: bool = False, keep: Callable[[dict], bool] = lambda record: True) -> dict:
    """The JSON record at `path` when it holds every `required` key (and not `refresh`), else `measure()`,
    saved there when `keep(record)` (path None: measured, not saved)."""
    record = None if refresh else recalled(path, required)
    if record is None:
        record = measure()
        if keep(record):
            remember(path, record)
    return record


def recalled(path: Path | None, required: tuple[str, ...] = ()) -> dict | None:
    """The JSON record at `path` when it holds every `required` key, else None."""
    if path is not None and path.exists():
        try:
            record = json.loads(path.read_text())
            if all(k in record for k in required):
                return record
        except (OSError, ValueError):
            pass
    return None


def remember(path: Path | None, record: dict) -> None:
    """Save a record as JSON at `path` (None: nowhere)."""
    if path is not None:
        with replaced_atomically(path) as tmp:
            tmp.write_text(json.dumps(record))


@contextmanager
def replaced_atomically(dest: Path) -> Iterator[Path]:
    """A fresh temporary path beside `dest`; on success it replaces `dest` (a file or a folder), on failure it is
    removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if dest.is_dir():
        shutil.rmtree(dest)
    tmp.replace(dest)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
