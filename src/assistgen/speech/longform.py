"""transformers' sequential long-form decoding: windows cut into segments at timestamp pairs, seeking on from the
last pair.

Contract: `sequential(decoding, audio, ...)` decodes 30 s windows from frame 0 until the audio's frames are covered,
each with Whisper's timestamp rules; `split_segments` cuts a window's tokens as transformers does (at each pair of
consecutive timestamps; a window ending on a single timestamp holds no speech after it, otherwise decoding seeks to
the last pair), to the last bit of its arithmetic; `previous_tokens` is the earlier text a conditioned window's
decoder prompt holds. Windows always move on.
"""

from __future__ import annotations

import torch

from assistgen.speech.results import Segment, Window
from assistgen.speech.windows import Audio, Decoding

FEATURE_S = 0.01  # a mel frame's time step (transformers' `time_precision_features`)
TIMESTAMP_S = 0.02  # a timestamp token's time step (`time_precision`)
FRAMES_PER_TIMESTAMP = 2  # the encoder's input stride: mel frames per timestamp step


def split_segments(tokens: list[int], first: int, seek: int, frames: int, tokenizer,
                   eos: int) -> tuple[list[Segment], int]:
    """(the segments of a window decoded with timestamps, the frames to seek on by), as transformers' long-form
    decoding cuts them: at each pair of consecutive timestamps; a window that ends with a single timestamp holds no
    speech after it (all its frames are done), otherwise the text after the last pair is dropped and decoding
    seeks to that pair; without pairs the whole window is one segment, up to its last timestamp."""
    if tokens and tokens[-1] == eos:
        tokens = tokens[:-1]
    stamp = [t >= first for t in tokens]
    offset = seek * TIMESTAMP_S / FRAMES_PER_TIMESTAMP  # (transformers' arithmetic, to the last bit)
    single_ending = stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]

    def segment(begin: int, end: int, first_stamp: int | None, last_stamp: int) -> Segment:
        piece = tokens[begin:end]
        start = offset + (0.0 if first_stamp is None else (first_stamp - first) * TIMESTAMP_S)
        return Segment(start, offset + (last_stamp - first) * TIMESTAMP_S, piece,
                       tokenizer.decode(piece, skip_special_tokens=True))

    if not cuts:
        stamps = [t for t in tokens if t >= first]
        last = stamps[-1] if stamps and stamps[-1] != first else \
            first + int(torch.tensor(frames) * FEATURE_S / TIMESTAMP_S)  # (in float32, as transformers computes it)
        return [segment(0, len(tokens), None, last)], frames
    if single_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # (the pair's closing timestamp stays in the last segment)
    segments, begin = [], 0
    for i, cut in enumerate(cuts):
        closing = -1 if i < len(cuts) - 1 or single_ending else -2
        segments.append(segment(begin, cut, tokens[begin], tokens[begin:cut][closing]))
        begin = cut
    return segments, frames if single_ending else (tokens[begin - 2] - first) * FRAMES_PER_TIMESTAMP



def previous_tokens(kept: list[list[int]], first: int, limit: int) -> list[int]:
    """The earlier text a window is conditioned on: the segments so far (of a segment that ends with a pair of
    timestamps, all but the last), their last `limit` tokens."""
    joined = [t for tokens in kept for t in (tokens[:-1] if len(tokens) > 2 and tokens[-2] >= first else tokens)]
    return joined[-limit:]



def sequential(decoding: Decoding, source: Audio, language: str | None, earlier: list[int],
               conditioned: bool) -> list[Window]:
    """transformers' sequential long-form decoding (see the contract): the windows, each with its segments."""
    speech = decoding.speech
    first = speech.first_timestamp
    kept: list[list[int]] = [earlier] if earlier else []  # the segments' tokens so far (the prompt first)
    windows, seek = [], 0
    while seek < source.frames:
        previous = previous_tokens(kept, first, speech.context_length // 2 - 1) if conditioned and kept else earlier
        window = decoding.window(source, seek, language, previous, timestamps=True)
        language = window.language
        window.segments, advance = split_segments(window.token_ids, first, seek, window.frames, speech.tokenizer,
                                                  speech.end_token)
        window.text = "".join(segment.text for segment in window.segments)
        kept.extend(segment.token_ids for segment in window.segments)
        windows.append(window)
        seek += max(advance, 1)  # (a window always moves on)
    return windows



