"""The rows of one `llama_decode`: several sequences' new tokens in one `llama_batch`.

Contract: `_Batch` is a `llama_batch` over arrays it owns, sized once for the context's batch; `fill` writes every
feed's rows (each with its own sequence id and positions, logits asked only for the rows kept) without a Python loop
over rows. `_groups` splits feeds into runs whose rows fit one batch, in order. Neither decodes: the model calls
`llama_decode` on the batch.
"""

from __future__ import annotations

import ctypes

import numpy as np

from assistgen.backends.base import Feed


class _Batch:
    """A `llama_batch` over arrays this module owns (one sequence id per row), filled without a Python loop."""

    def __init__(self, lib, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        seq_base = self.seq.ctypes.data
        self.seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *(ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)))
        self.struct = lib.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.rows = 0

    def fill(self, rows: list[tuple[int, int, list[int], int]]) -> None:
        """rows: (sequence id, first position, token ids, how many of the last rows need logits)."""
        at = 0
        for seq, start, ids, keep in rows:
            n = len(ids)
            self.token[at:at + n] = ids
            self.pos[at:at + n] = np.arange(start, start + n, dtype=np.int32)
            self.seq[at:at + n] = seq
            self.logits[at:at + n - keep] = 0
            self.logits[at + n - keep:at + n] = 1
            at += n
        self.rows = at
        self.struct.n_tokens = at


def _groups(feeds: list[Feed], capacity: int) -> list[list[Feed]]:
    """Feeds split into runs whose rows fit one batch (each feed is below the context, so below a batch)."""
    groups: list[list[Feed]] = []
    rows = 0
    for feed in feeds:
        if not groups or rows + len(feed[1]) > capacity:
            groups.append([])
            rows = 0
        groups[-1].append(feed)
        rows += len(feed[1])
    return groups


