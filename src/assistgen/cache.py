"""A model's KV cache as a thing with verbs: `feed` tokens, `crop` back, `sync` to a context.

Contract: `KVCache` owns one Hugging Face `DynamicCache` and the list of token ids it holds, so
that `len(cache)` is the number of cached positions and `cache.tokens` says which. It runs the
model's forward pass (batch size 1) on the model's device (`device`, taken once when it is made)
and keeps only the logits asked for. Rollback is exact for every layer layout transformers builds
from a config, including sliding-window layers (Gemma-3), which record their past so they can be
cropped after the window has filled. It knows nothing about drafting or sampling.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from assistgen.devices import model_device


class KVCache:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = model_device(model)  # where ids and positions are made
        self.reset()

    def reset(self) -> None:
        self.past = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in self.past.layers):
            self.past.activate_past_recording()  # lets sliding-window layers roll back past the window
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def feed(self, ids: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Append `ids` to the cache; return the logits of the last `logits_to_keep` of them.

        Returns [logits_to_keep, vocab] float32, row j predicting the token after ids[:len(ids)-logits_to_keep+j+1].
        """
        if not ids:
            raise ValueError("feed() needs at least one token")
        start = len(self.tokens)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            cache=self.past,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.tokens.extend(ids)
        return out.logits[0, -logits_to_keep:].float()

    def crop(self, length: int) -> None:
        """Keep only the first `length` cached positions."""
        remove = len(self.tokens) - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {len(self.tokens)} positions to {length}")
        if length == 0:
            self.reset()
            return
        # Always crop, even by 0: sliding-window layers recording their past trim back to the window here.
        self.past.crop(-remove)
        del self.tokens[length:]

    def sync(self, ids: list[int], keep_last: int = 1) -> list[int]:
        """Crop to the longest prefix shared with `ids`, leaving at least `keep_last` of them unfed.

        Returns the tokens of `ids` that still have to be fed.
        """
        common = max(0, min(shared_prefix(self.tokens, ids), len(ids) - keep_last))
        self.crop(common)
        return ids[common:]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share; one list comparison in the usual case (b extends a)."""
    if len(b) >= len(a) and b[: len(a)] == a:
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
