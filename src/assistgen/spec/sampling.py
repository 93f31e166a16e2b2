"""Turning logits into tokens: the processed distribution (temperature, min-p, top-k, top-p) and seeded draws.

Contract: a `Sampler` per generation, made from its `GenerationConfig`; `probs(logits [n, vocab])` gives the
processed probabilities [n, vocab] (float32), `draw` and `uniform` draw with seeded `torch.Generator`s. Draws
happen on the device of the probabilities given, each device with its own generator made on first use and
seeded with the same seed, so the stream on the CPU is the same whatever other devices join. Greedy
generations (`greedy`) never draw: the loop takes the argmax.
"""

from __future__ import annotations

import math

import torch

from assistgen.config import GenerationConfig


class Sampler:
    """Applies temperature, min-p, top-k and top-p (in vLLM's order) and draws tokens with seeded generators (one per
    device)."""

    def __init__(self, config: GenerationConfig):
        self.config = config
        self.greedy = config.greedy
        self.generator = torch.Generator()  # the CPU's: uniforms, and draws from CPU probabilities
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()
        self.generators = {self.generator.device: self.generator}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The generator that draws on `device`, made on first use with the CPU generator's seed."""
        generator = self.generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.generator.initial_seed())
            self.generators[device] = generator
        return generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] -> processed probabilities [n, vocab] (float32)."""
        logits = logits.float()
        # Shifted by the row's max first (softmax does not change), and the temperature kept a float32 number: a tiny
        # one then gives 0 at the argmax and -inf elsewhere, the distribution's limit, instead of nan (inf - inf, or
        # 0 / 0 for a temperature that is 0 in float32).
        temperature = max(self.config.temperature, torch.finfo(torch.float32).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        if self.config.min_p > 0.0:  # (each row's max is 0 now: a token's probability over the likeliest's is exp)
            logits = logits.masked_fill(logits < math.log(self.config.min_p), float("-inf"))
        if self.config.top_k > 0:
            k = min(self.config.top_k, logits.shape[-1])
            kth = torch.topk(logits, k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.config.top_p < 1.0:
            logits = top_p_filter(logits, self.config.top_p)
        return torch.softmax(logits, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """probs [vocab] -> one token id, drawn on probs' device."""
        return int(torch.multinomial(probs, 1, generator=self.generator_for(probs.device)))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (as transformers does). [n, vocab]"""
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
