"""Universal assisted generation: an assistant with a different tokenizer.

Greedy exactness against transformers with two genuinely different tokenizers, translation units
for each boundary case, and lossless speculative sampling across vocabularies (chi-squared).
"""

from __future__ import annotations

import pytest
from helpers import hf_greedy, small_tokenizer
from mixed_tokenizers import HARD_TEXTS, byte_bpe, sentencepiece_bpe, tiny_model

from assistgen import Constant, generate
from assistgen.drafters.universal import AssistantContext, TextBridge, VocabIntersection, strip_partial, token_bytes

PAIRS = {
    "bpe-target/sp-assistant": (byte_bpe, sentencepiece_bpe),
    "sp-target/bpe-assistant": (sentencepiece_bpe, byte_bpe),
}


# ---------------------------------------------------------------- translation units


def splits_of(tokenizer, text: str):
    """Every token-level split of text's encoding: (target ids so far, the text still to come)."""
    ids = tokenizer(text)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    for j in range(1, len(ids)):
        head = strip_partial(tokenizer.decode(ids[:j], skip_special_tokens=False))
        assert whole.startswith(head)
        yield ids[:j], whole[len(head):], whole


@pytest.mark.parametrize("case", list(HARD_TEXTS))
@pytest.mark.parametrize("make", [byte_bpe, sentencepiece_bpe], ids=["byte-bpe", "sentencepiece"])
def test_draft_text_reencoded_for_the_target_spells_the_same_text(make, case):
    """At every split, even inside a multi-byte character, the translated tokens continue the text exactly."""
    tok = make()
    bridge = TextBridge(tok, tok)
    found = total = 0
    for ids, rest, whole in splits_of(tok, HARD_TEXTS[case]):
        new = bridge.to_target(ids, rest)
        total += 1
        if new:
            found += 1
            assert strip_partial(tok.decode(ids + new, skip_special_tokens=False)) == strip_partial(whole)
    assert found >= 0.8 * total  # translation gives up (proposes nothing) only at odd boundaries


@pytest.mark.parametrize("case", list(HARD_TEXTS))
def test_canonical_tokens_come_back_when_the_boundary_is_clean(case):
    """Splitting a canonical encoding and translating the rest reproduces the canonical tokens."""
    tok = byte_bpe()
    bridge = TextBridge(tok, tok)
    ids = tok(HARD_TEXTS[case])["input_ids"]
    hits = sum(bridge.to_target(head, rest) == ids[len(head):] for head, rest, _ in splits_of(tok, HARD_TEXTS[case]))
    assert hits >= 0.8 * (len(ids) - 1)


