"""A smaller model with the target's tokenizer as the drafter.

Contract: `AssistantDrafter(assistant, target)` drafts token by token with the assistant's own cache
(`LanguageModel.new_cache`; any backend): before each proposal the cache is cropped to the prefix it
shares with the sequence and fed what it has not seen (after a full acceptance the last draft token and
the bonus token, after a rejection the recovered token). A draft ends after an end token of the target's: nothing
after it is ever emitted. Its q rows are the assistant's processed
distributions, fitted to the target's logits width (`fit_vocab`). `acceptance_prior`, when given, is the
acceptance the policy starts from (`agreement` measures one: how often the assistant's argmax is the
target's over a teacher-forced text). `same_tokenizer` says whether two models' tokenizers map every token
string to the same id (an assistant whose tokenizer differs drafts through `universal.UniversalDrafter`
instead).
"""

from __future__ import annotations

import weakref

import torch

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler


class AssistantDrafter(Drafter):
    """A smaller model with the target's tokenizer drafts token by token with its own KV cache."""

    name = "assistant"

    def __init__(self, assistant, target, acceptance_prior: float | None = None):
        check_same_tokenizer(target, assistant)
        self.model = assistant
        self.acceptance_prior = acceptance_prior
        self.cache = assistant.new_cache()
        self.vocab_size = target.vocab_size
        self.context_length = assistant.context_length
        self.ends = frozenset(target.eos_token_ids)

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
            if token in self.ends:  # (a stop that depends only on tokens already drawn: sampling stays exact)
                break
            pending = [token]
        if rows:
            draft.probs = torch.stack(rows)  # [n, vocab]
        return draft


def agreement(target, assistant, ids: list[int], positions: int | None = None) -> float:
    """How often the assistant's argmax equals the target's over `ids`, teacher-forced (one pass of each over the
    whole text), scored at the last `positions` of them (all: None); both share the target's tokenizer."""
    ids = list(ids)[: min(target.context_length, assistant.context_length)]
    width = target.vocab_size
    mine = fit_vocab(assistant.new_cache().feed(ids, len(ids)), width).argmax(-1)  # [len(ids)]
    theirs = target.new_cache().feed(ids, len(ids)).argmax(-1)
    scored = slice(None) if positions is None else slice(-positions, None)
    return float((mine[scored] == theirs[scored]).float().mean())


class TokenizerMismatchError(ValueError):
    """The assistant does not share the target's tokenizer."""


_SAME_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {other: same?}


def same_tokenizer(target, assistant) -> bool:
    """Whether every token string maps to the same id in both (remembered per pair: large vocabularies are slow)."""
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


def check_same_tokenizer(target, assistant) -> None:
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
