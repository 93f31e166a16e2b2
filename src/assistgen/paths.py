"""Where assistgen keeps what it derives from models on disk: converted and quantized models, measured
costs and linear routes. Contract: `cache_root()` is the one home (`$ASSISTGEN_CACHE`, default
`~/.cache/assistgen`); nothing else here.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ASSISTGEN_CACHE", Path.home() / ".cache" / "assistgen"))


def safe_name(text: str, limit: int = 80) -> str:
    """`text` as a file name: letters, digits, - _ . kept, everything else _ (at most `limit` characters)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)[:limit]
