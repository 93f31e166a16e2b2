"""The batched loop: one forward pass over several sequences' rows (ragged), `engine.step` over a batch, the
row-sharing policy, and `BatchEngine` (joining between steps, chunked prefill, cancellation)."""

from __future__ import annotations

import pytest
import torch
from helpers import encode, tiny_gemma3, tiny_gpt2, tiny_llama

from assistgen import Constant
from assistgen.backends.torch.cache import KVCache, feed_together
from assistgen.backends.torch.quantize import quantize
from assistgen.backends.torch.transforms import optimize
from assistgen.config import GenerationConfig
from assistgen.core.engine import begin, step, stream
from assistgen.drafters.base import NoDrafter
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.policy.adaptive import Adaptive
from assistgen.policy.gain import expected_tokens, lookahead
from assistgen.serving.batching import BatchEngine, EngineSettings, QueueFull

ARCHS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "gemma3": tiny_gemma3}
TEXTS = ["the cat sat on the mat and the cat sat on the mat and the",
         "one two three one two three one two three one two",
         "a b c d e f g a b c d e f g a b c",
         "Sliding windows must roll back exactly: sliding windows must roll back exactly: sliding",
         "hello world, hello world, hello",
         "x"]


@pytest.mark.parametrize("arch", ARCHS)
def test_feed_together_equals_a_full_forward_per_sequence(arch, one_thread):
    """Uneven prefills, a rolled-back draft, then rows of different counts in one pass: each sequence's logits are
    the full uncached forward's (gemma3: sequences longer than its sliding window of 16)."""
    model = ARCHS[arch]()
    seqs = [encode(t) for t in TEXTS[:4]]
    with torch.inference_mode():
        full = [model.hf(torch.tensor([s])).logits[0].float() for s in seqs]  # [len, vocab] each
    caches = [KVCache(model) for _ in seqs]
    cuts = [10, 3, 7, 20]
    feed_together([(c, s[:n], 1) for c, s, n in zip(caches, seqs, cuts, strict=True)])
    feed_together([(c, [5, 6, 7], 3) for c in caches])  # a draft, rejected:
    for c, n in zip(caches, cuts, strict=True):
        c.crop(n)
    rows = [1, 4, 2, 30]
    got = feed_together([(c, s[n:n + r], r) for c, s, n, r in zip(caches, seqs, cuts, rows, strict=True)])
    for g, f, n, r in zip(got, full, cuts, rows, strict=True):
        torch.testing.assert_close(g, f[n:n + r], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_rows_are_bitwise_the_same_alone_or_in_a_batch(scheme, one_thread):
    model = tiny_llama()
    quantize(model, scheme)
    model.quantization = scheme
    optimize(model)
    seqs = [encode(t) for t in TEXTS[:3]]
    alone = []
    for s in seqs:
        c = KVCache(model)
        c.feed(s[:8])
        alone.append(c.feed(s[8:12], logits_to_keep=4))
    caches = [KVCache(model) for _ in seqs]
    feed_together([(c, s[:8], 1) for c, s in zip(caches, seqs, strict=True)])
    together = feed_together([(c, s[8:12], 4) for c, s in zip(caches, seqs, strict=True)])
    for a, t in zip(alone, together, strict=True):
        assert torch.equal(a, t)


def run_batch(model, prompts, drafter, schedule, config, max_batch=8, prefill_budget=None) -> tuple[list, int]:
    """Every prompt through `step` with at most `max_batch` at once (the rest join as others finish); returns each
    one's tokens and the largest batch stepped."""
    waiting = list(enumerate(prompts))
    running, out, largest = [], [None] * len(prompts), 0
    while waiting or running:
        while waiting and len(running) < max_batch:
            i, p = waiting.pop(0)
            running.append((i, begin(model, p, drafter(), schedule, config), []))
        largest = max(largest, len(running))
        for (_, _, tokens), chunk in zip(running, step([s for _, s, _ in running], prefill_budget), strict=True):
            if chunk is not None:
                tokens.extend(chunk.tokens)
        for i, s, tokens in running:
            if s.finish is not None:
                out[i] = tokens
        running = [r for r in running if r[1].finish is None]
    return out, largest


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_in_a_batch_equals_alone(arch, one_thread):
    """Six prompts, four at a time, prompts fed in chunks of 5 beside decoding rows, prompt lookup drafting with the
    cost-aware policy sharing rows: every sequence is what it is alone, and drafting happened."""
    model = ARCHS[arch]()
    prompts = [encode(t) for t in TEXTS]
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=())
    alone = [[t for c in stream(model, p, PromptLookupDrafter(), Adaptive(), config) for t in c.tokens]
             for p in prompts]
    plain = [[t for c in stream(model, p, NoDrafter(), Adaptive(), config) for t in c.tokens] for p in prompts]
    assert alone == plain
    batched, largest = run_batch(model, prompts, PromptLookupDrafter, Adaptive(), config, max_batch=4,
                                 prefill_budget=5)
    assert largest == 4
    assert batched == alone
    drafted = begin(model, prompts[0], PromptLookupDrafter(), Constant(3), config)
    while drafted.finish is None:
        step([drafted])
    assert drafted.stats.drafted_tokens > 0


