"""Drafters: anything that proposes the next few tokens, behind one small interface.

Contract: a drafter implements
    propose(ids, k, sampler, min_confidence) -> Draft
        ids: the whole current sequence (prompt + emitted tokens); propose up to k *new* tokens
        that follow it, with the draft distribution q each was drawn from ([n, vocab] in the
        target's vocabulary) or None when there is none;
    observe(num_accepted, target_probs) -> None
        told how many of the last proposal's tokens the target accepted (and, when sampling, the
        target's distributions p at the verified positions, [k+1, vocab]; None when greedy);
    finish(ids) -> None
        told the whole sequence when the generation ends (a cache that learns across requests records it);
    report() -> dict
        drafter-specific figures for the statistics;
and the attributes
    name              what the statistics and the schedule call it (unique among a composite's parts);
    context_length    the longest sequence it can draft after (None when unbounded);
    model             the `Model` it runs, or None when it runs none (prompt lookup, the n-gram cache):
                      the adaptive policy sizes its cost per token from it;
    acceptance_prior  the acceptance rate expected before any draft is verified (early exit's
                      calibrated agreement), or None: the policy then starts from its own prior.
Drafters never see the target's cache and never decide acceptance; the generation loop in
`engine.py` does. Plain decoding is `NoDrafter`.
A model drafter keeps its tensors on its model's device (its `KVCache` makes ids there, and q rows
are made from its logits); `attempts` times each proposal with `timing.clock` on the device given.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from assistgen.cache import KVCache
from assistgen.models import Model
from assistgen.sampling import Sampler
from assistgen.timing import clock


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # [n] proposed continuation, n <= k
    probs: torch.Tensor | None = None  # [n, vocab] q for each token, or None
    forward_passes: int = 0  # drafter model forward passes spent on this proposal
    source: str = ""  # what produced it (e.g. "lookup:3", "assistant"): acceptance is tracked per source


class Drafter(Protocol):
    name: str
    context_length: int | None
    model: Model | None
    acceptance_prior: float | None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft: ...

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None: ...

    def finish(self, ids: list[int]) -> None: ...

    def report(self) -> dict: ...


class NoDrafter:
    """Proposes nothing: the loop then decodes one target token per step (plain decoding)."""

    name = "none"
    context_length = None
    model = None
    acceptance_prior = None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        return Draft()

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        pass

    def finish(self, ids: list[int]) -> None:
        pass

    def report(self) -> dict:
        return {}


class AssistantDrafter:
    """A smaller model with the target's tokenizer drafts token by token with its own KV cache.

    Before each proposal its cache is cropped to the prefix it shares with the sequence, and it is
    fed what it has not seen: after a full acceptance that is the last draft token and the bonus
    token, after a rejection the recovered token.
    """

    name = "assistant"
    acceptance_prior = None

    def __init__(self, assistant: Model, target: Model):
        check_same_tokenizer(target, assistant)
        self.model = assistant
        self.cache = KVCache(assistant.hf)
        self.vocab_size = target.vocab_size
        self.context_length = assistant.context_length

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        pending = self.cache.sync(ids)
        draft = Draft()
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = fit_vocab(self.cache.feed(pending)[-1], self.vocab_size)  # [vocab]
            draft.forward_passes += 1
            if sampler.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[token]) if min_confidence > 0 else 1.0
            else:
                q = sampler.probs(logits[None])[0]  # [vocab]
                token = sampler.draw(q)
                confidence = float(q.max())
                rows.append(q)
            if confidence < min_confidence:
                if rows:
                    rows.pop()
                break
            draft.tokens.append(token)
            pending = [token]
        if rows:
            draft.probs = torch.stack(rows)  # [n, vocab]
        return draft

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        pass  # the next propose() syncs the cache to whatever the target emitted

    def finish(self, ids: list[int]) -> None:
        pass

    def report(self) -> dict:
        return {}


class TokenizerMismatchError(ValueError):
    """The assistant does not share the target's tokenizer."""


_SAME_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {other: same?}


