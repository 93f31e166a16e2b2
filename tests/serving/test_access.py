"""A server you can put on a network (`serving/gate.py`, `cli/serve_access.py`): only known API keys get in, on every
endpoint but /health; bodies past the limit are 413 before they are read; text that cannot fit the context is refused
before it is tokenized; list fields are capped. The real server, spoken to with the official `openai` client and
httpx; no mocks."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from helpers import start, start_serve_command, stop, stop_serve_command

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def locked(smollm2, one_thread):
    server = start(smollm2, max_tokens_limit=8, api_keys=KEYS)
    yield server
    stop(server)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=60, max_retries=0)


def every_endpoint(c: openai.OpenAI) -> dict:
    """Each endpoint called once (the transcription with a WAV header the server never gets to read)."""
    calls = {
        "chat": lambda: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=2),
        "completions": lambda: c.completions.create(model=NAME, prompt="Hi", max_tokens=2),
        "responses": lambda: c.responses.create(model=NAME, input="Hi", max_output_tokens=2),
        "models": lambda: c.models.list(),
        "model": lambda: c.models.retrieve(NAME),
        "transcriptions": lambda: c.audio.transcriptions.create(model="whisper-1", file=("a.wav", b"RIFF....WAVE")),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = 200
        except openai.APIStatusError as e:
            out[name] = e.status_code
            if e.status_code == 401:
                assert e.body["code"] == "invalid_api_key", (name, e.body)
    return out


def test_only_a_known_key_gets_in_on_every_endpoint_but_health(locked):
    assert set(every_endpoint(client(locked, "not-a-key")).values()) == {401}
    assert set(every_endpoint(client(locked, KEYS[0][:-1])).values()) == {401}  # a prefix of a key is no key
    answered = every_endpoint(client(locked, KEYS[1]))
    assert {k: v for k, v in answered.items() if k != "transcriptions"} == dict.fromkeys(
        ["chat", "completions", "responses", "models", "model"], 200)
    assert answered["transcriptions"] == 404  # in: this server has no speech model, and says so
    bare = httpx.post(f"{locked.url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2})
    assert bare.status_code == 401 and "didn't provide an API key" in bare.json()["error"]["message"]
    assert httpx.post(f"{locked.url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                      headers={"Authorization": f"Basic {KEYS[0]}"}).status_code == 401  # not a bearer token
    assert httpx.get(f"{locked.url}/health").status_code == 200
    assert httpx.get(f"{locked.url}/metrics").status_code == 200  # open unless metrics_need_key


def test_metrics_behind_the_key_when_asked(smollm2, one_thread):
    server = start(smollm2, api_keys=KEYS, metrics_need_key=True)
    try:
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        stop(server)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_the_command_takes_keys_from_flags_a_file_and_the_environment_and_refuses_big_bodies_before_reading(
        tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nfile-key\n\n")
    env = {**os.environ, "ASSISTGEN_API_KEY": "env-key"}
    process, port = start_serve_command("--model", NAME, "--lookup", "--api-key", "flag-key", "--api-key-file",
                                        str(keys), "--max-tokens-limit", "4", env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for key in ("flag-key", "file-key", "env-key"):
            c = openai.OpenAI(base_url=url, api_key=key, timeout=60, max_retries=0)
            assert c.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="# the team's keys", max_retries=0).models.list()
        auth = {"Authorization": "Bearer flag-key", "Content-Type": "application/json"}
        before = rss_mib(process.pid)
        big = b'{"model": "' + NAME.encode() + b'", "prompt": "' + b"a" * (20 * 2**20) + b'"}'
        said = httpx.post(f"{url}/completions", content=big, headers=auth, timeout=60)
        assert said.status_code == 413 and said.json()["error"]["code"] == "body_too_large"

        def chunks():  # no Content-Length: the limit is found as the bytes come
            for _ in range(20):
                yield b"a" * 2**20

        said = httpx.post(f"{url}/completions", content=chunks(), headers=auth, timeout=60)
        assert said.status_code == 413
        flood = b'{"model": "' + NAME.encode() + b'", "prompt": "Hi", "stop": [' + b"[]," * 1_390_000 + b"[]]}"
        said = httpx.post(f"{url}/completions", content=flood, headers=auth, timeout=60)  # 4 MiB of empty lists
        assert said.status_code == 400 and said.json()["error"]["code"] == "too_many_items"
        assert rss_mib(process.pid) - before < 50  # no body was held, nor parsed
        assert "3 API keys: requests without one are answered 401" in stop_serve_command(process)
    finally:
        if process.poll() is None:
            process.kill()


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(locked):
    c = client(locked, KEYS[0])
    text = "word " * 400_000  # 2 MB: under the body's limit, far over the context in any tokenization
    for call, param in ((lambda: c.completions.create(model=NAME, prompt=text, max_tokens=2), "prompt"),
                        (lambda: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                                           max_tokens=2), "messages"),
                        (lambda: c.responses.create(model=NAME, input=text, max_output_tokens=2), "input")):
        with pytest.raises(openai.BadRequestError, match="bytes of text are at least .* tokens in any tokenization"
                           ) as refused:
            call()
        assert refused.value.body["param"] == param and refused.value.body["code"] == "context_length_exceeded"


def test_a_body_of_too_many_json_items_is_refused_before_it_is_parsed_and_text_is_not_counted(locked):
    auth = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    flood = b'{"model": "' + NAME.encode() + b'", "prompt": "Hi", "stop": [' + b"[]," * 300_000 + b"[]]}"
    said = httpx.post(f"{locked.url}/v1/completions", content=flood, headers=auth, timeout=60)
    assert said.status_code == 400 and said.json()["error"]["code"] == "too_many_items"
    assert "holds 600,006 JSON items" in said.json()["error"]["message"]  # its commas and brackets, plus one
    assert "at most 262,144" in said.json()["error"]["message"]
    c = client(locked, KEYS[0])
    text = 'a,[{\\"' * 300_000  # 1.2 MB of commas and brackets in a string, escaped quotes among them: no items
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=NAME, prompt=text, max_tokens=2)
    assert refused.value.body["code"] == "context_length_exceeded"  # (it got past the count, to the context)


def test_list_fields_are_capped(locked):
    c = client(locked, KEYS[0])
    with pytest.raises(openai.BadRequestError, match="at most 16 stop strings"):
        c.completions.create(model=NAME, prompt="Hi", max_tokens=2, stop=[f"s{i}" for i in range(17)])
    with pytest.raises(openai.BadRequestError, match="at most 256 prompts"):
        c.completions.create(model=NAME, prompt=["Hi"] * 257, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}] * 4097, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 256 tools"):
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], tools=[tool] * 257)


def test_tls_cors_and_a_root_path(tmp_path):
    """TLS through uvicorn (a self-signed certificate made here), CORS for one browser origin (its preflight needs no
    key), and the URL it announces under a reverse proxy's prefix."""
    import ssl
    import subprocess
    import sys
    import time

    from helpers import free_port

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "assistgen.cli.main", "serve", "--model", NAME, "--port",
                                str(port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--api-key", "k",
                                "--allowed-origins", "https://app.example.com", "--root-path", "/llm"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"https://127.0.0.1:{port}"
    tls, last = ssl.create_default_context(cafile=str(cert)), None
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, f"the server did not start: {last!r}"
            try:
                if httpx.get(f"{url}/health", verify=tls, timeout=1).status_code == 200:
                    break
            except httpx.TransportError as e:
                last = e
                time.sleep(0.2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k", http_client=httpx.Client(verify=tls),
                          max_retries=0)
        assert c.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        preflight = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        said = httpx.options(f"{url}/v1/chat/completions", headers=preflight, verify=tls)
        assert said.status_code == 200
        assert said.headers["access-control-allow-origin"] == "https://app.example.com"
        other = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"},
                              verify=tls)
        assert "access-control-allow-origin" not in other.headers
        assert f"serving {NAME} at https://127.0.0.1:{port}/llm/v1" in stop_serve_command(process)
    finally:
        if process.poll() is None:
            process.kill()


