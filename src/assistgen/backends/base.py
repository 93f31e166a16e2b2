"""The backend seam: what the generation loop, the drafters and the policy need from a model.

Contract: a backend model (`LanguageModel`) computes next-token logits for token ids and keeps the
keys and values of the sequences it has read in caches (`Cache`) whose verbs are the only way the
layers above it touch a forward pass:
    model.new_cache() -> Cache        an empty cache of this model;
    model.feed_together(feeds)        one forward pass over (cache, new ids, logits to keep) of several
                                      caches of this model, each sequence attending only to its own
                                      positions; returns each cache's logits [keep, vocab] float32 torch
                                      tensors on `model.device`, in order;
    cache.feed(ids, keep) / crop(n) / fork() / len(cache) / cache.tokens / cache.sync(ids) / cache.clock()
                                      (the model's clock on the device the cache lives on, found once) /
                                      cache.nbytes() (the memory its keys and values hold)
plus what decoding needs to know: `name`, `backend` (the library's name, for messages and reports),
`tokenizer` (a Hugging Face-style tokenizer: `__call__`,
`decode`, `get_vocab`, `convert_ids_to_tokens`, `apply_chat_template`), `vocab_size` (the width of the
logits), `eos_token_ids`, `context_length` (None when unbounded), `device` (where logits, and the
tensors made from them, live), `weight_bytes` (what a forward pass reads, for the policy's cost prior),
`max_sequences` (how many caches can live at once, None:
no bound), `kv_bytes_per_token` (the keys and values one cached position holds), `startup_s` (the seconds of
one-off work its next pass does before its own: an input it encodes when first needed; 0.0 when none or not known),
`clock()` (seconds on a monotonic clock once the device's queued work is done: every timing above the
seam goes through it), `optimize(mode, refresh)` (the backend's own speed transforms, "auto": only
where they measure faster), `fingerprint(*extra)` (a stable key of the model, its set-up and this machine,
under which measurements are cached, on disk and in the policy's cost book: a transform that changes what a
pass costs changes it; `cache_key` None: measurements live in memory only, for this model object) and
`describe()` (what loading and the transforms chose, for people and reports: a dict with `quantization` (None:
as loaded), `dtype` where the weights have one, and, where the backend tunes them (the torch backend on the CPU),
`linear_routes` (the small-row linear routes' record, None when not applied) and `routes_file` (where that record
is cached)). A model holds nothing of the layers above it: what the policy measures of it lives in the policy's
cost book (`policy.costs`), never on the model.

Capabilities a backend may lack are declared in `capabilities`, never discovered by `hasattr`:
`first_layers` (it can run its first N decoder layers as a model of its own, sharing the weights:
`truncated(n)`, `exit_agreement(ids, positions)` and `layer_costs()`, which early exit needs) and `exact`
(a row's logits are those it gets alone, so assisted greedy output is plain decoding's; `inexact_reason` says
why not) and `offloaded` (its weights are read from their file beyond a memory budget in every pass) and
`shared_forks` (a fork shares its parent's keys and values instead of copying them). `Computes` is
the part every model has, checked at runtime (`isinstance`) where a model must be told from its name. Layers
above this module see a model only through this interface; the PyTorch code lives below it
(`backends/torch/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

MAX_K = 16  # the most draft tokens one verification step feeds (1 + MAX_K rows) of a model drafter's draft
LONG_K = 64  # the most of a copy's (a free drafter's: prompt lookup, the n-gram cache, suffixes), as llama-server's
# n-gram modes; the kernels' bound is 1 + LONG_K rows


@dataclass(frozen=True)
class Capabilities:
    first_layers: bool = False  # truncated(n), exit_agreement, layer_costs: the target's own first layers draft
    exact: bool = True  # a row's logits do not depend on what else its pass computes, so greedy verification keeps
    # plain decoding's tokens; False (a stock llama.cpp build): drafted output may drift from plain decoding
    inexact_reason: str = ""  # with exact False: why, and the fix
    offloaded: bool = False  # its weights stay in their file beyond a memory budget and are read in again per pass:
    # a pass's time is set by that reading, not by the rows it computes (the policy prices it so)
    shared_forks: bool = False  # a fork shares its parent's keys and values (llama.cpp's sequence copy: cells
    # tagged with one more sequence), so forking costs no memory or copy; False: a fork copies them (torch)
    verify_rows: int = 1 + MAX_K  # the most rows of one sequence a verification pass may feed, each row still given
    # the one-row pass's bits (the kernels checked that far): copies are verified up to verify_rows - 1 tokens


class Cache(Protocol):
    """One sequence's keys and values in one model; `tokens` are the ids it holds, `len(cache)` their count."""

    tokens: list[int]

    def __len__(self) -> int: ...

    def feed(self, ids: list[int], logits_to_keep: int = 1) -> torch.Tensor: ...  # [keep, vocab]

    def crop(self, length: int) -> None: ...

    def fork(self) -> Cache: ...

    def sync(self, ids: list[int], keep_last: int = 1) -> list[int]: ...

    def clock(self) -> float: ...

    def nbytes(self) -> int: ...


Feed = tuple[Cache, list[int], int]  # (cache, new token ids, how many of the last rows' logits to keep)


class LanguageModel(Protocol):
    name: str
    backend: str  # which library computes the logits: "torch" | "llama.cpp"
    tokenizer: Any
    cache_key: str | None
    capabilities: Capabilities
    max_sequences: int | None  # how many caches can live at once (llama.cpp's sequence ids); None: no bound
    startup_s: float  # one-off work the next pass does first (a lazily encoded input), in seconds; 0.0: none

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def context_length(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def weight_bytes(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...  # the keys and values one position of a cache holds

    def new_cache(self) -> Cache: ...

    def feed_together(self, feeds: list[Feed]) -> list[torch.Tensor]: ...

    def clock(self) -> float: ...

    def fingerprint(self, *extra: str) -> str: ...

    def optimize(self, mode: str = "auto", refresh: bool = False) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    # capabilities.first_layers
    def truncated(self, layers: int) -> LanguageModel: ...

    def exit_agreement(self, ids: list[int], positions: int | None) -> list[float]: ...

    def layer_costs(self) -> list[float]: ...


@runtime_checkable
class Computes(Protocol):
    """The verbs every backend model has, whatever its capabilities: `isinstance(x, Computes)` tells a loaded model
    from anything else (its name, say)."""

    def new_cache(self) -> Cache: ...

    def feed_together(self, feeds: list[Feed]) -> list[torch.Tensor]: ...


def synced(cache: Cache, ids: list[int], keep_last: int = 1) -> list[int]:
    """`Cache.sync` for any backend: crop `cache` to the longest prefix it shares with `ids`, leaving at least
    `keep_last` of them unfed; returns the tokens of `ids` that still have to be fed."""
    common = max(0, min(shared_prefix(cache.tokens, ids), len(ids) - keep_last))
    cache.crop(common)
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
