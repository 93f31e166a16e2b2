"""The installed package, as a user gets it from pip (`make test-wheel` runs this in a fresh venv holding only the
built wheels, never the checkout): `assistgen info` says the llama.cpp build is row-exact; greedy output with prompt
lookup equals plain decoding on both backends, on llama.cpp with `exact` in its statistics and drafts checked;
the server answers one structured request through the openai client with JSON that fits the schema; triton is
not installed. Exits non-zero, naming the check, on the first that fails."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import assistgen

PORT = 8177
PROMPT = "List the numbers one to ten, then again: one, two, three, four, five, six, seven, eight, nine, ten, one,"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
BIN = Path(sys.executable).parent


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"smoke test failed: {what}")
    print(f"ok: {what}")


def main() -> None:
    check(not Path(assistgen.__file__).is_relative_to(Path(__file__).resolve().parent.parent / "src"),
          f"assistgen imported from the installed package ({Path(assistgen.__file__).parent})")
    info = json.loads(subprocess.run([BIN / "assistgen", "info", "--json"], check=True, capture_output=True,
                                     text=True).stdout)
    check(info["backends"]["llama.cpp"]["row_exact"], "assistgen info: the llama.cpp libraries are row-exact")
    check(importlib.util.find_spec("triton") is None, "no triton in the environment")
    for backend in ("llama.cpp", "torch"):
        model = assistgen.load_model("smollm2-135m", backend=backend)
        plain = assistgen.generate(model, PROMPT, max_new_tokens=24)
        assisted = assistgen.generate(model, PROMPT, lookup=True, max_new_tokens=24)
        check(assisted.token_ids == plain.token_ids and assisted.stats.drafted_tokens > 0 and assisted.stats.exact,
              f"{backend}: greedy with prompt lookup == plain ({assisted.stats.drafted_tokens} drafted, "
              f"{assisted.stats.accepted_tokens} accepted, exact={assisted.stats.exact})")
    server = subprocess.Popen([BIN / "assistgen", "serve", "--model", "smollm2-135m", "--port", str(PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: {server.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        check(health["exact"], f"/health: {health}")
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2-135m", max_tokens=60, temperature=0,
            messages=[{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        person = json.loads(reply.choices[0].message.content)
        check(set(person) == {"name", "age"} and isinstance(person["age"], int), f"structured output: {person}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
