"""The sampling set on the server, sent by the official `openai` client (vLLM's fields through `extra_body`):
each field's greedy answer is plain decoding's with the same setting (the library's `generate` without drafting),
though the server drafts (prompt lookup); `guided_choice` answers one of the choices; a value out of range is a 400
naming the field. The real app over SmolLM2; no mocks."""

from __future__ import annotations

import openai
import pytest
from helpers import start, stop

from assistgen import generate

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
PROMPT = "the cat sat on the mat. " * 4 + "the cat"
FIELDS = {  # (the request's fields, the library's settings)
    "frequency+presence": ({"frequency_penalty": 1.5, "presence_penalty": 1.0},
                           {"frequency_penalty": 1.5, "presence_penalty": 1.0}),
    "logit_bias": ({"logit_bias": {"28": 10}}, {"logit_bias": {28: 10}}),
    "repetition_penalty": ({"extra_body": {"repetition_penalty": 1.6}}, {"repetition_penalty": 1.6}),
    "min_p": ({"temperature": 1.0, "seed": 7, "extra_body": {"min_p": 1.0}}, {}),  # (only the likeliest: greedy)
    "bad_words": ({"extra_body": {"bad_words": ["mat"]}}, None),
    "min_tokens+ignore_eos": ({"extra_body": {"min_tokens": 20, "ignore_eos": True}},
                              {"min_tokens": 20, "ignore_eos": True}),
}


@pytest.fixture(scope="module")
def server(smollm2, one_thread):
    live = start(smollm2, max_tokens_limit=40)
    yield live
    stop(live)


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="k", timeout=120, max_retries=0)


@pytest.mark.parametrize("field", list(FIELDS))
def test_each_field_gives_plain_decodings_answer_with_it(server, smollm2, field):
    sent, settings = FIELDS[field]
    if settings is None:  # bad words: as the server tokenizes them
        from assistgen.core.processing import banned_sequences

        settings = {"bad_words": banned_sequences(smollm2.tokenizer, ["mat"])}
    reply = client(server).completions.create(model=NAME, prompt=PROMPT, max_tokens=40, **{"temperature": 0, **sent})
    plain = generate(smollm2, PROMPT, max_new_tokens=40, **settings)
    assert reply.choices[0].text == plain.text
    if field == "min_p":  # (without it, the same seed's sample is not the greedy answer)
        unfiltered = {k: v for k, v in sent.items() if k != "extra_body"}
        other = client(server).completions.create(model=NAME, prompt=PROMPT, max_tokens=40, **unfiltered)
        assert other.choices[0].text != plain.text
    elif field != "min_tokens+ignore_eos":
        assert plain.text != generate(smollm2, PROMPT, max_new_tokens=40).text
    if field == "bad_words":
        assert "mat" not in reply.choices[0].text


def test_the_server_drafted_while_honouring_a_penalty(server):
    reply = client(server).completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                              logit_bias={"28": 5})
    assert reply.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0


def test_guided_choice_answers_one_of_the_choices(server):
    reply = client(server).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}], max_tokens=8,
        temperature=0, extra_body={"guided_choice": ["yes", "no", "maybe (not sure)"]})
    assert reply.choices[0].message.content in ("yes", "no", "maybe (not sure)")


@pytest.mark.parametrize(("fields", "named"), [
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"28": 101}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"min_tokens": 100}}, "min_tokens"),
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"extra_body": {"bad_words": "mat"}}, "bad_words"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
])
def test_a_value_out_of_range_is_a_400_naming_the_field(server, fields, named):
    with pytest.raises(openai.BadRequestError, match=named):
        client(server).completions.create(model=NAME, prompt="Hi", max_tokens=8, **fields)