def test_sampling_in_a_batch_keeps_each_request_stream(one_thread):
    """With a fixed lookahead, a seeded sampled sequence draws the same tokens whatever runs beside it: every
    request has its own sampler."""
    model = tiny_llama()
    prompts = [encode(t) for t in TEXTS[:4]]
    configs = [GenerationConfig(max_new_tokens=20, temperature=1.0, seed=s, eos_token_ids=()) for s in range(4)]
    alone = [[t for c in stream(model, p, PromptLookupDrafter(), Constant(3), cfg) for t in c.tokens]
             for p, cfg in zip(prompts, configs, strict=True)]
    seqs = [begin(model, p, PromptLookupDrafter(), Constant(3), cfg) for p, cfg in zip(prompts, configs, strict=True)]
    tokens = [[] for _ in seqs]
    while any(s.finish is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish is None]
        for i, chunk in zip(live, step([seqs[i] for i in live]), strict=True):
            if chunk is not None:
                tokens[i].extend(chunk.tokens)
    assert tokens == alone
    assert sum(s.stats.drafted_tokens for s in seqs) > 0


def test_lookahead_drafts_only_where_the_step_gains():
    rates = [[0.9], [0.2], [0.6]]
    limits = [5, 5, 5]
    flat = lookahead(rates, limits, lambda rows: 1.0, fixed_rows=3)  # rows are free: verify everything
    assert flat == limits
    linear = lookahead(rates, limits, lambda rows: rows / 3, fixed_rows=3)  # every row costs a full share
    assert linear == [0, 0, 0]
    curve = lambda rows: 1.0 + 0.1 * max(0, rows - 3)  # noqa: E731 - a cheap row each
    chosen = lookahead(rates, limits, curve, fixed_rows=3)
    assert chosen[0] >= chosen[2] >= chosen[1]  # likelier drafts get more rows

    def rate(k):
        return sum(expected_tokens(r, n) for r, n in zip(rates, k, strict=True)) / curve(3 + sum(k))

    assert rate(chosen) >= max(rate([0, 0, 0]), rate(limits))
    assert lookahead([], [], curve, fixed_rows=4) == []


def test_engine_joins_cancels_and_refuses_past_its_queue(one_thread):
    model = tiny_llama()
    engine = BatchEngine(model, PromptLookupDrafter, Adaptive(), EngineSettings(max_batch=2, max_queue=2,
                                                                                prefill_budget=4))
    config = GenerationConfig(max_new_tokens=30, eos_token_ids=())
    requests = [engine.submit(encode(t), config) for t in TEXTS[:2]]
    with pytest.raises(QueueFull, match="max_queue"):
        engine.submit(encode(TEXTS[2]), config)
    engine.start()
    first = next(iter(requests[0]))
    requests[0].cancel()
    rest = list(requests[0])
    assert (rest[-1] if rest else first).finish_reason == "cancelled"
    out = [t for c in requests[1] for t in c.tokens]
    assert out == [t for c in stream(model, encode(TEXTS[1]), PromptLookupDrafter(), Adaptive(), config)
                   for t in c.tokens]
    late = engine.submit(encode(TEXTS[3]), config)
    assert [c.finish_reason for c in late][-1] == "length"
    engine.shutdown(timeout=30)
    assert not engine.thread.is_alive() and engine.num_running == 0


def test_each_chunk_carries_its_stats_as_they_were_when_it_was_delivered(one_thread):
    """The engine thread keeps updating a generation's `Stats`; what crosses to the consumer is a snapshot per chunk,
    never the live object."""
    model = tiny_llama()
    engine = BatchEngine(model, PromptLookupDrafter, Constant(3)).start()
    try:
        chunks = list(engine.submit(encode(TEXTS[0]), GenerationConfig(max_new_tokens=20, eos_token_ids=())))
    finally:
        engine.shutdown(timeout=30)
    assert len(chunks) > 2
    emitted = 0
    for chunk in chunks:
        emitted += len(chunk.tokens)
        assert chunk.stats.new_tokens == emitted  # as it stood then, not as the engine left it
    assert len({id(chunk.stats) for chunk in chunks}) == len(chunks)
    assert [chunk.stats.finish_reason for chunk in chunks] == [""] * (len(chunks) - 1) + ["length"]


