"""Exact tests of the probability rules: enumerate every random choice, compare with p to float tolerance.

In the style of vLLM's rejection-sampler tests, but exact instead of sampled: `enumerate_outcomes`
runs a piece of code once per combination of its random choices, with a `ScriptedSampler` that
makes each choice from a script and multiplies the choice's probability into the path's weight.
`uniform()` returns a `Coin`, so `uniform() < a` branches into "accepted" (weight a) and
"rejected" (weight 1 - a) without drawing a number. Summing the weights of the paths gives the
output distribution exactly.

One verification step emits accepted + 1 tokens. To compare steps that emit different numbers of
tokens, every outcome is continued by the target's own distribution up to k + 1 tokens; the step is
lossless exactly when that joint distribution equals the target's joint distribution of k + 1 tokens.
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from functools import cache

import pytest
import torch
from helpers import broken_residual_from_p, char_tokenizer, small_tokenizer, tiny_llama
from mixed_tokenizers import tiny_model
from reference import verify, verify_speculative
from reference import verify_speculative as correct_verify

from assistgen.backends.torch.kept_head import keep_head
from assistgen.config import GenerationConfig, Structure
from assistgen.core.constraint import Constraint
from assistgen.core.sampling import Sampler
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.drafters.early_exit import EarlyExitDrafter
from assistgen.drafters.lookup import PromptLookupDrafter
from assistgen.drafters.universal import UniversalDrafter

TOLERANCE = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny-model forward passes


# ------------------------------------------------------------------------------------- enumeration


class Coin:
    """What `ScriptedSampler.uniform()` returns: `coin < a` is a choice with P(True) = a."""

    def __init__(self, sampler: ScriptedSampler):
        self.sampler = sampler

    def __lt__(self, threshold) -> bool:
        a = min(1.0, max(0.0, float(threshold)))
        outcomes = [(True, a), (False, 1.0 - a)]
        return self.sampler.choose([o for o in outcomes if o[1] > 0])


class ScriptedSampler:
    """A `Sampler` whose random choices follow `script`; choices past its end take the first option."""

    greedy = False

    def __init__(self, config: GenerationConfig, script: list[int]):
        self.processing = Sampler(config)
        self.script = list(script)
        self.options: list[int] = []  # how many options each choice had
        self.weight = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.processing.probs(logits)

    def choose(self, outcomes: list[tuple[object, float]]):
        position = len(self.options)
        if position == len(self.script):
            self.script.append(0)
        self.options.append(len(outcomes))
        value, probability = outcomes[self.script[position]]
        self.weight *= probability
        return value

    def draw(self, probs: torch.Tensor) -> int:
        support = torch.nonzero(probs > 0).flatten().tolist()
        return self.choose([(t, float(probs[t])) for t in support])

    def uniform(self) -> Coin:
        return Coin(self)


def enumerate_outcomes(run, config: GenerationConfig) -> dict:
    """{outcome: probability} of `run(sampler)` over every combination of the sampler's choices."""
    out: dict = defaultdict(float)
    pending = [[]]
    while pending:
        script = pending.pop()
        sampler = ScriptedSampler(config, script)
        out[run(sampler)] += sampler.weight
        for position in range(len(script), len(sampler.options)):  # the choices this path made first
            for alternative in range(1, sampler.options[position]):
                pending.append(sampler.script[:position] + [alternative])
    return dict(out)


# ------------------------------------------------------------------------------- the lossless check


def continued(outcomes: dict, length: int, p_of) -> dict:
    """Continue each emitted tuple with the target's distribution p_of(prefix) [vocab] up to `length` tokens."""
    out: dict = defaultdict(float)
    stack = list(outcomes.items())
    while stack:
        seq, w = stack.pop()
        if len(seq) >= length:
            out[seq[:length]] += w
            continue
        p = p_of(seq)
        for t in torch.nonzero(p > 0).flatten().tolist():
            stack.append((seq + (t,), w * float(p[t])))
    return dict(out)


