"""The torch backend's KV cache (`backends.base.Cache`): `feed` tokens, `crop` back, `fork`, `sync` to a context.

Contract: `KVCache(model)` (a torch-backend `Model`; `model.new_cache()` makes one) owns one sequence's
keys and values (`ragged.SequenceKV`: preallocated per layer, written by position, so a crop is free)
and the list of token ids it holds, so that `len(cache)` is the number of cached positions and
`cache.tokens` says which. `feed` runs the model's forward pass over new tokens on the model's device
(`device`, taken once when it is made) and keeps only the logits asked for; `feed_together` runs one
forward pass over the new tokens of several caches of the same model (the batched serving step), each
sequence attending only to its own positions (`ragged.py`). Rollback is exact for every layer layout,
including sliding-window layers (Gemma-3), which keep every position and apply their window in the
mask. It knows nothing about drafting or sampling.
"""

from __future__ import annotations

import torch

from assistgen.backends.base import synced
from assistgen.backends.torch import ragged
from assistgen.backends.torch.timing import clock


class KVCache:
    def __init__(self, model):
        self.model = model
        self.device = model.device  # where ids and positions are made
        ragged.attach(model.hf)
        self.reset()

    def reset(self) -> None:
        self.kv = ragged.SequenceKV()
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def clock(self) -> float:
        """Seconds on a monotonic clock once this cache's device has finished its queued work."""
        return clock(self.device)

    def nbytes(self) -> int:
        """The bytes its key and value buffers take (preallocated: at least what its positions need)."""
        return sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values) if t is not None)

    def feed(self, ids: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Append `ids` to the cache; return the logits of the last `logits_to_keep` of them.

        Returns [logits_to_keep, vocab] float32, row j predicting the token after ids[:len(ids)-logits_to_keep+j+1].
        """
        return feed_together([(self, ids, logits_to_keep)])[0]

    def fork(self) -> KVCache:
        """An independent copy: the same positions, its own buffers."""
        other = KVCache(self.model)
        other.kv.keys = [None if t is None else t.clone() for t in self.kv.keys]
        other.kv.values = [None if t is None else t.clone() for t in self.kv.values]
        other.kv.length = self.kv.length
        other.tokens = list(self.tokens)
        return other

    def crop(self, length: int) -> None:
        """Keep only the first `length` cached positions."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot crop a cache of {len(self.tokens)} positions to {length}")
        self.kv.crop(length)
        del self.tokens[length:]

    def sync(self, ids: list[int], keep_last: int = 1) -> list[int]:
        """Crop to the longest prefix shared with `ids`, leaving at least `keep_last` of them unfed.

        Returns the tokens of `ids` that still have to be fed.
        """
        return synced(self, ids, keep_last)


def feed_together(feeds: list[tuple[KVCache, list[int], int]]) -> list[torch.Tensor]:
    """One forward pass over (cache, new ids, logits to keep) of caches of one model; each cache's logits
    [keep, vocab] float32, in order."""
    if not feeds:
        return []
    model = feeds[0][0].model
    if any(cache.model is not model for cache, _, _ in feeds):
        raise ValueError("feed_together needs caches of one model")
    for _, ids, keep in feeds:
        if not ids:
            raise ValueError("feed() needs at least one token")
        if not 1 <= keep <= len(ids):
            raise ValueError(f"logits_to_keep must be in 1..{len(ids)}, got {keep}")
    logits = ragged.forward(model.hf, [ragged.Feed(cache.kv, ids, keep) for cache, ids, keep in feeds])
    for cache, ids, _ in feeds:
        cache.tokens.extend(ids)
    return logits

