"""Offloaded weights on the torch backend (`load_model(..., backend="torch", max_memory=...)`).

Contract: on the CPU the weights stay file-backed: transformers memory-maps a folder's safetensors when the dtype
asked for is the files' own, and a quantized model is read back from its saved copy with `torch.load(mmap=True)`
(`quantize.load_quantized`), so the operating system keeps what fits in the budget and reads the rest from the file
in each pass; the transforms then make no packed copies of the weights (`transforms.optimize` keeps the MKL route).
`check_budget(model, before)` refuses a budget below what must stay resident: the anonymous memory the load added
after one pass (the tokenizer, the KV cache's first block, and any weights that had to be converted: a dtype other
than the files') and the largest single weight block (a decoder layer, or the output head, which every pass reads
whole), naming the smallest budget that works. On a GPU, `device_map(place, budget)` gives transformers' loading
accelerate's placement: the layers that fit in `budget` of GPU memory live there, the rest stay in CPU memory and are
moved to the GPU for each forward pass.
"""

from __future__ import annotations

import os

import torch

from assistgen.backends.budget import check_model_budget
from assistgen.backends.torch import layers


def largest_block_bytes(hf: torch.nn.Module) -> int:
    """Bytes of the largest decoder layer, or of the output head where that is larger."""
    def size(module: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    blocks = list(layers.decoder_layers(hf)[2]) if layers.has_decoder_layers(hf) else []
    head = hf.get_output_embeddings()
    return max([size(b) for b in blocks] + ([size(head)] if head is not None else []), default=0)


def check_budget(model, before: dict[str, int]) -> None:
    """Refuse a budget below the anonymous memory the load added (after one pass) plus the largest weight block."""
    check_model_budget(model, before, "tokenizer, KV cache and converted weights", "the largest layer's weights",
                       largest_block_bytes(model.hf))


def device_map(place: torch.device, budget: int) -> dict:
    """from_pretrained's placement for a GPU budget: layers beyond `budget` bytes of GPU memory kept in CPU memory
    (accelerate's offload: moved to the GPU per forward)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"device_map": "auto", "max_memory": {place.index or 0: budget, "cpu": host}}
