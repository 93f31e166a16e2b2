"""transformers' own `generate()` as the reference that assistgen is compared with (benchmarks and tests).

Contract: `hf_generate(target, ids, max_new_tokens, ...)` runs the Hugging Face module's `generate` on a
torch-backend model: greedy, or sampled (`temperature` > 0, no top-k, seeded with `seed` through
`torch.manual_seed`), plain, with prompt lookup (`lookup_tokens`) or
with an assistant model (`assistant`; `universal=True` adds the two tokenizers, transformers' universal
assisted generation). With `untransform` (the default) the models run as PyTorch and transformers ship
them (`transforms.untransformed`); timing with the models' clock. Returns (new token ids, seconds).
`ForwardCounter` counts a model's top-level forward calls.
"""

from __future__ import annotations

import contextlib

import torch

from assistgen.backends.torch.transforms import untransformed


def hf_generate(target, ids: list[int], max_new_tokens: int, *, assistant=None, universal: bool = False,
                lookup_tokens: int | None = None, temperature: float = 0.0, seed: int = 0,
                min_new_tokens: int | None = None, untransform: bool = True) -> tuple[list[int], float]:
    kwargs: dict = {"max_new_tokens": max_new_tokens}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0)
    else:
        kwargs.update(do_sample=False)
    if min_new_tokens is not None:
        kwargs["min_new_tokens"] = min_new_tokens
    if lookup_tokens:
        kwargs["prompt_lookup_num_tokens"] = lookup_tokens
    if assistant is not None:
        kwargs["assistant_model"] = assistant.hf
        if universal:
            kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=assistant.tokenizer)
    models = [target.hf] + ([assistant.hf] if assistant is not None else [])
    inputs = torch.tensor([ids], device=target.device)  # [1, n]
    with untransformed(*models) if untransform else contextlib.nullcontext():
        if temperature > 0:
            torch.manual_seed(seed)  # seeds the CPU and every GPU
        start = target.clock()
        out = target.hf.generate(inputs, attention_mask=torch.ones_like(inputs),
                                 pad_token_id=target.tokenizer.pad_token_id or (target.eos_token_ids or (0,))[0],
                                 **kwargs)
        seconds = target.clock() - start
    return out[0, len(ids):].tolist(), seconds


class ForwardCounter:
    """Counts top-level forward calls of a model (a torch-backend `Model`) until `close`."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.hf.register_forward_pre_hook(self._hook)

    def _hook(self, *args) -> None:
        self.count += 1

    def close(self) -> None:
        self.handle.remove()