def test_a_request_past_the_servers_deadline_ends_with_what_it_has_and_finish_reason_timeout(smollm2, one_thread):
    server = start(smollm2, request_timeout=0.4)
    try:
        c = client(server, "any")
        long = "Count from one to two hundred in words, one number a line:"
        whole = c.completions.create(model=NAME, prompt=long, max_tokens=1500)
        assert whole.choices[0].finish_reason == "timeout" and 0 < whole.usage.completion_tokens < 1500
        events = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long}],
                                                max_tokens=1500, stream=True))
        assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == ["timeout"]
        response = c.responses.create(model=NAME, input=long, max_output_tokens=1500)
        assert response.status == "incomplete" and response.incomplete_details.reason == "timeout"
        short = c.completions.create(model=NAME, prompt="Hi", max_tokens=2)  # within the deadline: as ever
        assert short.choices[0].finish_reason == "length"
        finished = httpx.get(f"{server.url}/metrics").text
        assert 'finished_reason="timeout"' in finished
    finally:
        stop(server)


def test_options_that_would_do_nothing_are_refused(capsys):
    from assistgen.cli.main import main
    from assistgen.config import ConfigError
    from assistgen.serving.app_state import ServerSettings

    assert main(["generate", "--model", NAME, "--assistant-quantize", "q4_0", "hi"]) == 2
    assert "--assistant-quantize set(s) how the assistant is loaded: add --assistant" in capsys.readouterr().err
    assert main(["serve", "--model", NAME, "--assistant-head", "4096"]) == 2
    assert "add --assistant" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--metrics-need-key puts /metrics behind the API keys"):
        ServerSettings(NAME, metrics_need_key=True)
