"""Predicted Outputs on the server: `prediction` on chat completions is drafted from (on a server started without
any drafting too), changes no answer, and `usage.completion_tokens_details` counts the accepted and rejected
prediction tokens; a malformed prediction is a 400 naming it. The real `assistgen serve` and the official `openai`
client; no mocks."""

from __future__ import annotations

import openai
import pytest
from helpers import start_serve_command, stop_serve_command

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
CODE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly, and nothing else.\n\n{CODE}"}]


@pytest.fixture(scope="module")
def plain_server():
    process, port = start_serve_command("--model", NAME, "--max-tokens-limit", "64")  # no drafting asked for
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", timeout=120, max_retries=0)
    stop_serve_command(process)


def ask(c: openai.OpenAI, **extra):
    return c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=64, temperature=0, **extra)


def test_the_prediction_is_drafted_from_and_changes_nothing(plain_server):
    plain = ask(plain_server)
    assert plain.usage.completion_tokens_details is None  # (no prediction: no counts)
    drafted = plain.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert drafted == 0  # a server without drafting drafts nothing by itself
    answer = plain.choices[0].message.content
    predicted = ask(plain_server, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    metrics = predicted.model_extra["metrics"]["speculative_decoding"]
    assert metrics["num_accepted_draft_tokens"] >= plain.usage.completion_tokens // 2
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= plain.usage.completion_tokens - 2
    assert details.rejected_prediction_tokens <= 2
    parts = ask(plain_server, prediction={"type": "content", "content": [{"type": "text", "text": answer[:40]},
                                                                          {"type": "text", "text": answer[40:]}]})
    assert parts.choices[0].message.content == answer
    wrong = ask(plain_server, prediction={"type": "content", "content": "Something else entirely. " * 5})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0


def test_a_streamed_answer_counts_the_prediction_in_its_usage(plain_server):
    answer = ask(plain_server).choices[0].message.content
    events = plain_server.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=64, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  prediction={"type": "content", "content": answer})
    text, usage = [], None
    for event in events:
        if event.choices:
            text.append(event.choices[0].delta.content or "")
        usage = event.usage or usage
    assert "".join(text) == answer
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_malformed_prediction_is_a_400_naming_it(plain_server):
    for bad in ({"type": "file", "content": "x"}, {"type": "content"}, {"type": "content", "content": 3}):
        with pytest.raises(openai.BadRequestError, match="prediction"):
            ask(plain_server, prediction=bad)