def target_joint(length: int, p_of) -> dict:
    return continued({(): 1.0}, length, p_of)


def assert_same_distribution(got: dict, want: dict) -> None:
    assert abs(sum(got.values()) - 1.0) < TOLERANCE, f"probabilities sum to {sum(got.values())}"
    worst = max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))
    assert worst < TOLERANCE, f"output distribution differs from the target's by up to {worst:.3g}"


def step_distribution(propose, p_of, k: int, config: GenerationConfig) -> tuple[dict, dict]:
    """The distribution of k + 1 tokens when one speculative step (propose, then verify) starts them.

    propose(sampler) -> (tokens, q [n, vocab] or None). Returns (that distribution, {draft length: probability}).
    """
    lengths: dict = defaultdict(float)
    drafts = enumerate_outcomes(lambda s: _hashable(propose(s)), config)
    emitted: dict = defaultdict(float)
    for (tokens, q_rows), w in drafts.items():
        lengths[len(tokens)] += w
        q = None if q_rows is None else torch.tensor(q_rows)
        p = torch.stack([p_of(tokens[:i]) for i in range(len(tokens) + 1)])  # [n+1, vocab]
        verified = enumerate_outcomes(lambda s: verify_speculative(p, q, list(tokens), s), config)  # noqa: B023
        for (accepted, token), v in verified.items():
            emitted[tokens[:accepted] + (token,)] += w * v
    return continued(emitted, k + 1, p_of), dict(lengths)


def _hashable(draft) -> tuple:
    tokens, q = draft
    return tuple(tokens), None if q is None else tuple(tuple(row) for row in q.tolist())


# ----------------------------------------------------------- verify_speculative on synthetic p and q


def synthetic(vocab: int, seed: int, zeros: int = 0):
    """A distribution per prefix, [vocab]: random logits seeded by the prefix, `zeros` tokens masked out."""

    @cache
    def p_of(prefix: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, prefix)) % (1 << 31))
        logits = torch.randn(vocab, generator=g) * 1.5
        if zeros:
            logits[torch.randperm(vocab, generator=g)[:zeros]] = float("-inf")
        return torch.softmax(logits, -1)

    return p_of


def draw_chain(q_of, k: int):
    """The textbook proposal: x_i ~ q(. | x_<i) for i = 1..k."""

    def propose(sampler):
        tokens, rows = [], []
        for _ in range(k):
            q = q_of(tuple(tokens))
            rows.append(q)
            tokens.append(sampler.draw(q))
        return tokens, torch.stack(rows)

    return propose


SYNTHETIC = GenerationConfig(temperature=1.0)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("zeros", [0, 2], ids=["full-support", "disjoint-zeros"])
def test_verify_speculative_is_exact(k, zeros):
    p_of = synthetic(5, seed=1, zeros=zeros)
    q_of = synthetic(5, seed=2, zeros=zeros)  # zeros in other places: q has mass where p has none, and back
    got, _ = step_distribution(draw_chain(q_of, k), p_of, k, SYNTHETIC)
    assert_same_distribution(got, target_joint(k + 1, p_of))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_speculative_without_draft_probabilities_is_exact(k):
    """A drafter without q (prompt lookup): whatever tokens it proposes, the output is the target's."""
    p_of = synthetic(5, seed=3)
    fixed = lambda sampler: ([4, 0, 4][:k], None)  # noqa: E731
    unlikely = lambda sampler: ([int(p_of(()).argmin())] * k, None)  # noqa: E731
    for propose in (fixed, unlikely):
        got, _ = step_distribution(propose, p_of, k, SYNTHETIC)
        assert_same_distribution(got, target_joint(k + 1, p_of))


def broken_first_row(p, q, draft, sampler, rejected=None):
    """An indexing bug that only shows from the second draft position on: q's first row for every position."""
    return correct_verify(p, q[:1].expand(len(draft), -1), draft, sampler)


