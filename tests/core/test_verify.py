"""A step's verification reads the device once, greedy and sampled, and the eager draws change no token.

The reads are counted on the torch backend with a `TorchFunctionMode`: every conversion of a tensor to a Python value
(`tolist`, `item`, `int()`, `float()`, `bool()`, `numpy`, `cpu`) while `engine.step` runs, except inside the seams
it calls (the target's forward pass, a drafter's proposal) and the CPU generator's uniforms (host randomness, never on
a device)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import encode, tiny_llama
from torch.overrides import TorchFunctionMode

import assistgen.core.verify as verify
from assistgen import Constant
from assistgen.config import GenerationConfig
from assistgen.core.engine import begin, step
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.spec.sampling import Sampler

READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def paused(counter: CountReads, fn):
    def call(*args, **kwargs):
        counter.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.paused -= 1
    return call


def reads_per_step(monkeypatch, target, drafters, config_of, texts) -> tuple[list[int], list]:
    counter = CountReads()
    monkeypatch.setattr(target, "feed_together", paused(counter, target.feed_together))
    monkeypatch.setattr(Sampler, "uniform", paused(counter, Sampler.uniform))
    states = [begin(target, encode(text), drafter, Constant(3), config_of(i))
              for i, (text, drafter) in enumerate(zip(texts, drafters, strict=True))]
    for drafter in drafters:
        monkeypatch.setattr(drafter, "propose", paused(counter, drafter.propose))
    per_step = []
    while any(s.finish is None for s in states):
        running = [s for s in states if s.finish is None]
        before = counter.reads
        with counter:
            emitted = any(chunk is not None for chunk in step(running))  # (the pass that ends a prompt emits too)
        per_step.append((emitted, counter.reads - before))
    return per_step, states


TEXTS = ["abc abc abc abc abc abc", "the cat the cat the cat", "one two one two one two"]


def test_a_greedy_batch_reads_the_device_once_per_step(monkeypatch):
    target = tiny_llama(seed=0)
    drafters = [PromptLookupDrafter() for _ in TEXTS]
    per_step, states = reads_per_step(monkeypatch, target, drafters,
                                      lambda i: GenerationConfig(max_new_tokens=24, eos_token_ids=()), TEXTS)
    assert sum(s.stats.drafted_tokens for s in states) > 0  # it verified drafts, several rows per generation
    assert all(reads == (1 if emitted else 0) for emitted, reads in per_step), per_step


@pytest.mark.parametrize("eager", [True, False])
def test_a_sampled_batch_reads_once_per_step_with_the_draws_made_beforehand(monkeypatch, eager):
    monkeypatch.setattr(verify, "EAGER", eager)
    target, assistant = tiny_llama(seed=0), tiny_llama(seed=1)
    drafters = [AssistantDrafter(assistant, target) for _ in TEXTS[:2]]

    def config(i):
        return GenerationConfig(max_new_tokens=20, eos_token_ids=(), temperature=0.9, top_p=0.95, seed=10 + i)

    per_step, states = reads_per_step(monkeypatch, target, drafters, config, TEXTS[:2])
    assert all(s.stats.drafted_tokens > 0 for s in states)
    emitting = [reads for emitted, reads in per_step if emitted]
    if eager:
        assert all(reads == 1 for reads in emitting), per_step
    else:  # on the CPU the stop token is drawn after the read, one more each (no device to wait for there; a step
        # whose drafts are all empty, judged by keyed draws, reads only those)
        assert all(1 <= reads <= 1 + len(TEXTS[:2]) for reads in emitting), per_step
        assert sum(reads > 1 for reads in emitting) > len(emitting) // 2


def test_eager_draws_give_the_lazy_tokens_and_leave_the_generators_alike(monkeypatch):
    """Random p and q, each seed verified lazily and eagerly: the same accepted count and token, and the same next
    draws after (the generators left in the same state), with q given, one-hot (by the rejection rule, and by keyed
    draws where the position is known), a zero q at a draft token, and a forbidden token judged at the end."""
    rng = random.Random(0)
    vocab = 12
    for case in range(300):
        n = rng.randint(0, 4)
        g = torch.Generator().manual_seed(case)
        p_logits = torch.randn(n + 1, vocab, generator=g) * 2
        q = torch.softmax(torch.randn(n + 1, vocab, generator=g) * 2, -1) if rng.random() < 0.7 else None
        tokens = [rng.randrange(vocab) for _ in range(n)]
        if q is not None and n and rng.random() < 0.2:
            i = rng.randrange(n)
            q[i, tokens[i]] = 0.0  # (a draft token its drafter gave no probability)
        forbidden = rng.randrange(vocab) if rng.random() < 0.3 else None
        config = GenerationConfig(temperature=rng.choice([0.5, 1.0, 1.5]), seed=case)
        results = []
        for eager in (False, True):
            monkeypatch.setattr(verify, "EAGER", eager)
            sampler = Sampler(config)
            judged_q = None if q is None else q[: n + (forbidden is not None)]
            job = verify.Verification(p_logits, tokens, sampler, judged_q, forbidden, case if case % 2 else None)
            verdict = verify.verify_all([job])[0]
            after = (sampler.uniform(), int(torch.multinomial(torch.ones(vocab), 3, generator=sampler.generator)[0]))
            results.append((verdict.accepted, verdict.token, after))
        assert results[0] == results[1], (case, results)


def test_the_race_draws_what_multinomial_draws_and_leaves_the_generator_alike():
    """`verify.race` (argmax of p over exponentials) against `torch.multinomial(p, 1)`: the same token from the same
    state, and the same state after, over random distributions with and without zeros."""
    for seed in range(500):
        g = torch.Generator().manual_seed(seed)
        vocab = int(torch.randint(2, 300, (), generator=g))
        p = torch.softmax(torch.randn(vocab, generator=g) * 3, -1)
        if seed % 3 == 0:
            p[torch.randperm(vocab, generator=g)[: vocab // 2]] = 0.0
            p = p / p.sum()
        one, other = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert int(torch.multinomial(p, 1, generator=one)) == int(verify.race(p[None], other)[0])
        assert torch.equal(one.get_state(), other.get_state())