def same_tokenizer(target: Model, assistant: Model) -> bool:
    """Whether every token string maps to the same id in both (remembered per pair: a 262k vocabulary takes 0.2 s)."""
    a, b = target.tokenizer, assistant.tokenizer
    if a is b:
        return True
    try:
        known = _SAME_TOKENIZER.setdefault(a, weakref.WeakKeyDictionary())
        if b not in known:
            known[b] = a.get_vocab() == b.get_vocab()
        return known[b]
    except TypeError:  # a tokenizer that cannot be weakly referenced: compare every time
        return a.get_vocab() == b.get_vocab()


def check_same_tokenizer(target: Model, assistant: Model) -> None:
    """Same-tokenizer drafting needs every token string to map to the same id."""
    if same_tokenizer(target, assistant):
        return
    a, b = target.tokenizer.get_vocab(), assistant.tokenizer.get_vocab()
    differing = [t for t in a if b.get(t) != a[t]][:3]
    raise TokenizerMismatchError(
        f"The tokenizers of {target.name} ({len(a)} tokens) and assistant {assistant.name} ({len(b)} tokens) "
        f"differ (e.g. {', '.join(repr(t) for t in differing) or 'extra tokens in the assistant'}). "
        "AssistantDrafter needs the same tokenizer; pass the assistant to generate() instead, which "
        "switches to universal mode (UniversalDrafter) for different tokenizers."
    )


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Trim or pad (with -inf) a [vocab'] logits row to the target's logits width, on the logits' device."""
    if logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class PromptLookupDrafter:
    """Prompt lookup (Saxena 2023): find the last n-gram earlier in the context, propose what followed.

    n goes from `max_ngram` down to `min_ngram`; the most recent earlier match wins. No model,
    no probabilities.
    """

    name = "prompt-lookup"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        tokens, n = lookup_continuation(ids, k, self.max_ngram, self.min_ngram)
        return Draft(tokens=tokens, source=f"lookup:{n}")

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        pass

    def finish(self, ids: list[int]) -> None:
        pass

    def report(self) -> dict:
        return {}


def lookup_continuation(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of ids' last n-gram, and that n (0: none)."""
    if k <= 0:
        return [], 0
    seq = np.asarray(ids, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        pattern = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len-n, n], starts before the tail
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist(), n
    return [], 0


def attempts(parts: list, ids: list[int], k_of, sampler: Sampler, min_confidence: float = 0.0, device=None):
    """Ask each drafter in turn for k_of(part) tokens (skipping those given 0), up to the first
    non-empty draft. Yields (part, draft cut to k and named by its source, seconds it took on a clock
    that waits for `device`, the generation's: None for the CPU)."""
    for part in parts:
        k = k_of(part)
        if k <= 0:
            continue
        start = clock(device)
        draft = part.propose(ids, k, sampler, min_confidence)
        elapsed = clock(device) - start
        if len(draft.tokens) > k:
            draft.tokens, draft.probs = draft.tokens[:k], None if draft.probs is None else draft.probs[:k]
        draft.source = draft.source or part.name
        yield part, draft, elapsed
        if draft.tokens:
            return


class CompositeDrafter:
    """Several drafters tried in order, cheapest first (e.g. prompt lookup, the n-gram cache, a model).

    The generation loop asks each part in turn (with the lookahead the schedule picks for that part)
    and verifies the first non-empty draft, so a model drafter runs only when the cheap sources have
    nothing. `propose` here does the same with one k for callers outside the loop. Its own `model` and
    `acceptance_prior` are None: the policy reads those of each part.
    """

    model = None
    acceptance_prior = None

    def __init__(self, parts: list):
        if not parts:
            raise ValueError("CompositeDrafter needs at least one drafter")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)
        limits = [p.context_length for p in self.parts if p.context_length]
        self.context_length = min(limits) if limits else None

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        for _, draft, _ in attempts(self.parts, ids, lambda part: k, sampler, min_confidence):
            if draft.tokens:
                return draft
        return Draft()

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        for part in self.parts:
            part.observe(num_accepted, target_probs)

    def finish(self, ids: list[int]) -> None:
        for part in self.parts:
            part.finish(ids)

    def report(self) -> dict:
        out: dict = {}
        for part in self.parts:
            out.update(part.report())
        return out