def draw_then_stop(q_of, k: int, threshold: float):
    """The old universal rule: draw a token, then stop when *its own* probability is under the threshold."""

    def propose(sampler):
        tokens, rows = [], []
        for _ in range(k):
            q = q_of(tuple(tokens))
            x = sampler.draw(q)
            if float(q[x]) < threshold:
                break
            tokens.append(x)
            rows.append(q)
        return tokens, torch.stack(rows) if rows else None

    return propose


def test_the_exact_test_detects_broken_rules(monkeypatch):
    """Each broken rule gives a distribution measurably different from p (so the tests above can fail)."""
    import test_rejection_exact as me

    p_of, q_of = synthetic(5, seed=1), synthetic(5, seed=2)
    want = target_joint(4, p_of)
    for broken in (broken_residual_from_p, broken_first_row):
        monkeypatch.setattr(me, "verify_speculative", broken)
        got, _ = step_distribution(draw_chain(q_of, 3), p_of, 3, SYNTHETIC)
        assert max(abs(got.get(s, 0) - want.get(s, 0)) for s in want) > 1e-3, broken.__name__
    monkeypatch.undo()
    got, _ = step_distribution(draw_then_stop(q_of, 1, threshold=0.3), p_of, 1, SYNTHETIC)
    assert max(abs(got.get(s, 0) - w) for s, w in target_joint(2, p_of).items()) > 1e-3


def test_the_issue_example_is_exact_with_the_stop_decided_on_q():
    """p = (.1, .6, .3), q = (.5, .2, .3), threshold .4: stopping on the drawn token's probability gives
    (.15, .7, .15); deciding on max q (which does not depend on the draw) gives p."""
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.2, 0.3])
    p_of = lambda prefix: p  # noqa: E731
    q_of = lambda prefix: q  # noqa: E731
    got, _ = step_distribution(draw_then_stop(q_of, 1, 0.4), p_of, 0, SYNTHETIC)
    first = {s: w for s, w in got.items()}
    assert [round(first[(t,)], 6) for t in range(3)] == [0.15, 0.7, 0.15]

    def stop_on_max(sampler):
        return ([], None) if float(q.max()) < 0.4 else ([sampler.draw(q)], q[None])

    got, _ = step_distribution(stop_on_max, p_of, 0, SYNTHETIC)
    assert_same_distribution(got, {(t,): float(p[t]) for t in range(3)})


# ------------------------------------------------------------------ each drafter's own proposal rule

TOKENIZER = char_tokenizer("abcd")  # 7 tokens with <bos>, <eos>, <pad>
SETTINGS = {
    "t1": GenerationConfig(temperature=1.0),
    "t0.7-topk4-topp0.9": GenerationConfig(temperature=0.7, top_k=4, top_p=0.9),
}


@pytest.fixture(scope="module")
def same_pair():
    target = tiny_llama(seed=0, layers=2, hidden=32, scale=0.25, tokenizer=TOKENIZER)
    assistant = tiny_llama(seed=3, layers=1, hidden=32, scale=0.25, tokenizer=TOKENIZER)
    return target, assistant


@pytest.fixture(scope="module")
def mixed_pair():
    """Target: letters a-h. Assistant: other ids, a merged 'ab', no 'h' (a partial intersection)."""
    target = tiny_model(small_tokenizer(list("abcdefgh"), []), seed=0, layers=1, hidden=32, scale=0.3)
    assistant = tiny_model(small_tokenizer(list("gfedcba") + ["ab"], [("a", "b")]), seed=5, layers=1, hidden=32,
                           scale=0.3)
    return target, assistant


def target_p_of(target, prompt: list[int], config: GenerationConfig, depth: int):
    """p(. | prompt + prefix) [vocab] for every prefix of up to `depth` tokens, processed with the generation's
    settings: one batched forward over all vocab**depth continuations reads every shorter prefix too."""
    vocab = target.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=depth))
    with torch.inference_mode():
        logits = target.hf(torch.tensor([prompt + list(x) for x in prefixes])).logits  # [vocab**depth, len, vocab]
    probs = Sampler(config).probs(logits[:, len(prompt) - 1 :].reshape(-1, vocab)).view(len(prefixes), depth + 1, -1)
    table = {}
    for x, rows in zip(prefixes, probs, strict=True):
        for j in range(depth + 1):
            table.setdefault(x[:j], rows[j])
    return table.__getitem__


