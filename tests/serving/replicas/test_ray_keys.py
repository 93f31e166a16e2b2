"""Keys on replicas: `assistgen serve --replicas 2 --api-key ...`'s ingress refuses an unknown key on every endpoint
but /health, as one process does (`serving/gate.py`), and lets a known one through to the replicas. A local Ray
cluster (127.0.0.1 only, started here), the official openai client and httpx; `make test-ray` runs it."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import free_port

from assistgen.backends.settings import LoadSettings
from assistgen.serving.app_state import ServerSettings
from assistgen.serving.assembly import ServerSpec
from assistgen.serving.ray import ReplicaOptions, start, stop

NAME = "smollm2-135m"
KEY = "replica-key"


@pytest.fixture(scope="module")
def locked():
    port = free_port()
    spec = ServerSpec(NAME, LoadSettings(backend="torch"),
                      settings=ServerSettings(NAME, max_tokens_limit=8, api_keys=(KEY,), metrics_need_key=True))
    start(spec, ReplicaOptions(replicas=2, cpus_per_replica=1), "127.0.0.1", port, num_cpus=2)
    yield f"http://127.0.0.1:{port}"
    stop()


def test_the_ingress_lets_in_only_known_keys(locked):
    wrong = openai.OpenAI(base_url=f"{locked}/v1", api_key="not-a-key", timeout=120, max_retries=0)
    calls = [lambda c: c.completions.create(model=NAME, prompt="Hi", max_tokens=2),
             lambda c: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2),
             lambda c: c.responses.create(model=NAME, input="Hi", max_output_tokens=2),
             lambda c: c.models.list()]
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as refused:
            call(wrong)
        assert refused.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{locked}/metrics", timeout=60).status_code == 401
    assert httpx.post(f"{locked}/v1/audio/transcriptions", timeout=60).status_code == 401
    assert httpx.get(f"{locked}/health", timeout=60).status_code == 200
    right = openai.OpenAI(base_url=f"{locked}/v1", api_key=KEY, timeout=120, max_retries=0)
    for call in calls:
        call(right)
    assert httpx.get(f"{locked}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