def test_submit_admits_on_the_callers_thread(one_thread):
    """A prompt the engine cannot run is refused by `submit` itself (nothing queued); the engine's context is its
    target's and its drafters' declared one."""
    from assistgen.api import drafter_factory
    from assistgen.core.admission import PromptError

    model = tiny_llama()
    engine = BatchEngine(model, drafter_factory(model, lookup=True), Adaptive())
    assert engine.context == model.context_length == 512
    config = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    for prompt, problem in (([], "empty"), ([2] * 512, "context length is 512"), ([10**6], "vocabulary")):
        with pytest.raises(PromptError, match=problem):
            engine.submit(prompt, config)
    assert engine.num_waiting == 0
    admitted = engine.admit(encode(TEXTS[4]), config)
    assert admitted.room == 512 - len(encode(TEXTS[4])) and admitted.grammar is None
    request = engine.submit(admitted)
    engine.start()
    try:
        assert [t for c in request for t in c.tokens] == [t for c in stream(model, encode(TEXTS[4]),
                                                                            PromptLookupDrafter(), Adaptive(),
                                                                            config) for t in c.tokens]
    finally:
        engine.shutdown(timeout=30)


def test_pass_costs_follow_the_measured_curve_past_one_sequence(one_thread):
    from assistgen.policy.costs import calibrate, known_costs
    from assistgen.policy.measurement import WIDE_ROWS

    model = tiny_llama()
    assert known_costs(model) is None  # nothing measured yet, and reading measures nothing
    costs = calibrate(model)
    record = costs.record
    v = record["verification_costs"]
    assert known_costs(model) is costs  # kept in the cost book
    assert [costs.rows(n) for n in range(1, len(v) + 1)] == v
    assert [costs.rows(n) for n in WIDE_ROWS] == pytest.approx(record["wide_costs"])
    between = costs.rows((WIDE_ROWS[-2] + WIDE_ROWS[-1]) // 2)
    assert min(record["wide_costs"][-2:]) <= between <= max(record["wide_costs"][-2:])
    slope = (record["wide_costs"][-1] - record["wide_costs"][-2]) / (WIDE_ROWS[-1] - WIDE_ROWS[-2])
    assert costs.rows(2 * WIDE_ROWS[-1]) == pytest.approx(record["wide_costs"][-1] + slope * WIDE_ROWS[-1])


def test_prefill_budget_is_shared_earliest_first_in_aligned_chunks(one_thread):
    from assistgen.core.engine import PROMPT_ALIGN, prefill_rows

    model = tiny_llama()
    config = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    texts = ("abcdef", "ghijklmnop" * 4, "qrs")
    seqs = [begin(model, encode(t), NoDrafter(), Adaptive(), config) for t in texts]
    need = [len(s.ids) for s in seqs]  # the pass that ends a prompt feeds its last token and emits the first
    budget = need[0] + PROMPT_ALIGN + 1
    plan = prefill_rows(seqs, budget)
    # the second's chunk does not end its prompt, so it is cut to a multiple of PROMPT_ALIGN; the third waits
    assert [len(plan.get(id(s), [])) for s in seqs] == [need[0], PROMPT_ALIGN, 0]
    assert sum(map(len, prefill_rows(seqs, None).values())) == sum(need)
    assert prefill_rows(seqs[1:], 5) == {id(seqs[1]): seqs[1].ids[:5]}  # a budget below it still feeds one
    chunks = step(seqs, budget)  # the first ends its prompt and emits its first token, the others do not yet
    assert len(chunks[0].tokens) == 1 and chunks[1:] == [None, None]
    assert [len(s.cache) for s in seqs] == [need[0], PROMPT_ALIGN, 0]
    chunks = step(seqs, need[1] - PROMPT_ALIGN)  # the first decodes, the second ends its prompt, the third waits
    assert chunks[0] is not None and len(chunks[1].tokens) == 1 and chunks[2] is None
    assert [len(s.cache) for s in seqs][1:] == [need[1], 0]


def test_a_server_starts_on_provisional_costs_and_measures_them_while_idle(tmp_path, monkeypatch, one_thread):
    """`calibrate(later=True)` with nothing on disk: a provisional curve now, the full measurement run by the
    engine between requests (a request that arrives drops the stage half done) and saved; the next start reads it."""
    import json
    import time

    from assistgen.policy.costs import calibrate, costs_state, known_costs, pending
    from assistgen.policy.gain import MAX_K
    from assistgen.policy.measurement import QUICK_ROWS

    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr("assistgen.backends.measure.CONTENDED", 1.0)  # saved however busy the machine (the gate:
    model = tiny_llama()  # tests/policy/test_quiet_measurement.py)
    model.cache_key = "tiny-later"
    provisional = calibrate(model, later=True)
    assert provisional.record["provisional"] and costs_state(model) == "measuring"
    mine = lambda: [c for c in pending() if c.model is model]  # noqa: E731  (other tests' models may still wait)
    assert len(mine()) == 1 and not list(tmp_path.glob("costs/*.json"))
    assert len(provisional.curve) == MAX_K + 1 and provisional.curve[0] == 1.0
    timed = {n: provisional.curve[n - 1] for n in QUICK_ROWS}  # each row count priced at the next timed one up
    assert all(c == timed[min(r for r in QUICK_ROWS if r >= n)] for n, c in enumerate(provisional.curve, 1))
    calibration = mine()[0]
    for _ in range(3):
        assert calibration.advance()
    calibration.interrupt()  # a request came: the first stage is dropped, to be timed from its start
    assert calibration.current is None and calibration.results == [] and mine() == [calibration]

    engine = BatchEngine(model, PromptLookupDrafter, Adaptive(), EngineSettings(max_batch=2)).start()
    config = GenerationConfig(max_new_tokens=12, eos_token_ids=())
    request = engine.submit(encode(TEXTS[0]), config)  # (served while the measurement waits or is dropped)
    assert [t for c in request for t in c.tokens] == [
        t for c in stream(model, encode(TEXTS[0]), PromptLookupDrafter(), Adaptive(), config) for t in c.tokens]
    deadline = time.monotonic() + 120
    while mine() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mine() and costs_state(model) == "measured"
    files = list(tmp_path.glob("costs/*.json"))
    measured = known_costs(model)
    assert len(files) == 1 and json.loads(files[0].read_text()) == measured.record
    assert measured.record["verification_costs"][0] == 1.0 and len(measured.curve) == MAX_K + 1
    late = engine.submit(encode(TEXTS[1]), config)  # the engine still serves after measuring
    assert [c.finish_reason for c in late][-1] == "length"
    engine.shutdown(timeout=30)

    again = tiny_llama()
    again.cache_key = "tiny-later"
    assert calibrate(again, later=True).record == measured.record and all(c.model is not again for c in pending())


def test_an_engine_times_only_its_own_models_and_never_while_another_serves_on_them(tmp_path, monkeypatch, one_thread):
    """Two servers in one process: an engine measures the pending costs of the models it runs only, and no engine
    times a pass of a model while another one serves requests on it (`Calibration.hold`)."""
    import time

    from assistgen.policy.costs import calibrate, pending

    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model, other = tiny_llama(seed=0), tiny_llama(seed=1)
    model.cache_key, other.cache_key = "tiny-held", "tiny-other"
    calibrate(model, later=True)
    calibration = pending([model])[0]
    assert pending([other]) == [] and calibration in pending()
    elsewhere = BatchEngine(other, NoDrafter, Adaptive(), EngineSettings(max_batch=2)).start()
    time.sleep(1.0)  # idle: it would time a pass within one wait
    assert calibration.current is None and calibration.results == []  # not its model
    elsewhere.shutdown(timeout=30)

    calibration.hold("server B")  # another engine serves requests on the model
    assert calibration.advance("server A") and calibration.current is None  # nothing timed
    assert not calibration.free_for("server A") and calibration.free_for("server B")
    calibration.release("server B")
    assert calibration.advance("server A") and calibration.current is not None  # now it times
    calibration.abandon()


def test_two_engines_on_one_model_measure_it_once_both_are_idle(tmp_path, monkeypatch, one_thread):
    """Both engines serve requests on the model (each holds its measurement off), then both go idle: the
    measurement is then run and saved, by one of them."""
    import time

    from assistgen.policy.costs import calibrate, costs_state, pending

    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr("assistgen.backends.measure.CONTENDED", 1.0)  # (as above: measured, then saved)
    model = tiny_llama(seed=0)
    model.cache_key = "tiny-shared"
    calibrate(model, later=True)
    engines = [BatchEngine(model, PromptLookupDrafter, Adaptive(), EngineSettings(max_batch=2)).start()
               for _ in range(2)]
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=())
    requests = [e.submit(encode(text), config) for e in engines for text in TEXTS[:2]]
    for r in requests:
        assert [c.finish_reason for c in r][-1] == "length"
    deadline = time.monotonic() + 120
    while pending([model]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pending([model]) and costs_state(model) == "measured"
    for e in engines:
        e.shutdown(timeout=30)