def drafter_step(drafter, prompt: list[int], k: int, confidence: float):
    def propose(sampler):
        draft = drafter.propose(prompt, k, sampler, confidence)
        return draft.tokens, draft.probs

    return propose


def check_drafter(drafter, target, prompt, k, setting, confidence) -> dict:
    config = SETTINGS[setting]
    p_of = target_p_of(target, prompt, config, k)
    got, lengths = step_distribution(drafter_step(drafter, prompt, k, confidence), p_of, k, config)
    assert_same_distribution(got, target_joint(k + 1, p_of))
    return lengths


def cases(threshold: float) -> list[tuple[int, float]]:
    """k = 1..3, without and with a confidence stop (`threshold` lies inside the pair's range of max q)."""
    return [(k, c) for k in (1, 2, 3) for c in (0.0, threshold)]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("k", "confidence"), cases(0.35))
def test_assistant_proposal_is_exact(same_pair, k, confidence, setting):
    target, assistant = same_pair
    prompt = TOKENIZER("abcab")["input_ids"]
    lengths = check_drafter(AssistantDrafter(assistant, target), target, prompt, k, setting, confidence)
    assert lengths.get(k, 0) > 0  # full drafts happen
    if confidence and k == 3:
        assert sum(w for n, w in lengths.items() if n < k) > 0  # ... and so do drafts the confidence stop cut


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_an_assistant_with_a_kept_head_is_exact(same_pair, k, setting):
    """FR-Spec: the assistant's head keeps 4 of the 7 tokens, so its q is zero on the others (which the target
    still gives probability). Every draft token is a kept one, and the step's output is still exactly p."""
    target, assistant = same_pair
    pruned = copy.deepcopy(assistant)
    kept = [1, 3, 4, 6]  # <eos>, a, b, d
    keep_head(pruned, kept)
    prompt = TOKENIZER("abcab")["input_ids"]
    drafter = AssistantDrafter(pruned, target)
    seen = set()

    def propose(sampler):
        draft = drafter.propose(prompt, k, sampler, 0.0)
        seen.update(draft.tokens)
        assert draft.probs is None or float(draft.probs[:, [0, 2, 5]].abs().sum()) == 0.0
        return draft.tokens, draft.probs

    config = SETTINGS[setting]
    p_of = target_p_of(target, prompt, config, k)
    got, lengths = step_distribution(propose, p_of, k, config)
    assert_same_distribution(got, target_joint(k + 1, p_of))
    assert seen and seen <= set(kept) and lengths.get(k, 0) > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("k", "confidence"), cases(0.5))
def test_universal_proposal_is_exact(mixed_pair, k, confidence, setting):
    target, assistant = mixed_pair
    prompt = target.tokenizer("abcab")["input_ids"]
    lengths = check_drafter(UniversalDrafter(assistant, target), target, prompt, k, setting, confidence)
    assert lengths.get(k, 0) > 0
    if confidence and k == 3:
        assert sum(w for n, w in lengths.items() if n < k) > 0


@pytest.mark.parametrize(("k", "confidence"), cases(0.35))
def test_early_exit_proposal_is_exact(same_pair, k, confidence):
    target, _ = same_pair
    prompt = TOKENIZER("abcab")["input_ids"]
    check_drafter(EarlyExitDrafter(target, layers=1), target, prompt, k, "t1", confidence)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_lookup_proposal_is_exact(same_pair, k):
    target, _ = same_pair
    prompt = TOKENIZER("abcab")["input_ids"]
    lengths = check_drafter(PromptLookupDrafter(), target, prompt, k, "t1", 0.0)
    assert lengths.get(k, 0) == pytest.approx(1.0)


