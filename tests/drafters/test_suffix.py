"""Suffix drafting (`drafters/suffix.py`): the longest earlier match of the tail wins over the most recent short one,
continuations are voted by frequency, sequences never run into each other, the history is bounded and kept per
namespace, and drafting from it gives plain decoding's tokens."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import encode, tiny_llama

from assistgen import ConfigError, generate
from assistgen.drafters.lookup import lookup_continuation, lookup_draft
from assistgen.drafters.suffix import SEPARATOR, SuffixDrafter, SuffixHistory, history_for, suffix_continuation
from assistgen.policy.rules import Constant

NONE = np.zeros(0, dtype=np.int64)


def draft(sequence: list[int], k: int = 8, earlier=NONE) -> tuple[list[int], int]:
    return suffix_continuation(np.asarray(earlier, dtype=np.int64), np.asarray(sequence, dtype=np.int64), k, 32)


def test_the_longest_match_wins_over_the_most_recent_short_one():
    # "1 2 3" ends the sequence; it occurs twice before: after "5" (4 tokens matched: 5 1 2 3) and, more recently,
    # after "0" (3 tokens). Prompt lookup takes the most recent 3-gram; suffix drafting the longer match.
    sequence = [5, 1, 2, 3, 4, 6, 6, 6, 0, 1, 2, 3, 7, 8, 6, 5, 1, 2, 3]
    assert draft(sequence, 5) == ([4, 6, 6, 6, 0], 4)
    assert lookup_continuation(sequence, 5, 3, 1) == ([7, 8, 6, 5, 1], 3)


def test_a_lookup_draft_is_named_by_how_far_its_match_runs():
    """Prompt lookup's source tells a fresh 3-token match from a copy that has run for many tokens (acceptance is
    tracked per source: a long run is far likelier to go on); the draft itself is the most recent match's."""
    fresh = [5, 1, 2, 3, 4, 6, 6, 6, 0, 1, 2, 3]  # "1 2 3" matched, preceded by 5 there and 0 here: a run of 3
    assert lookup_draft(fresh, 2, 3, 1).source == "lookup:3"
    assert lookup_draft(fresh, 2, 3, 1).tokens == lookup_continuation(fresh, 2, 3, 1)[0] == [4, 6]
    text = list(range(10, 50))
    copying = text + [7] + text[:20]  # the sequence repeats the first 20 tokens of the text: a run of 20
    assert lookup_draft(copying, 4, 3, 1).source == "lookup:16"  # (runs past 3 in powers of two: 16-31)
    assert lookup_draft(copying, 4, 3, 1).tokens == text[20:24]
    assert lookup_draft(text + [7] + text, 4, 3, 1).source == "lookup:32"  # a run of 40: the longest told apart
    assert lookup_draft([1, 2, 3], 4, 3, 1).source == "lookup:0" and not lookup_draft([1, 2, 3], 4, 3, 1).tokens


def test_continuations_are_voted_by_frequency_then_recency():
    # "9" occurs 3 times before the tail's last token: followed by 1 twice and 2 once -> 1, then only those agree.
    sequence = [9, 1, 5, 9, 2, 7, 9, 1, 5, 3, 9]
    assert draft(sequence, 3) == ([1, 5, 3], 1)  # then "9" or "3" once each: the most recent occurrence's
    tie = [9, 1, 5, 9, 2, 6, 9]  # one each: the most recent occurrence's token
    assert draft(tie, 1) == ([2], 1)


def test_earlier_sequences_are_searched_and_never_run_into_each_other():
    earlier = [4, 5, 6, 7, 8, SEPARATOR, 1, 2, 3, SEPARATOR]
    assert draft([0, 5, 6], 4, earlier) == ([7, 8], 2)  # stops at the end of that sequence
    assert draft([2, 3], 4, earlier) == ([], 0)  # the match's continuation is a separator
    assert draft([1, 2], 4, earlier) == ([3], 2)
    assert draft([42], 4, earlier) == ([], 0) and draft([1, 2, 3], 0) == ([], 0)


def test_the_history_is_bounded_and_kept_per_namespace():
    history = SuffixHistory(max_tokens=10)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    history.add([9, 10])
    assert len(history) <= 11 and history.text().tolist()[-3:] == [9, 10, SEPARATOR]
    assert 1 not in history.text().tolist()  # the oldest was dropped
    assert history_for("alice") is history_for("alice") is not history_for("bob")
    drafter = SuffixDrafter(history_for("carol"))
    drafter.finish([3, 1, 4, 1, 5, 9, 2, 6])
    assert drafter.propose([7, 1, 5], 3, None).tokens == [9, 2, 6]  # carol's earlier request
    assert SuffixDrafter(history_for("dave")).propose([7, 1, 5], 3, None).tokens == []  # not dave's
    with pytest.raises(ValueError):
        SuffixHistory(max_tokens=0)
    with pytest.raises(ConfigError, match="suffix"):
        generate(tiny_llama(), encode("abc"), suffix=3)


def test_drafting_from_suffixes_gives_plain_decodings_tokens_and_drafts():
    model = tiny_llama()
    ids = encode("abcabcabcabcab" * 3)
    plain = generate(model, ids, max_new_tokens=30).token_ids
    for kwargs in ({"suffix": True, "schedule": Constant(5)}, {"suffix": "erin", "lookup": True}):
        ours = generate(model, ids, max_new_tokens=30, **kwargs)
        assert ours.token_ids == plain
        assert ours.stats.mode.startswith("suffix")
    assert generate(model, ids, max_new_tokens=30, suffix=True, schedule=Constant(5)).stats.accepted_tokens > 0


def test_prompt_lookup_takes_the_longest_n_gram_then_the_most_recent_match():
    """Against the definition, on random sequences of a small vocabulary (many matches of every length): n from
    max_ngram down, the most recent earlier occurrence of the last n tokens, and what followed it."""
    rng = np.random.default_rng(0)

    def reference(seq, k, max_ngram, min_ngram):
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
            starts = [s for s in range(len(seq) - n) if seq[s : s + n] == seq[len(seq) - n :]]
            if starts:
                return seq[starts[-1] + n : starts[-1] + n + k], n
        return [], 0

    for _ in range(300):
        seq = rng.integers(0, int(rng.integers(2, 9)), int(rng.integers(1, 40))).tolist()
        k, low = int(rng.integers(0, 6)), int(rng.integers(1, 3))
        high = low + int(rng.integers(0, 3))
        assert lookup_continuation(seq, k, high, low) == (reference(seq, k, high, low) if k else ([], 0))
