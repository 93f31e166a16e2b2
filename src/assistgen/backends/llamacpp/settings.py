"""How the llama.cpp backend's context is built (`LlamaSettings`), and the error a feed beyond it raises.

Contract: `LlamaSettings` is the one frozen object that travels from the options to `loading.load` and the model;
every default lives in it (`DEFAULT_CONTEXT` is the context used when neither the settings nor a shorter trained
context says otherwise). `LlamaCapacityError` (a ValueError) is what a feed beyond the context's bounds raises:
positions, sequences or KV cells, its message naming the setting that raises the bound. It imports nothing of
assistgen and nothing of llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass


class LlamaCapacityError(ValueError):
    """A feed beyond what the llama.cpp context was built for (positions, sequences or KV cells)."""


@dataclass(frozen=True)
class LlamaSettings:
    """How the llama.cpp context is built; every default lives here."""

    context: int | None = None  # KV cells shared by all sequences; None: min(the model's trained context, 4096)
    sequences: int = 32  # sequences that can live at once (requests and their forks, drafts included)
    threads: int | None = None  # None: OMP_NUM_THREADS when set (Ray sets it per replica), else this process's CPUs
    # On `make llamacpp`'s build (its patch: a switch to ggml's reference CPU kernels for a pass), a feed that asks
    # logits for every row it adds (a verification, a decoding step) is computed by kernels that give each row the
    # same bits whatever shares its pass; a feed with rows that need no logits (a prompt) goes through ggml's
    # fastest kernels, alone in its pass, so the cells it leaves depend on its own tokens only. exact_prompts=True
    # computes prompts row-exactly too (slower prefill; the cells then equal a token-by-token feed's).
    repack: bool = True  # llama.cpp's repacked weight layouts (faster one-row and prompt kernels)
    flash_attention: bool = True  # without it a row depends on where its sequence's cells lie in the shared buffer
    exact_prompts: bool = False
    ubatch: int = 512  # rows llama.cpp computes at once (a longer feed is split)
    # Bytes the model may keep resident (`backends.budget`): the weights stay memory-mapped from the file and are never
    # copied (repack off: repacked layouts are anonymous copies), so what does not fit is read again per pass.
    max_memory: int | None = None
    # Bytes of KV cells the pool holds beyond `context`, for finished sequences kept for prefix reuse
    # (`core.prefix.PrefixCache`), so that the running sequences keep at least `context` cells; "auto": the server's
    # default prefix cache (config.DEFAULT_PREFIX_CACHE, or one full context where that is more).
    kept_bytes: int | str = 0
    # For a transformers folder or hub id: the GGUF type it is converted to on first use (`convert.GGUF_TYPES`:
    # q4_k_m, q8_0, ...; None: "auto", its own 16-bit type); for a GGUF file, the type it is requantized to once
    # (`derive.REQUANTIZE_TYPES`; None: it runs as its own types).
    quantize: str | None = None
    # A drafter's output head kept to this many of the vocabulary's most frequent tokens (FR-Spec; `derive.py`): the
    # others' logits are -inf, so it never proposes them and its step reads a fraction of the head. None: the whole.
    head: int | None = None

    def thread_count(self) -> int:
        from assistgen.backends.machine import default_threads

        return self.threads or default_threads()


DEFAULT_CONTEXT = 4096

