"""Whisper's rules on its decoder's logits, as transformers' `generate()` applies them.

Contract: `suppression(speech, vocab, device)` gives the boolean masks of a `speech.SpeechModel`'s suppressed tokens
(its generation config's `suppress_tokens`, -inf on every row, and `begin_suppress_tokens`, -inf on the row that
predicts the first generated token). `TimestampRules` applies Whisper's timestamp rules after them to rows of logits,
each row judged on the generated tokens before it only, so a verification pass's rows are those a
one-token-at-a-time decoding would have seen. Both read the speech model's generation config and nothing else of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def suppression(speech, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [vocab] masks of the tokens suppressed everywhere and at the first generated position."""
    always, first = torch.zeros(vocab, dtype=torch.bool), torch.zeros(vocab, dtype=torch.bool)
    always[[t for t in (speech.generation.suppress_tokens or []) if t < vocab]] = True
    first[[t for t in (speech.generation.begin_suppress_tokens or []) if t < vocab]] = True
    return always.to(device), first.to(device)


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp rules, as transformers' `WhisperTimeStampLogitsProcessor` applies them to a row of logits
    (after the suppression) given the generated tokens before it: <|notimestamps|> never; timestamps come in pairs
    (after one timestamp that follows text, only a timestamp or the end; after two, no timestamp); they never decrease,
    and one that closes a pair may repeat the opening one but no other may repeat; the first token is a timestamp, at
    most `max_initial` steps in; and where the timestamps together are more likely than the likeliest text token, only a
    timestamp."""

    first: int  # the first timestamp token, <|0.00|> (<|notimestamps|> + 1); every later id is a timestamp
    eos: int  # the end token: the text tokens are the ids below it
    max_initial: int | None  # the latest timestamp the first generated token may be (None: any)

    @classmethod
    def of(cls, speech) -> TimestampRules:
        """A `speech.SpeechModel`'s rules (its generation config's)."""
        generation = speech.generation
        return cls(speech.first_timestamp, int(generation.eos_token_id),
                   getattr(generation, "max_initial_timestamp_index", None))

    def apply(self, logits: torch.Tensor, generated: list[list[int] | None]) -> torch.Tensor:
        """logits [rows, vocab] float32, in place; generated[i]: the generated tokens before row i (None: a row of the
        decoder prompt, left as it is: those come first)."""
        judged = next((i for i, seq in enumerate(generated) if seq is not None), len(generated))
        if judged == len(generated):
            return logits
        view, inf = logits[judged:], float("-inf")  # [rows judged, vocab]
        for row, seq in zip(view, generated[judged:], strict=True):
            text, other, lowest, highest = self.bounds(seq, row.shape[-1])
            if not text:
                row[: self.eos if other else self.first] = inf
            row[self.first - 1] = inf  # <|notimestamps|>
            row[self.first: lowest] = inf
            row[highest:] = inf
        logprobs = torch.log_softmax(view, dim=-1)
        timestamp = logprobs[:, self.first:].logsumexp(-1) > logprobs[:, : self.first].amax(-1)  # [rows judged]
        for i in timestamp.nonzero().flatten().tolist():  # (the rows where only a timestamp may come)
            view[i, : self.first] = inf
        return logits

    def bounds(self, seq: list[int], vocab: int) -> tuple[bool, bool, int, int]:
        """(text allowed, the other ids below the timestamps allowed, the lowest timestamp allowed, the one after the
        highest) for the row after `seq`."""
        first = self.first
        if not seq:  # the first token: a timestamp, at most `max_initial` steps in
            return False, False, first, vocab if self.max_initial is None else min(vocab, first + self.max_initial + 1)
        last = seq[-1] >= first
        penultimate = len(seq) < 2 or seq[-2] >= first
        if last and penultimate:  # a pair just closed (or the first token was a timestamp): text or the end next
            return True, True, first, first
        latest = next((t for t in reversed(seq) if t >= first), None)
        if last:  # a pair just opened: its closing timestamp (the same time, or later) or the end next
            return False, True, latest, vocab
        return True, True, first if latest is None else latest + 1, vocab  # (no timestamp earlier than the last one)