def test_old_universal_stop_rule_is_caught(mixed_pair, monkeypatch):
    """Put back the draw-then-stop rule in UniversalDrafter: the exact check fails."""
    import assistgen.drafters.universal as universal

    target, assistant = mixed_pair
    original = universal.UniversalDrafter._propose_sampled

    def draw_then_check(self, pending, k, sampler, min_confidence):
        draft = original(self, pending, k, sampler, 0.0)
        for i, token in enumerate(draft.tokens):
            if float(draft.probs[i, token]) < min_confidence:
                draft.tokens, draft.probs = draft.tokens[:i], draft.probs[:i] if i else None
                break
        return draft

    monkeypatch.setattr(universal.UniversalDrafter, "_propose_sampled", draw_then_check)
    prompt = target.tokenizer("abcab")["input_ids"]
    with pytest.raises(AssertionError, match="differs from the target"):
        check_drafter(UniversalDrafter(assistant, target), target, prompt, 2, "t1", 0.5)


# ------------------------------------------------------------------- grammar-constrained verification

STRUCTURE = Structure("regex", "[ab][cd][ab][cd][ab]")  # forbids most of what the assistant proposes


def masked_p_of(target, prompt: list[int], config: GenerationConfig):
    """p(. | prompt + prefix) [vocab] of the target with the grammar's mask applied before processing, as plain
    constrained decoding draws it."""

    @cache
    def p_of(prefix: tuple) -> torch.Tensor:
        constraint = Constraint.begin(target, STRUCTURE, {1})
        constraint.advance(list(prefix))
        constraint.check([])
        with torch.inference_mode():
            logits = target.hf(torch.tensor([prompt + list(prefix)])).logits[0, -1:]  # [1, vocab]
        return Sampler(config).probs(constraint.mask(logits))[0]

    return p_of


def constrained_step(drafter, target, prompt: list[int], k: int, judge_forbidden: bool):
    """One step as the loop makes it under a grammar: draft, cut at the first forbidden token, verify the rest on
    masked rows, the forbidden token judged as a rejection (or, `judge_forbidden` False, simply dropped)."""

    def run(sampler):
        draft = drafter.propose(prompt, k, sampler, 0.0)
        constraint = Constraint.begin(target, STRUCTURE, {1})
        m, forbidden = constraint.check(draft.tokens)
        with torch.inference_mode():
            logits = target.hf(torch.tensor([prompt + draft.tokens[:m]])).logits[0, len(prompt) - 1 :]  # [m+1, vocab]
        accepted, token, _ = verify(constraint.mask(logits), draft, m, sampler, forbidden if judge_forbidden else None)
        return tuple(draft.tokens[:accepted]) + (token,)

    return run


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_constrained_speculation_follows_the_masked_target(same_pair, k, setting):
    target, assistant = same_pair
    prompt = TOKENIZER("abcab")["input_ids"]
    config = SETTINGS[setting]
    p_of = masked_p_of(target, prompt, config)
    emitted = enumerate_outcomes(constrained_step(AssistantDrafter(assistant, target), target, prompt, k, True), config)
    assert_same_distribution(continued(emitted, k + 1, p_of), target_joint(k + 1, p_of))
    drafts = enumerate_outcomes(lambda s: tuple(AssistantDrafter(assistant, target).propose(prompt, k, s).tokens),
                                config)
    ends = set(target.eos_token_ids)  # (the assistant drafts k tokens, fewer only when an end token ends its draft;
    assert all(len(d) == k or d[-1] in ends for d in drafts) and any(len(d) == k for d in drafts)  # grammar or not)


def test_dropping_a_forbidden_draft_token_without_judging_it_is_caught(same_pair):
    target, assistant = same_pair
    prompt = TOKENIZER("abcab")["input_ids"]
    config = SETTINGS["t1"]
    p_of = masked_p_of(target, prompt, config)
    emitted = enumerate_outcomes(constrained_step(AssistantDrafter(assistant, target), target, prompt, 2, False),
                                 config)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_same_distribution(continued(emitted, 3, p_of), target_joint(3, p_of))