def test_leading_space_markers_map_to_the_same_bytes():
    bpe, sp = byte_bpe(), sentencepiece_bpe()
    bpe_bytes, sp_bytes = token_bytes(bpe), token_bytes(sp)
    g_dog, u_dog = bpe.convert_tokens_to_ids("Ġdog"), sp.convert_tokens_to_ids("▁dog")
    assert bpe_bytes[g_dog] == sp_bytes[u_dog] == b" dog"
    assert sp_bytes[sp.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert bpe_bytes[bpe.convert_tokens_to_ids("Ċ")] == b"\n"
    assert bpe_bytes[bpe.convert_tokens_to_ids("<|im_start|>")] is None  # special tokens are left out
    assert sp_bytes[sp.bos_token_id] is None


def test_vocabulary_intersection_is_one_to_one_by_bytes():
    bpe, sp = byte_bpe(), sentencepiece_bpe()
    inter = VocabIntersection.build(bpe, sp)  # target bpe, assistant sp
    assert 0 < inter.size < min(len(bpe), len(sp))
    assert len(set(inter.target_ids.tolist())) == inter.size == len(set(inter.assistant_ids.tolist()))
    tb, ab = token_bytes(bpe), token_bytes(sp)
    assert all(tb[t] == ab[a] for t, a in zip(inter.target_ids.tolist(), inter.assistant_ids.tolist(), strict=False))


def test_assistant_context_drops_target_special_tokens_and_adds_its_bos_once():
    bpe, sp = byte_bpe(), sentencepiece_bpe()
    bridge = TextBridge(bpe, sp)
    ids = bpe.apply_chat_template([{"role": "user", "content": "Perché? 😀"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    a = bridge.to_assistant(ids)
    assert a[0] == sp.bos_token_id and a.count(sp.bos_token_id) == 1
    assert "im_start" not in sp.decode(a) and "Perché? 😀" in sp.decode(a)


def test_partial_character_is_held_back_both_ways():
    sp, bpe = sentencepiece_bpe(), byte_bpe()
    bridge = TextBridge(bpe, sp)
    emoji = bpe("Ok 🚀")["input_ids"]
    partial = emoji[:-1]  # ends inside the rocket's four bytes
    assert bpe.decode(partial).endswith("\ufffd")
    assert sp.decode(bridge.to_assistant(partial), skip_special_tokens=True) == "Ok "  # partial character held back
    # a draft that ends inside a character gives only the complete characters
    a_ctx = sp("Ok")["input_ids"]
    rocket = sp(" 🚀", add_special_tokens=False)["input_ids"]
    assert bridge.draft_text(a_ctx, rocket) == " 🚀"
    assert bridge.draft_text(a_ctx, rocket[:-1]) in ("", " ")


class Counting:
    """A tokenizer that records how many characters it encodes and how many tokens it decodes per call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded, self.decoded = tokenizer, [], []

    def __call__(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tokenizer(text, **kwargs)

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_assistant_context_grows_at_bounded_cost_and_spells_the_same_text(pair):
    """Fed a growing sequence token by token, the incremental context spells exactly the text the whole
    re-encoding spells, while each call decodes and encodes only a bounded tail."""
    make_target, make_assistant = PAIRS[pair]
    target, assistant = Counting(make_target()), Counting(make_assistant())
    text = " ".join(HARD_TEXTS.values()) * 3
    ids = target.tokenizer(text)["input_ids"]
    bridge = TextBridge(target, assistant)
    context = AssistantContext(bridge, tail_chars=24)
    for n in range(1, len(ids) + 1):
        target.decoded.clear(), assistant.encoded.clear()
        got = context(ids[:n])
        work = (max(target.decoded, default=0), max(assistant.encoded, default=0))
        want = TextBridge(target.tokenizer, assistant.tokenizer).to_assistant(ids[:n])
        spell = lambda a: assistant.tokenizer.decode(a, skip_special_tokens=True)  # noqa: E731
        if target.tokenizer.decode(ids[:n]).endswith("\ufffd"):  # a byte-fallback decode spoils a whole run of
            assert spell(got).startswith(spell(want)), f"after {n} tokens"  # bytes: the full decode may drop more
        else:
            assert spell(got) == spell(want), f"after {n} tokens"
        if n > 1:
            assert work[0] <= 16, f"decoded {work[0]} target tokens for one new token"
            assert work[1] <= 3 * 24 + 16, f"encoded {work[1]} characters for one new token"
    assert context.cut > 0 and context.frozen  # the cut moved: most of the text was encoded once


def test_to_target_decodes_a_bounded_tail():
    tok = Counting(byte_bpe())
    bridge = TextBridge(tok, tok.tokenizer)
    ids = tok.tokenizer(" ".join(HARD_TEXTS.values()) * 4)["input_ids"]
    assert bridge.to_target(ids, " the end")
    assert max(tok.decoded) <= 5 * bridge.look_behind + 8 < len(ids)


def test_bos_inside_the_window_is_not_added_again():
    bpe, sp = byte_bpe(), sentencepiece_bpe()
    bridge = TextBridge(sp, bpe)  # target sentencepiece (adds <s>), assistant byte-level
    ids = sp("Hi")["input_ids"]
    assert ids[0] == sp.bos_token_id
    new = bridge.to_target(ids, " there")
    assert sp.bos_token_id not in new and sp.decode(ids + new, skip_special_tokens=True) == "Hi there"


# ---------------------------------------------------------------- greedy exactness


@pytest.fixture(scope="module", params=list(PAIRS))
def mixed_pair(request):
    make_target, make_assistant = PAIRS[request.param]
    return tiny_model(make_target(), seed=0), tiny_model(make_assistant(), seed=1)


@pytest.mark.parametrize("case", list(HARD_TEXTS))
def test_universal_greedy_matches_transformers(mixed_pair, case):
    target, assistant = mixed_pair
    ids = target.tokenizer(HARD_TEXTS[case])["input_ids"]
    out = generate(target, ids, assistant=assistant, max_new_tokens=30, eos_token_ids=(), schedule=Constant(4))
    assert out.stats.mode == "universal"
    assert out.stats.draft_forward_passes > 0
    assert out.token_ids == hf_greedy(target, ids, 30)


def test_universal_greedy_with_a_chat_template():
    target, assistant = tiny_model(byte_bpe(), seed=0), tiny_model(sentencepiece_bpe(), seed=1)
    out = generate(target, "Perché la città è così bella? 😀", assistant=assistant, chat=True, max_new_tokens=24,
                   eos_token_ids=(), schedule=Constant(3))
    ids = out.prompt_ids
    assert target.tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert out.token_ids == hf_greedy(target, ids, 24)


# ---------------------------------------------------------------- lossless sampling across vocabularies


@pytest.fixture(scope="module")
def small_mixed():
    """Target: single letters a-h. Assistant: other ids, a merged 'ab', and no 'h' at all."""
    target_tok = small_tokenizer(list("abcdefgh"), [])
    assistant_tok = small_tokenizer(list("gfedcba") + ["ab"], [("a", "b")])
    target = tiny_model(target_tok, seed=0, layers=1, hidden=32, scale=0.15)
    assistant = tiny_model(assistant_tok, seed=5, layers=1, hidden=32, scale=0.15)
    return target, assistant


def test_small_vocabularies_intersect_partially(small_mixed):
    target, assistant = small_mixed
    inter = VocabIntersection.build(target.tokenizer, assistant.tokenizer)
    assert inter.size == 7  # a..g; 'ab' and 'h' are outside


@pytest.mark.parametrize("settings", [pytest.param({"temperature": 1.0}, marks=pytest.mark.slow), pytest.param(
    {"temperature": 0.8, "top_k": 6, "top_p": 0.95}, marks=pytest.mark.slow)],
                         ids=["t1", "t0.8-topk6-topp0.95"])
def test_universal_sampling_is_lossless(small_mixed, settings, one_thread):
    from test_sampling import assert_lossless, exact_distribution, sample

    target, assistant = small_mixed
    prompt = target.tokenizer("abcab")["input_ids"]
    counts, checks = sample(target, 3000, assistant=assistant, schedule=Constant(3), prompt=prompt, **settings)
    exact = exact_distribution(target, prompt=prompt, **settings)
    assert_lossless(counts, checks, exact)
    h = target.tokenizer.convert_tokens_to_ids("h")
    later = tuple(range(1, exact.dim()))  # (every position after the first)
    if float(exact.sum(later)[h]) > 0.01:  # a token outside the intersection still comes out first
        assert counts.sum(later)[h] > 0


def test_universal_sampling_reports_intersection_and_mass(small_mixed):
    target, assistant = small_mixed
    out = generate(target, "abcab", assistant=assistant, max_new_tokens=20, temperature=1.0, seed=0, eos_token_ids=(),
                   schedule=Constant(2))
    assert out.stats.mode == "universal"
    assert out.stats.notes["vocab_intersection"] == 7
    assert 0.0 < out.stats.notes["target_mass_in_intersection"] <= 1.0
    assert out.stats.drafted_tokens > 0
