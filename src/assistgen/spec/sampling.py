"""Turning logits into tokens: the processed distribution (temperature, min-p, top-k, top-p) and seeded draws.

Contract: a `Sampler` per generation, made from its `GenerationConfig`; `probs(logits [n, vocab])` gives the
processed probabilities [n, vocab] (float32), `draw` and `uniform` draw with seeded `torch.Generator`s. Draws
happen on the device of the probabilities given, each device with its own generator made on first use and
seeded with the same seed, so the stream on the CPU is the same whatever other devices join. Keyed draws
(`keyed_uniforms`, `inverse_cdf`): the token at sequence position t is the inverse CDF of p at a uniform that depends
only on the seed (`key`) and t, so which tokens a seeded generation samples does not depend on how many steps
drew them (what was drafted, or verified, or batched beside it). Greedy generations (`greedy`) never draw: the loop
takes the argmax.
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
        self.key = self.generator.initial_seed()  # what every position's keyed uniform derives from

    def keyed_uniforms(self, position: int, count: int) -> list[float]:
        """The keyed uniforms in [0, 1) of sequence positions position .. position + count - 1."""
        return [keyed_uniform(self.key, position + i) for i in range(count)]

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


MASK64 = 2**64 - 1


def keyed_uniform(key: int, position: int) -> float:
    """A uniform in [0, 1) for (key, position): splitmix64 of the pair, its top 53 bits."""
    z = (key * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / 2.0**53


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], uniforms [rows] (float64, on probs' device) -> [rows] tokens: each row's first token whose
    cumulative probability (float64) exceeds u times the row's total, so token x comes with probability p(x) (a token of
    probability 0 never)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [rows, vocab]
    target = (uniforms * cdf[:, -1])[:, None]  # [rows, 1]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)  # [rows]
