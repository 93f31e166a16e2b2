"""Predicted Outputs (`drafters/prediction.py`): drafting from the caller's predicted text lines up again after an
insertion and after a deletion, prefers the place where the last draft began among equal matches, counts accepted
and rejected prediction tokens as OpenAI does, and never changes the output: greedy with a prediction (right,
partly right, unrelated) is token-identical to plain decoding on both backends, with drafts from the prediction
verified and kept."""

from __future__ import annotations

import numpy as np
import pytest

from assistgen import ConfigError, generate, load_model
from assistgen.drafters.prediction import Prediction, PredictionDrafter, aligned_continuation, prediction_usage


def align(predicted, output, cursor=0):
    return aligned_continuation(np.asarray(predicted), np.asarray(output), cursor, 32)


PREDICTED = list(range(100, 140))


def test_an_empty_output_starts_at_the_prediction_and_a_copy_goes_on_where_it_is():
    assert align(PREDICTED, []) == (0, 0)
    assert align(PREDICTED, PREDICTED[:7]) == (7, 7)


def test_after_an_insertion_the_output_lines_up_again_when_it_repeats_predicted_text():
    inserted = PREDICTED[:10] + [1, 2, 3]
    assert align(PREDICTED, inserted) == (None, 0)  # new text: nothing to draft
    assert align(PREDICTED, inserted + PREDICTED[10:12]) == (12, 2)


def test_after_a_deletion_the_output_lines_up_at_the_next_predicted_text_it_writes():
    assert align(PREDICTED, PREDICTED[:10] + PREDICTED[15:17]) == (17, 2)


def test_among_equal_matches_the_one_at_or_after_the_last_draft_wins():
    predicted = [7, 1, 2, 7, 3, 4, 7, 5, 6]  # "7" three times (a closing brace, a blank line)
    assert align(predicted, [9, 7], cursor=4) == (4, 1)  # the first at or after the cursor
    assert align(predicted, [9, 7], cursor=5) == (7, 1)
    assert align(predicted, [9, 7], cursor=0) == (1, 1)
    assert align(predicted, [9, 7], cursor=9) == (7, 1)  # none after: the last before


def test_the_drafter_drafts_from_the_output_only_and_names_its_source_by_the_match():
    prompt = PREDICTED[:20]  # the prompt holds the same text (the file being edited): never aligned on
    drafter = PredictionDrafter(Prediction(tuple(PREDICTED), len(prompt)))
    draft = drafter.propose(prompt + PREDICTED[:9], 4, None)
    assert draft.tokens == PREDICTED[9:13] and draft.source == "prediction:8"
    assert drafter.propose(prompt, 4, None).tokens == PREDICTED[:4]
    assert drafter.propose(prompt + PREDICTED, 4, None).tokens == []  # the prediction is used up
    assert drafter.propose(prompt + PREDICTED[:9] + [1, PREDICTED[3]], 4, None).tokens == []  # one token: no evidence
    assert drafter.propose(prompt + [PREDICTED[0]], 4, None).tokens == PREDICTED[1:5]  # (but the first is)


def test_usage_counts_the_predicted_tokens_that_appear_in_the_output():
    assert prediction_usage(PREDICTED, PREDICTED) == (40, 0)
    assert prediction_usage(PREDICTED, PREDICTED[:10] + [1, 2] + PREDICTED[15:]) == (35, 5)
    assert prediction_usage(PREDICTED, []) == (0, 40)


CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
ASK = f"Rename the parameter width to w in this code. Reply with the whole code only.\n\n{CODE}"


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_greedy_output_is_the_same_with_any_prediction_and_right_predictions_are_drafted(backend, smollm2):
    model = smollm2 if backend == "torch" else load_model("smollm2-135m", backend="llama.cpp")
    plain = generate(model, ASK, chat=True, max_new_tokens=80)
    right = generate(model, ASK, chat=True, max_new_tokens=80, prediction=plain.text)
    assert right.token_ids == plain.token_ids
    assert right.stats.accepted_tokens >= len(plain.token_ids) // 2  # (drafted from the prediction and kept)
    assert right.stats.steps < len(plain.token_ids) // 2
    for prediction in (CODE, "Nothing like the answer at all.", ""):
        assert generate(model, ASK, chat=True, max_new_tokens=80, prediction=prediction).token_ids == plain.token_ids
    with pytest.raises(ConfigError, match="prediction: token ids must be integers"):
        generate(model, ASK, chat=True, max_new_tokens=4, prediction=[-1])
