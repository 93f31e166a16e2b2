"""What one request body can make the server allocate: adversarial JSON shapes, each on a fresh server.

Contract: for each shape (empty objects, user messages, two-character strings, token ids, empty lists, one long
string, object keys), a body just under `--max-body` (4 MiB by default) and, for the list shapes, one holding just
under the gate's limit of JSON items (one per 16 bytes of the limit: `serving/gate.py`), is sent to a freshly
started `assistgen serve --model MODEL` on 127.0.0.1 after one warm-up request. Prints, per body: its size, the
answer's status and time as the client sees it, the growth of the server's peak RSS (VmHWM) over its RSS before the
request, that growth over the body's size and over the limit, and the RSS left after it (what the allocator keeps).

    python benchmarks/body_shapes.py [--model smollm2-135m] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from helpers import start_serve_command  # noqa: E402

LIMIT = 4 * 2**20
ITEMS = LIMIT // 16
# name: (path, head, repeated unit, tail)
SHAPES = {
    "empty objects as messages": ("/chat/completions", '{"model":"m","messages":[', "{},", "]}"),
    "user messages": ("/chat/completions", '{"model":"m","messages":[', '{"role":"user","content":"a"},', "]}"),
    "2-character stop strings": ("/completions", '{"model":"m","prompt":"hi","stop":[', '"ab",', "]}"),
    "a token-id prompt": ("/completions", '{"model":"m","prompt":[', "9999,", "]}"),
    "empty lists as stop strings": ("/completions", '{"model":"m","prompt":"hi","stop":[', "[],", "]}"),
}


def listed(head: str, unit: str, tail: str, count: int) -> str:
    return head + (unit * count)[:-1] + tail


def bodies() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (path, head, unit, tail) in SHAPES.items():
        out[name] = (path, listed(head, unit, tail, (LIMIT - 4096) // len(unit)))
        per = unit.count(",") + unit.count("[") + unit.count("{")
        out[f"{name}, under the item limit"] = (path, listed(head, unit, tail, (ITEMS - 64) // per))
    out["one long string"] = ("/completions", '{"model":"m","prompt":"' + "a" * (LIMIT - 4096) + '"}')
    keys, size = [], 0
    while size < LIMIT - 4096:
        keys.append(f'"{len(keys)}":1')
        size += len(keys[-1]) + 1
    out["object keys (logit_bias)"] = ("/completions", '{"model":"m","prompt":"hi","logit_bias":{' + ",".join(keys)
                                       + "}}")
    return out


def memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args(argv)
    rows = []
    for name, (path, body) in bodies().items():
        process, port = start_serve_command("--model", args.model, *args.server_flags)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            httpx.post(f"{url}/completions", json={"model": args.model, "prompt": "hi", "max_tokens": 2}, timeout=60)
            time.sleep(0.5)
            rss, hwm = memory(process.pid)
            start = time.perf_counter()
            answer = httpx.post(f"{url}{path}", content=body.encode(), timeout=120,
                                headers={"content-type": "application/json"})
            seconds = time.perf_counter() - start
            time.sleep(0.5)
            after, peak = memory(process.pid)
        finally:
            process.terminate()
            process.wait(60)
        grew = peak - max(rss, hwm)
        row = {"shape": name, "body_mib": round(len(body) / 2**20, 2), "status": answer.status_code,
               "ms": round(seconds * 1000), "peak_growth_mib": round(grew, 1),
               "of_body": round(grew / (len(body) / 2**20), 1), "of_limit": round(grew / (LIMIT / 2**20), 1),
               "kept_mib": round(after - rss, 1), "error": answer.json().get("error", {}).get("code")
               if answer.headers.get("content-type", "").startswith("application/json") else None}
        rows.append(row)
        print(f"{name:50s} {row['body_mib']:5.2f} MiB -> {row['status']} in {row['ms']:5d} ms; peak +"
              f"{row['peak_growth_mib']:7.1f} MiB ({row['of_body']:5.1f}x the body, {row['of_limit']:4.1f}x the "
              f"limit); kept {row['kept_mib']:+.1f} MiB; {row['error']}", flush=True)
    print(json.dumps({"benchmark": "body_shapes", "model": args.model, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
