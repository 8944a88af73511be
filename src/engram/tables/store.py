"""Where an Engram table lives: the store interface and the in-memory store (the oracle).

Row ids are known before the forward pass (they depend on token ids only), so a store can be told
which rows are coming (``prefetch``) long before they are read (``lookup``). Every other tier (a
memory-mapped file, pinned host memory, a shared pool, a cache in front of any of them) implements
the same two calls and is tested against ``MemoryTable``. A store that holds some rows itself
and reads the rest from another (a cache) may also split its lookup in two (``SplitLookup``),
so a prefetcher reads only the missing rows, in the background.

Shape legend: r rows in the table, e row width (the head dim), ... any leading shape of row ids,
u distinct rows asked for, m of them missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class TableStore(Protocol):
    """Where a layer's rows live: ``lookup(rows)`` returns embeddings for global row ids and
    ``prefetch(rows)`` hints at rows needed soon. ``MemoryTable`` is the in-memory oracle;
    every tier of ``tables/registry.py`` implements the same protocol."""

    num_rows: int
    dim: int

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [...] (global ids, int64) -> embeddings [..., e]."""
        ...

    def prefetch(self, rows: torch.Tensor) -> None:
        """A hint that ``rows`` will be looked up soon; may start fetching them in the background."""
        ...


class Reserved(Protocol):
    """The first half of a split lookup: what the store held is copied out already."""

    miss_rows: torch.Tensor  # [m] rows still to read from the store's source (empty: none)


@runtime_checkable
class SplitLookup(TableStore, Protocol):
    """``lookup`` in two halves around a read of the missing rows, which may run anywhere (a
    prefetch worker): ``complete(r, source.lookup(r.miss_rows))`` with ``r = reserve(uniq)`` is
    ``lookup(uniq)``. ``engram.tables.cache.CachedTable`` is one; PrefetchTable uses it."""

    source: TableStore  # where the missing rows are read from
    device: torch.device  # where the store keeps rows (fetched rows are moved there)

    def reserve(self, uniq: np.ndarray, n: int | None = None,
                counts: np.ndarray | None = None) -> Reserved:
        """Distinct ascending rows ``uniq`` [u] (asked ``counts`` times each, ``n`` in all, for
        the store's statistics): take what is held now, name the rest."""
        ...

    def complete(self, reserved: Any, fetched: torch.Tensor | None) -> torch.Tensor:
        """The missing rows' values [m, e] (None when none were missing) -> rows [u, e]."""
        ...


@runtime_checkable
class StoredReads(Protocol):
    """A store whose rows are kept narrower than they are read (bf16, fp16, int8 or int4 table
    files): a cache in front of it keeps them so and widens them on each read (tables/cache.py),
    holding 2 to 7x the rows of an fp32 cache in the same bytes (issue 47)."""

    def stored_format(self) -> tuple[torch.dtype, int, tuple[str, int] | None] | None:
        """(dtype, row width, int8 / int4 blocks) where one array holds a row whole and narrower
        than it is read; None otherwise (fp32, or fp8, whose block scales are a second array)."""
        ...

    def gather_stored(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [n] as stored [n, w] (int8 / int4: their blocks' bytes), copied out."""
        ...


_DEFERRED = False  # inside deferred_rows(): MemoryTables are built without their rows
NORMAL_BLOCK = 16  # torch's CPU normal_ draws and transforms float32 values 16 at a time


@contextmanager
def deferred_rows():
    """MemoryTables built inside hold no rows (a [0, e] weight): each init records the generator
    state it starts from and advances the generator past the same draws, so the rest of the model
    initialises exactly as beside whole tables; ``normal_chunks`` then makes the rows anywhere
    (training from a file tier writes them to its files, never holding a table)."""
    global _DEFERRED
    before, _DEFERRED = _DEFERRED, True
    try:
        yield
    finally:
        _DEFERRED = before


def normal_chunks(num_rows: int, dim: int, std: float, g: torch.Generator,
                  chunk_rows: int = 1 << 14) -> Iterator[torch.Tensor]:
    """The rows [k, e] that ``normal_(std)`` of a whole [r, e] float32 table draws from ``g``, in
    row order, k <= ``chunk_rows`` (+ a short tail). Bit-identical to one call, the
    generator left where it leaves it: normal_ draws one uniform a value, then transforms whole
    blocks of 16, and redraws the last 16 values when the count is not a multiple of 16; chunks of
    16k values (the last >= 16) repeat exactly that."""
    k = max(chunk_rows // NORMAL_BLOCK, 1) * NORMAL_BLOCK
    a = 0
    while a < num_rows:
        b = min(num_rows, a + k)
        if (num_rows - b) * dim < NORMAL_BLOCK:  # a tail under one block joins this chunk
            b = num_rows
        yield torch.empty(b - a, dim).normal_(std=std, generator=g)
        a = b


class MemoryTable(nn.Module):
    """The whole table as one parameter [r, e] in memory.

    ``sparse=True`` makes the backward produce a sparse row gradient, so a row-wise optimiser touches
    only the rows a batch read (paper section 2.5: the tables are updated sparsely).
    """

    def __init__(self, num_rows: int, dim: int, sparse: bool = False, init_std: float = 1.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 rows: torch.Tensor | None = None):
        """``rows``: the table's rows as they are ([num_rows, dim], e.g. read from table files),
        taken as the weight (its dtype and device): nothing drawn, the global generator untouched."""
        super().__init__()
        if num_rows <= 0 or dim <= 0:
            raise ValueError(f"a table needs positive rows and width, got {num_rows} x {dim}")
        self.num_rows, self.dim, self.sparse, self.init_std = int(num_rows), int(dim), sparse, init_std
        # no rows here: init_state says how to make them (deferred_rows)
        self.deferred = _DEFERRED and rows is None
        self.init_state: torch.Tensor | None = None
        if rows is not None:
            if tuple(rows.shape) != (self.num_rows, self.dim):
                raise ValueError(f"rows of shape {tuple(rows.shape)} for a {num_rows} x {dim} table")
            self.weight = nn.Parameter(rows)
            return
        self.weight = nn.Parameter(torch.empty(0 if self.deferred else self.num_rows, self.dim,
                                               dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """N(0, init_std) rows (std 1 like nn.Embedding, which the official demo uses), drawn from
        ``generator`` (EngramLM's per-parameter one) or the global generator."""
        if not self.deferred:
            if not self.weight.is_meta:
                self.weight.data.normal_(0.0, self.init_std, generator=generator)
            return
        if generator is not None:  # its rows are drawn from this state (tier_attach.initial_rows)
            self.init_state = generator.get_state()
            return
        self.init_state = torch.get_rng_state()
        g = torch.Generator()
        g.set_state(self.init_state)
        for _ in normal_chunks(self.num_rows, self.dim, self.init_std, g):
            pass  # the global generator moves past the table's draws, as a whole table's init
        torch.set_rng_state(g.get_state())

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        return F.embedding(rows, self.weight, sparse=self.sparse)

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # already resident

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, sparse={self.sparse}"
