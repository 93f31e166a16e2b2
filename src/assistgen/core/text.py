"""Incremental detokenization and stop strings.

Contract: `TextStream` turns generated token ids into text deltas that are safe to show: it holds
back an incomplete UTF-8 character and any tail that could still become a stop string, and when a
stop string appears it reports where to cut (the stop string itself is never emitted).
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.text = ""  # decoded text of the tokens accepted so far (cut at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, new_tokens: list[int]) -> int:
        """Append tokens; return how many of them to keep (fewer when a stop string completed)."""
        if not self.stop:
            self.tokens.extend(new_tokens)
            self.text = self._decode()
            return len(new_tokens)
        longest = max(len(s) for s in self.stop)
        for j, token in enumerate(new_tokens):
            before = len(self.text)
            self.tokens.append(token)
            self.text = self._decode()
            window_start = max(0, before - longest + 1)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return j + 1
        return len(new_tokens)

    def delta(self, final: bool = False) -> str:
        """The text not yet emitted that can be shown now (everything, when final or stopped)."""
        end = len(self.text)
        if not (final or self.stopped):
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete multi-byte character; wait for its other bytes
            end -= self._stop_prefix_tail(self.text[:end])
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _stop_prefix_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
