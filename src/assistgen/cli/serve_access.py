"""`assistgen serve`'s options of who may use the server, how much a request may send and how it is reached:
--api-key (repeatable), --api-key-file (a key a line; blank lines and lines starting with # skipped), the
ASSISTGEN_API_KEY environment variable, --metrics-need-key, --max-body, --ssl-keyfile and --ssl-certfile (TLS through
uvicorn), --allowed-origins (CORS) and --root-path.

Contract: `add_arguments(p)` declares them; `access(args)` returns the `ServerSettings` fields they give (`api_keys`:
every key from the three sources, in that order, without repeats; `metrics_need_key`; `max_body` in bytes;
`allowed_origins`, `root_path`, `tls_keyfile`, `tls_certfile`), and
raises `ConfigError` naming a file that cannot be read or holds no key.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from assistgen.backends.budget import parse_budget
from assistgen.config import ConfigError

ENVIRONMENT = "ASSISTGEN_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("who may use it (without a key: anyone who reaches --host)")
    group.add_argument("--api-key", action="append", metavar="KEY",
                       help=f"a key requests must carry as 'Authorization: Bearer KEY' (repeatable; also "
                            f"{ENVIRONMENT}); others are answered 401, /health stays open. A key's n-gram, suffix and "
                            "prefix caches serve only its own requests")
    group.add_argument("--api-key-file", metavar="FILE", help="more keys, one a line (# starts a comment line)")
    group.add_argument("--metrics-need-key", action="store_true", help="/metrics behind the keys too (default: open)")
    reach = p.add_argument_group("how it is reached")
    reach.add_argument("--ssl-keyfile", metavar="FILE", help="TLS: the private key (with --ssl-certfile)")
    reach.add_argument("--ssl-certfile", metavar="FILE", help="TLS: the certificate chain (with --ssl-keyfile)")
    reach.add_argument("--allowed-origins", metavar="ORIGINS",
                       help="browser origins CORS lets call the API, comma-separated (e.g. https://app.example.com; "
                            "* for any); default: no CORS headers")
    reach.add_argument("--root-path", metavar="PATH", help="the path prefix a reverse proxy serves it under, e.g. /llm")
    group.add_argument("--max-body", metavar="BYTES",
                       help="the largest request body a JSON endpoint takes, e.g. 4MiB (the default); larger: 413 "
                            "before it is read (transcriptions: --max-upload)")


def access(args: argparse.Namespace) -> dict:
    keys = list(args.api_key or [])
    if getattr(args, "api_key_file", None):
        keys += keys_in(Path(args.api_key_file))
    if os.environ.get(ENVIRONMENT, "").strip():
        keys.append(os.environ[ENVIRONMENT].strip())
    out = {"api_keys": tuple(dict.fromkeys(keys)), "metrics_need_key": bool(getattr(args, "metrics_need_key", False))}
    origins = [o.strip() for o in (getattr(args, "allowed_origins", None) or "").split(",") if o.strip()]
    out.update(allowed_origins=tuple(origins), root_path=getattr(args, "root_path", None) or "",
               tls_keyfile=getattr(args, "ssl_keyfile", None), tls_certfile=getattr(args, "ssl_certfile", None))
    if getattr(args, "max_body", None) is not None:
        out["max_body"] = parse_budget(args.max_body, "--max-body")
    return out


def keys_in(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({type(e).__name__}: {e}).") from e
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key: one key a line.")
    return keys
