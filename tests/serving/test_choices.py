"""n > 1 and best_of: a prompt's choices run as sibling engine requests, one feeding the prompt and the others starting
from a fork of its cache (`BatchEngine.submit(sibling=...)`), choice j drawing with seed + j; each choice equals the
single request with that seed, on both backends and through the server with the official `openai` client; best_of
answers the candidates with the highest log-probability per token; bad values are 400s naming the field. Real models,
the real app; no mocks."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import assert_error, start, stop

from assistgen import Constant, load_model
from assistgen.api import make_drafter
from assistgen.config import GenerationConfig
from assistgen.serving.batching import BatchEngine, EngineSettings

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"
PROMPT = "List five colours, one per line, then say which you like best and why."
DRAFTING = Constant(k=4)  # drafts verified in every step, so the siblings speculate too


@pytest.fixture(scope="module")
def smol_llama():
    """As `assistgen serve` loads it: prompts on the row-exact kernels, cells kept beside the context."""
    return load_model("smollm2-135m", backend="llama.cpp", exact_prompts=True, kept_bytes="auto")


def outputs(engine: BatchEngine, requests) -> list[tuple[list[int], int]]:
    """(tokens, cached prompt tokens) of each request, once finished."""
    out = []
    for request in requests:
        chunks = list(request)
        assert chunks[-1].finish_reason in ("length", "eos"), request.error
        out.append(([t for c in chunks for t in c.tokens], chunks[-1].stats.cached_tokens))
    return out


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_siblings_start_from_the_first_ones_prefill_and_each_equals_its_single_run(backend, smollm2, request):
    model = smollm2 if backend == "torch" else request.getfixturevalue("smol_llama")
    ids = model.tokenizer(PROMPT)["input_ids"]
    configs = [GenerationConfig(max_new_tokens=24, temperature=0.9, seed=40 + j) for j in range(3)]
    engine = BatchEngine(model, lambda: make_drafter(model, lookup=True), DRAFTING,
                         EngineSettings(max_batch=2)).start()  # (the third waits, then forks a running sibling)
    try:
        first = engine.submit(ids, configs[0])
        siblings = [first] + [engine.submit(ids, c, sibling=first) for c in configs[1:]]
        together = outputs(engine, siblings)
        alone = [outputs(engine, [engine.submit(ids, c)])[0] for c in configs]
    finally:
        engine.shutdown(timeout=60)
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert len({tuple(t) for t, _ in together}) > 1  # (the seeds differ: so do the samples)
    assert [c for _, c in together] == [0, len(ids) - 1, len(ids) - 1]  # the prompt fed once, the rest forked
    assert [c for _, c in alone] == [0, 0, 0]


@pytest.fixture(scope="module")
def server(smollm2, one_thread):
    # (the cost-aware policy, whose decisions batching changes: keyed draws keep each seed's sample the same)
    live = start(smollm2, EngineSettings(max_batch=4, max_queue=16), max_tokens_limit=64)
    yield live
    stop(live)


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="k", timeout=120, max_retries=0)


MESSAGES = [{"role": "user", "content": PROMPT}]


def test_chat_n_gives_each_seeds_single_answer_sharing_the_prompt(server):
    many = client(server).chat.completions.create(model=NAME, messages=MESSAGES, n=3, temperature=0.9, seed=11,
                                                  max_tokens=24)
    singles = [client(server).chat.completions.create(model=NAME, messages=MESSAGES, temperature=0.9, seed=11 + j,
                                                      max_tokens=24) for j in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in many.choices}) > 1
    prompt = singles[0].usage.prompt_tokens
    assert many.usage.prompt_tokens == 3 * prompt
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert many.usage.prompt_tokens_details.cached_tokens >= 2 * (prompt - 1)  # two siblings forked the first


def test_streamed_choices_equal_the_whole_reply(server):
    whole = client(server).chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_tokens=16)
    texts, roles = ["", ""], set()
    for event in client(server).chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_tokens=16,
                                                        stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert texts == [c.message.content for c in whole.choices]
    assert texts[0] == texts[1]  # greedy: n equal choices
    assert roles == {0, 1}


def test_completions_n_with_several_prompts_index_prompt_by_prompt(server):
    prompts = ["The capital of France is", "Two plus two is"]
    reply = client(server).completions.create(model=NAME, prompt=prompts, n=2, max_tokens=8, echo=True)
    singles = [client(server).completions.create(model=NAME, prompt=p, max_tokens=8).choices[0].text
               for p in prompts]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [prompts[i // 2] + singles[i // 2] for i in range(4)]


def test_best_of_answers_the_candidates_with_the_highest_logprob_per_token(server):
    prompt = "Once upon a time"
    for seed in range(5, 50, 4):  # (a seed whose best two candidates are not its first two: else answering the first
        # two would pass)
        candidates = [client(server).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.2,
                                                        seed=seed + j, logprobs=0).choices[0] for j in range(4)]
        means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
        order = sorted(range(4), key=lambda j: means[j], reverse=True)
        if order[:2] != [0, 1]:
            break
    assert order[:2] != [0, 1]
    best = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.2, seed=seed,
                                             n=2, best_of=4)
    assert [c.text for c in best.choices] == [candidates[j].text for j in order[:2]]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)  # every candidate's


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"n": 17}, "n"),  # (more than the server queues: --max-queue 16)
    ({"prompt": ["a", "b", "c"], "n": 6}, "n"),
])
def test_bad_choice_counts_are_400s_naming_the_field(server, body, param):
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "Hi", **body}, timeout=30),
                 400, param)


def test_the_responses_api_refuses_n(server):
    assert_error(httpx.post(f"{server.url}/v1/responses", json={"model": NAME, "input": "Hi", "n": 2}, timeout=30),
                 400, "n")
