"""Checking greedy exactness when floating point differs between one-token and multi-token passes.

Contract: given two greedy token sequences for the same prompt, find the first position where they
differ and the target's top-2 logit margin there (from one forward pass over the whole prefix in a fresh
cache of the model, through the backend seam). A divergence at
a margin below NEAR_TIE is a floating-point tie, not a wrong acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass
class Divergence:
    position: int  # index into the new tokens
    margin: float  # top-1 minus top-2 logit of the target at that position

    @property
    def near_tie(self) -> bool:
        return self.margin < NEAR_TIE


@torch.inference_mode()
def top2_margin(model, ids: list[int]) -> float:
    top = model.new_cache().feed(ids)[-1].topk(2).values
    return float(top[0] - top[1])


def first_divergence(model, prompt: list[int], a: list[int], b: list[int]) -> Divergence | None:
    """None when one sequence is a prefix of the other (e.g. identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return Divergence(i, top2_margin(model, prompt + a[:i]))
    return None
