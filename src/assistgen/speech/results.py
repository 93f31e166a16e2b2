"""What a transcription gives: its windows, each with the segments it kept, and their text and statistics.

Contract: plain records. A `Transcription` holds its `Window`s in order; a window holds its decoder prompt, what it
generated, the target's log-probabilities where asked for, and its `Segment`s (with timestamps: the stretches between
the model's timestamp pairs; without: the window itself). Times are in seconds from the audio's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from assistgen.stats import Stats


@dataclass
class Segment:
    """A stretch of speech between two timestamps the model predicted (or a window without timestamps)."""

    start_s: float
    end_s: float
    token_ids: list[int]  # its tokens, timestamps included, the end token not
    text: str



@dataclass
class Window:
    """One window's decoding: its time span, the decoder prompt, the generated ids and their statistics."""

    start_s: float
    end_s: float
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: Stats
    logprobs: list[float] | None = None  # each generated token's log-probability under the target (when asked for)
    language: str | None = None  # the language it was decoded in
    seek: int = 0  # its first mel frame
    frames: int = 0  # the mel frames it reads from `seek` (of audio, or of padding where the audio is shorter)
    segments: list[Segment] = field(default_factory=list)  # what it kept: with timestamps, the segments between
    # them (`split_segments`; `text` is theirs, `token_ids` all it generated); without, the window itself

    @property
    def avg_logprob(self) -> float | None:
        """The mean log-probability of the generated tokens, the end token included (Whisper's avg_logprob)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else None



@dataclass
class Transcription:
    text: str
    language: str | None  # the language decoded in (given or detected); None for an English-only model
    duration_s: float
    windows: list[Window] = field(default_factory=list)
    timestamps: bool = False  # decoded with timestamps (asked for, or audio over 30 s): its segments are the model's

    @property
    def stats(self) -> Stats:
        combined = Stats.combined([w.stats for w in self.windows])
        combined.finish_reason = self.windows[-1].stats.finish_reason if self.windows else ""
        return combined

    @property
    def segments(self) -> list[Segment]:
        """Every window's segments, in order."""
        return [s for w in self.windows for s in w.segments]



