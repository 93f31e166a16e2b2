"""A drafter's output head kept to some of the vocabulary's tokens (FR-Spec, arXiv 2502.14856), as a transform
applied after loading: the torch twin of the llama.cpp backend's derived head (`backends.llamacpp.derive`).

Contract: `keep_head(model, kept)` replaces the transformers model's output embeddings by a `KeptHead` holding only the
rows of the token ids `kept`: its logits keep the vocabulary's width, with -inf for every token left out, so that a
drafter built on it never proposes one and its q rows are zero there (verification is the target's, unchanged:
greedy output stays exact and sampling lossless). `most_frequent(tokenizer, head)` chooses the ids as the llama.cpp
backend does: the special tokens, then the lowest ids (a BPE vocabulary numbers its tokens in merge order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class KeptHead(torch.nn.Module):
    """The output projection for `kept` ids only; the logits of the others are -inf. [..., hidden] -> [..., vocab]"""

    def __init__(self, head: torch.nn.Linear, kept: torch.Tensor):
        super().__init__()
        self.vocab = head.weight.shape[0]
        self.register_buffer("kept", kept)
        self.weight = torch.nn.Parameter(head.weight.detach()[kept].clone(), requires_grad=False)  # [kept, hidden]
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach()[kept].clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.linear(hidden, self.weight, self.bias)  # [..., kept]
        logits = rows.new_full((*rows.shape[:-1], self.vocab), float("-inf"))  # [..., vocab]
        logits[..., self.kept] = rows
        return logits


def keep_head(model, kept: Sequence[int]) -> None:
    """Replace `model`'s output head by one that keeps only the token ids `kept`."""
    ids = torch.tensor(sorted(set(int(i) for i in kept)), dtype=torch.long)
    head = model.hf.get_output_embeddings()
    if not 0 < len(ids) < head.weight.shape[0] or int(ids[0]) < 0 or int(ids[-1]) >= head.weight.shape[0]:
        raise ValueError(f"kept ids must be a proper subset of the {head.weight.shape[0]} tokens' ids.")
    model.hf.config.tie_word_embeddings = False  # (the input embeddings keep every row)
    model.hf.set_output_embeddings(KeptHead(head, ids.to(head.weight.device)))


def most_frequent(tokenizer, head: int) -> list[int]:
    """`head` ids: the tokenizer's special ones, then the lowest others."""
    special = set(tokenizer.all_special_ids)
    normal = (i for i in range(len(tokenizer)) if i not in special)
    return sorted(special | set(itertools.islice(normal, max(0, head - len(special)))))
