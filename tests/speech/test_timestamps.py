"""Whisper's timestamp rules (`whisper_rules.TimestampRules`) are transformers' processor, row by row."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

from assistgen.backends.torch.whisper_rules import TimestampRules

VOCAB, FIRST, EOS, BEGIN = 120, 100, 97, 3  # ids FIRST.. are timestamps; FIRST - 1 is <|notimestamps|>


@pytest.mark.parametrize("max_initial", [None, 5])
def test_the_rules_are_transformers_processor_on_every_row(max_initial):
    generation = SimpleNamespace(no_timestamps_token_id=FIRST - 1, eos_token_id=EOS, bos_token_id=EOS,
                                 max_initial_timestamp_index=max_initial)
    rules = TimestampRules(FIRST, EOS, max_initial)
    processor = WhisperTimeStampLogitsProcessor(generation, begin_index=BEGIN)
    rng, cases = random.Random(0), 0
    for trial in range(400):
        tokens = [rng.choice([rng.randrange(EOS), rng.randrange(FIRST, VOCAB), FIRST + 2])
                  for _ in range(rng.randrange(9))]
        scale = rng.choice([1.0, 4.0, 12.0])  # (from flat rows to peaked ones: both sides of the probability rule)
        logits = torch.randn(len(tokens) + 1, VOCAB, generator=torch.Generator().manual_seed(trial)) * scale
        want = torch.cat([processor(torch.tensor([[0, 1, 2] + tokens[:i]]), logits[i: i + 1].clone())
                          for i in range(len(tokens) + 1)])  # one row at a time, as generate() decodes
        got = rules.apply(logits.clone(), [tokens[:i] for i in range(len(tokens) + 1)])  # a verification's rows
        assert torch.equal(got, want), (tokens, max_initial)
        cases += int(torch.isinf(want[:, :FIRST]).all(-1).any())  # a row where only a timestamp may come
    assert cases > 50


def test_rows_of_the_decoder_prompt_are_left_alone():
    rules = TimestampRules(FIRST, EOS, None)
    logits = torch.randn(2, VOCAB)
    got = rules.apply(logits.clone(), [None, []])
    assert torch.equal(got[0], logits[0])
    assert torch.isinf(got[1, :FIRST]).all()  # the first generated token is a timestamp


def test_segments_and_seeking_are_transformers_own():
    """`split_segments` against transformers' `_retrieve_segment` on random windows of timestamps and text, of every
    length (a window shorter than 3000 frames ends its last segment where transformers' float32 arithmetic does)."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    from assistgen.speech.longform import split_segments

    class Decoder:  # (what split_segments asks of a tokenizer)
        @staticmethod
        def decode(ids, skip_special_tokens):
            return " ".join(map(str, ids))

    rng = random.Random(1)
    for _ in range(600):
        tokens, time = [], FIRST + rng.randrange(3)
        for _ in range(rng.randrange(1, 12)):
            if rng.random() < 0.35:
                time += rng.randrange(3)
                tokens.append(min(time, VOCAB - 1))
            else:
                tokens.append(rng.randrange(EOS))
        frames, seek = rng.choice([3000, rng.randrange(1, 3000)]), rng.randrange(0, 9000)
        segments, advance = split_segments(tokens + [EOS], FIRST, seek, frames, Decoder, EOS)
        want, want_advance = WhisperGenerationMixin._retrieve_segment(
            seek_sequence=torch.tensor(tokens), seek_outputs=[None],
            time_offset=torch.tensor([seek], dtype=torch.float64) * 0.02 / 2, timestamp_begin=FIRST,
            seek_num_frames=torch.tensor([frames]), time_precision=0.02, time_precision_features=0.01, input_stride=2,
            prev_idx=0, idx=0, return_token_timestamps=False, decoder_input_ids=torch.zeros(1, 3, dtype=torch.long))
        assert advance == int(want_advance), (tokens, frames)
        assert [(s.token_ids, s.start_s, s.end_s) for s in segments] == \
            [(w["tokens"].tolist(), float(w["start"]), float(w["end"])) for w in want], (tokens, frames, seek)
