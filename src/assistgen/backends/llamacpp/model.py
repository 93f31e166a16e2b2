"""The llama.cpp backend's model and caches: a GGUF file run by llama.cpp's kernels behind the seam.

Contract: `LlamaModel` implements `backends.base.LanguageModel` over one llama.cpp model and one context
(llama-cpp-python's low-level API), built as its `LlamaSettings` (`settings.py`) say. The context holds
`settings.sequences` sequences that share one
pool of KV cells (a unified KV buffer: a fork is a metadata copy): `settings.context` for the running sequences and
`settings.kept_bytes` more for finished ones kept for prefix reuse; one sequence holds at most `settings.context`
positions. Each `LlamaCache` owns one sequence id, taken from the model's pool when it is made and given back (its
cells removed) when it is dropped. On `make llamacpp`'s build (its patch to llama.cpp's slot search) a sequence's new
cells always go after the last cell it holds, so its cells lie in the order of their positions whatever the other
sequences did: attention sums over cells in cell order, so a sequence's logits do not depend on what shares the
pool. When no free cell lies after a sequence's last one, every sequence is packed down (`_compact`: saved and
restored through llama.cpp's sequence state, bits unchanged, order kept) and the pass retried once.
`feed_together` is one `llama_decode` over a `llama_batch` (`batch.py`) that holds every feed's rows, each
with its own sequence id and positions, logits asked only for the rows kept, on the row-exact kernels where the
build has them (`row_exact`); a feed with rows that need no logits (a prompt) is decoded alone first, on the
fastest kernels unless `settings.exact_prompts`. It returns the logits as float32
CPU tensors. `crop` is `llama_memory_seq_rm`, `fork` is `llama_memory_seq_cp`. A sequence past the
context, more live sequences than the context was built for, or a pool of KV cells that is full raise
`LlamaCapacityError` (a ValueError) naming the setting that raises the bound; nothing is fed then. Calls
into llama.cpp are serialized by one process-wide lock. The tokenizer is a
Hugging Face tokenizer built from the same GGUF (`loading.py` checks it against llama.cpp's own).
It cannot run its first N layers as a model of their own (no `first_layers`); it is `exact` when row-exact (above;
`exactness.py` says why not, and warns).
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from assistgen.backends.base import LONG_K, Capabilities, Feed, synced
from assistgen.backends.llamacpp.batch import _Batch, _groups
from assistgen.backends.llamacpp.exactness import inexact_reason, kernel_switch, warn_inexact
from assistgen.backends.llamacpp.guard import check_cpu, exact_rows
from assistgen.backends.llamacpp.kernels import library_identity
from assistgen.backends.llamacpp.settings import LlamaCapacityError, LlamaSettings
from assistgen.backends.machine import cpu_name


class LlamaModel:
    """One GGUF model and its llama.cpp context, behind `backends.base.LanguageModel`."""

    backend = "llama.cpp"
    startup_s = 0.0

    def __init__(self, lib, model_ptr, context_ptr, tokenizer, name: str, path: Path, settings: LlamaSettings,
                 cache_key: str | None = None):
        self.lib = lib  # the llama_cpp.llama_cpp module
        self.name = name
        self.path = path
        self.tokenizer = tokenizer
        self.settings = settings
        self.cache_key = cache_key
        self._model = model_ptr
        self._ctx = context_ptr
        self._memory = lib.llama_get_memory(context_ptr)
        self._vocab = lib.llama_model_get_vocab(model_ptr)
        self._n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.cells = lib.llama_n_ctx(context_ptr)  # KV cells in the pool, shared by every sequence
        self.cell_bytes = cell_bytes(lib, model_ptr)  # the keys and values of one cell, all layers
        self._n_ctx = min(settings.context or self.cells, self.cells)  # the positions one sequence may hold (the pool
        # holds `settings.kept_bytes` more for kept sequences)
        self._n_batch = lib.llama_n_batch(context_ptr)
        self._eos = tuple(i for i in range(self._n_vocab) if lib.llama_vocab_is_eog(self._vocab, i))
        self._free_seqs = list(range(settings.sequences - 1, -1, -1))
        self._lock = _LOCK
        self._switch = kernel_switch(lib)
        probe = check_cpu(Path(lib._lib._name).resolve().parent)  # (remembered: run when the libraries were loaded)
        rows = exact_rows(probe)  # the rows of one pass this CPU's kernels were seen to keep exact (None: unchecked)
        reason = inexact_reason(self._switch, settings, rows, probe)  # "" exactly when row_exact
        self.capabilities = Capabilities(exact=not reason, inexact_reason=reason,
                                         offloaded=settings.max_memory is not None, shared_forks=True,
                                         verify_rows=min(rows or 1 + LONG_K, 1 + LONG_K))
        if reason:
            warn_inexact(reason)
        self._batch = _Batch(lib, self._n_batch)
        self._closer = weakref.finalize(self, _free, lib, model_ptr, context_ptr, self._batch)

    # --- what decoding needs to know --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """llama.cpp's end-of-generation tokens (`llama_vocab_is_eog`): what `llama-server` stops on."""
        return self._eos

    @property
    def context_length(self) -> int:
        return self._n_ctx

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def row_exact(self) -> bool:
        """Whether a row whose logits are asked for gets the same bits whatever shares its pass: `make llamacpp`'s
        build (its kernel switch) with flash attention on."""
        return self._switch is not None and self.settings.flash_attention

    @property
    def weight_bytes(self) -> int:
        return int(self.lib.llama_model_size(self._model))

    @property
    def max_sequences(self) -> int:
        return self.settings.sequences

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cell_bytes

    @property
    def max_memory(self) -> int | None:
        """The budget its weights are offloaded under (bytes), None when they are not."""
        return self.settings.max_memory

    def clock(self) -> float:
        return time.perf_counter()  # llama_decode returns when its work is done

    def fingerprint(self, *extra: str) -> str:
        s = self.settings
        parts = [self.cache_key or self.name, str(self.path.stat().st_size), "llama.cpp",
                 self.lib.llama_print_system_info().decode(errors="replace"), platform.machine(), cpu_name(),
                 f"threads={s.thread_count()}", f"repack={s.repack}", f"flash={s.flash_attention}",
                 f"max_memory={s.max_memory}",
                 f"library={library_identity(Path(self.lib._lib._name))}", f"row_exact={self.row_exact}", *extra]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def optimize(self, mode: str = "auto", refresh: bool = False) -> None:
        """Nothing to transform: llama.cpp chose its kernels when it loaded the file (what was measured stays
        valid: its fingerprint does not change)."""

    def describe(self) -> dict:
        """What loading chose (`backends.base`): the file's own types, so no quantization of assistgen's."""
        return {"quantization": None, "file": str(self.path)}

    def new_cache(self) -> LlamaCache:
        return LlamaCache(self)

    # --- sequences ----------------------------------------------------------------------------------------

    def _take_seq(self) -> int:
        with self._lock:
            if not self._free_seqs:
                raise LlamaCapacityError(
                    f"{self.name}: more than {self.settings.sequences} sequences live at once on its llama.cpp "
                    "context; load it with more (LlamaSettings(sequences=...), --sequences) or run fewer "
                    "requests at once.")
            return self._free_seqs.pop()

    def _release_seq(self, seq: int) -> None:
        with self._lock:
            self.lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free_seqs.append(seq)

    def _crop(self, seq: int, length: int) -> None:
        with self._lock:
            if not self.lib.llama_memory_seq_rm(self._memory, seq, length, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {length}.. of a sequence of {self.name}")

    def _copy(self, source: int, dest: int) -> None:
        with self._lock:
            self.lib.llama_memory_seq_cp(self._memory, source, dest, -1, -1)

    # --- forward passes -------------------------------------------------------------------------------------

    def feed_together(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One llama_decode over (cache, new ids, logits to keep) of caches of this model (more when the rows
        exceed the batch); each cache's logits [keep, vocab] float32, in order."""
        if not feeds:
            return []
        for cache, ids, keep in feeds:
            if getattr(cache, "model", None) is not self:
                raise ValueError("feed_together needs caches of one model")
            if not ids:
                raise ValueError("feed() needs at least one token")
            if not 1 <= keep <= len(ids):
                raise ValueError(f"logits_to_keep must be in 1..{len(ids)}, got {keep}")
            if len(cache) + len(ids) > self._n_ctx:
                raise LlamaCapacityError(
                    f"{len(cache) + len(ids)} positions exceed the llama.cpp context of {self.name} "
                    f"({self._n_ctx}); load it with a longer one (LlamaSettings(context=...), --context).")
        exact = self._switch is None or self.settings.exact_prompts
        prompts = [] if exact else [i for i, (_, ids, keep) in enumerate(feeds) if keep < len(ids)]
        out: list[torch.Tensor | None] = [None] * len(feeds)
        for i in prompts:  # alone in its pass on the fastest kernels: its cells depend on its own tokens only
            out[i] = self._decode([feeds[i]], exact=False)[0]
        rest = [i for i in range(len(feeds)) if out[i] is None]
        at = 0
        for group in _groups([feeds[i] for i in rest], self._n_batch):
            for i, logits in zip(rest[at:at + len(group)], self._decode(group, exact=True), strict=True):
                out[i] = logits
            at += len(group)
        return out  # type: ignore[return-value]

    def _decode(self, feeds: list[Feed], exact: bool) -> list[torch.Tensor]:
        keeps = [keep for _, _, keep in feeds]
        with self._lock:
            if self._switch is not None:
                self._switch(exact)
            self._batch.fill([(cache.seq, len(cache), ids, keep) for cache, ids, keep in feeds])
            rc = self.lib.llama_decode(self._ctx, self._batch.struct)
            if rc == 1 and self._packable(self._batch.rows):  # no free cell after some sequence's last one
                self._forget_partial(feeds)
                self._compact()
                rc = self.lib.llama_decode(self._ctx, self._batch.struct)
            if rc != 0:
                self._forget_partial(feeds)
                if rc == 1:
                    raise LlamaCapacityError(
                        f"The llama.cpp context of {self.name} has no room for {self._batch.rows} more KV cells "
                        f"({self.lib.llama_n_ctx(self._ctx)} shared by all its sequences); load it with a longer "
                        "context (LlamaSettings(context=...), --context) or run fewer requests at once.")
                raise RuntimeError(f"llama_decode failed on {self.name} (code {rc})")
            logits = self.lib.llama_get_logits(self._ctx)
            rows = np.ctypeslib.as_array(logits, shape=(sum(keeps), self._n_vocab))
            table = torch.from_numpy(rows.copy())  # [sum(keeps), vocab]: llama.cpp reuses its buffer
        for cache, ids, _ in feeds:
            cache.tokens.extend(ids)
        return list(table.split(keeps))

    def _forget_partial(self, feeds: list[Feed]) -> None:
        """Take out whatever part of a failed batch llama.cpp stored (under the lock)."""
        for cache, _, _ in feeds:
            self.lib.llama_memory_seq_rm(self._memory, cache.seq, len(cache), -1)

    def _live(self) -> list[int]:
        """The sequence ids holding cells (under the lock)."""
        return [seq for seq in sorted(set(range(self.settings.sequences)) - set(self._free_seqs))
                if self.lib.llama_memory_seq_pos_max(self._memory, seq) >= 0]

    def _packable(self, rows: int) -> bool:
        """Whether every live sequence, each packed apart (forks' shared cells copied), and `rows` more fit the pool."""
        held = sum(self.lib.llama_memory_seq_pos_max(self._memory, seq) + 1 for seq in self._live())
        return held + rows <= self.cells

    def _compact(self) -> None:
        """Move every live sequence's cells down to the lowest free ones, each in its own order (under the lock).
        A sequence's new cells go after its last one (the patched build's placement keeps each sequence's cells in
        position order, which attention's summation follows); once the pool's top is taken, cells freed below are
        reached by saving each sequence's cells and restoring them packed. Cells shared by forks are copied apart."""
        lib, ctx = self.lib, self._ctx
        live = self._live()
        saved = []
        for seq in live:
            size = lib.llama_state_seq_get_size(ctx, seq)
            buffer = (ctypes.c_uint8 * size)()
            saved.append((seq, buffer, lib.llama_state_seq_get_data(ctx, buffer, size, seq)))
        for seq in live:
            lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
        for seq, buffer, size in saved:
            if lib.llama_state_seq_set_data(ctx, buffer, size, seq) != size:
                raise RuntimeError(f"llama.cpp could not restore a sequence of {self.name} while packing its cells")


class LlamaCache:
    """One sequence of a `LlamaModel`'s context (`backends.base.Cache`)."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.seq = model._take_seq()
        self.tokens: list[int] = []
        self._release = weakref.finalize(self, model._release_seq, self.seq)

    def __len__(self) -> int:
        return len(self.tokens)

    def clock(self) -> float:
        return time.perf_counter()

    def nbytes(self) -> int:
        """The bytes of KV cells this sequence holds."""
        return len(self.tokens) * self.model.cell_bytes

    def feed(self, ids: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Append `ids`; return the logits [logits_to_keep, vocab] of the last `logits_to_keep` of them."""
        return self.model.feed_together([(self, ids, logits_to_keep)])[0]

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot crop a cache of {len(self.tokens)} positions to {length}")
        if length < len(self.tokens):
            self.model._crop(self.seq, length)
            del self.tokens[length:]

    def fork(self) -> LlamaCache:
        other = LlamaCache(self.model)
        self.model._copy(self.seq, other.seq)
        other.tokens = list(self.tokens)
        return other

    def sync(self, ids: list[int], keep_last: int = 1) -> list[int]:
        return synced(self, ids, keep_last)


_LOCK = threading.Lock()  # llama.cpp contexts are not thread-safe, and the kernel switch is process-wide


def cell_bytes(lib, model_ptr) -> int:
    """The bytes one KV cell takes over all layers (f16 keys and values), from the GGUF's attention sizes."""
    def meta(key: str) -> int | None:
        arch = lib.llama_model_meta_val_str(model_ptr, b"general.architecture", buffer := ctypes.create_string_buffer(
            256), 256)
        if arch < 0:
            return None
        size = lib.llama_model_meta_val_str(model_ptr, f"{buffer.value.decode()}.{key}".encode(), buffer, 256)
        return int(buffer.value) if size > 0 and buffer.value.isdigit() else None

    layers = lib.llama_model_n_layer(model_ptr)
    heads = lib.llama_model_n_head(model_ptr)
    kv_heads = lib.llama_model_n_head_kv(model_ptr)
    head = lib.llama_model_n_embd(model_ptr) // max(1, heads)
    return 2 * layers * kv_heads * ((meta("attention.key_length") or head) + (meta("attention.value_length") or head))


def _free(lib, model_ptr, context_ptr, batch) -> None:
    lib.llama_free(context_ptr)
    lib.llama_model_free(model_ptr)
