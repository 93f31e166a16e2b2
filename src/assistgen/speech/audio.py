"""Audio files as 16 kHz mono samples, decoded with PyAV (FFmpeg's decoders and resampler).

Contract: `read_audio(source, max_seconds)` takes a path, bytes, a binary file object or an array of 16 kHz mono
samples, and returns float32 samples in [-1, 1] at 16 kHz, mono. Anything it cannot use raises `AudioError`
naming the problem and the fix: an empty file, data that is not audio in a format FFmpeg reads, a file without
an audio stream, no samples, or audio longer than `max_seconds` (decoding stops once past it, so a long recording
costs no more than the limit).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
FORMATS = "flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav or webm"


class AudioError(ValueError):
    """Audio that cannot be transcribed; the message says why and what to send instead."""


def read_audio(source, max_seconds: float | None = None, name: str = "the audio") -> np.ndarray:
    """16 kHz mono float32 samples of `source` (see the module's contract)."""
    if isinstance(source, np.ndarray):
        samples = np.asarray(source, dtype=np.float32).reshape(-1)
    else:
        samples = decode(source, name, max_seconds)
    if samples.size == 0:
        raise AudioError(f"{name} holds no samples: send a recording with sound in it.")
    seconds = samples.size / SAMPLE_RATE
    if max_seconds is not None and seconds > max_seconds:
        raise too_long(name, f"{seconds:.1f}", max_seconds)
    return samples


def too_long(name: str, lasts: str, max_seconds: float) -> AudioError:
    return AudioError(f"{name} lasts {lasts} s, over the limit of {max_seconds:g} s: send a shorter recording, or "
                      "split it.")


def decode(source, name: str, max_seconds: float | None = None) -> np.ndarray:
    import av

    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise AudioError(f"{name}: {source} is not a file.")
        data = path.read_bytes()
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif hasattr(source, "read"):
        data = source.read()
    else:
        raise AudioError(f"{name} must be a file path, bytes, a binary file or an array of 16 kHz samples, not "
                         f"{type(source).__name__}.")
    if not data:
        raise AudioError(f"{name} is empty: send an audio file ({FORMATS}).")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError(f"{name} has no audio stream: send an audio file ({FORMATS}).")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            chunks, total = [], 0
            for frame in container.decode(audio=0):
                new = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
                chunks += new
                total += sum(c.size for c in new)
                if max_seconds is not None and total > max_seconds * SAMPLE_RATE:
                    stated = container.duration / av.time_base if container.duration else 0.0  # (the header's)
                    lasts = f"{stated:.1f}" if stated > max_seconds else f"more than {total / SAMPLE_RATE:.1f}"
                    raise too_long(name, lasts, max_seconds)
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except av.error.FFmpegError as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise AudioError(f"{name} is not audio in a format assistgen reads ({FORMATS}): FFmpeg says "
                         f"\"{reason}\".") from e
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
