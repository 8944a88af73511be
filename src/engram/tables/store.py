"""Where an Engram table lives: the store interface and the in-memory store (the oracle).

Row ids are known before the forward pass (they depend on token ids only), so a store can be told
which rows are coming (``prefetch``) long before they are read (``lookup``). Every other tier (a
memory-mapped file, pinned host memory, a shared pool, a cache in front of any of them) implements
the same two calls and is tested against :class:`MemoryTable`. A store that holds some rows itself
and reads the rest from another (a cache) may also split its lookup in two (:class:`SplitLookup`),
so a prefetcher reads only the missing rows, in the background.

Shape legend: r rows in the table, e row width (the head dim), ... any leading shape of row ids,
u distinct rows asked for, m of them missing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class TableStore(Protocol):
    """Where a layer's rows live: ``lookup(rows)`` returns embeddings for global row ids and
    ``prefetch(rows)`` hints at rows needed soon. :class:`MemoryTable` is the in-memory oracle;
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
    ``lookup(uniq)``. :class:`engram.tables.cache.CachedTable` is one; PrefetchTable uses it."""

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


class MemoryTable(nn.Module):
    """The whole table as one parameter [r, e] in memory.

    ``sparse=True`` makes the backward produce a sparse row gradient, so a row-wise optimiser touches
    only the rows a batch read (paper section 2.5: the tables are updated sparsely).
    """

    def __init__(self, num_rows: int, dim: int, sparse: bool = False, init_std: float = 1.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if num_rows <= 0 or dim <= 0:
            raise ValueError(f"a table needs positive rows and width, got {num_rows} x {dim}")
        self.num_rows, self.dim, self.sparse, self.init_std = int(num_rows), int(dim), sparse, init_std
        self.weight = nn.Parameter(torch.empty(self.num_rows, self.dim, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # N(0, 1) like nn.Embedding, which the official demo uses.
        nn.init.normal_(self.weight, std=self.init_std)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        return F.embedding(rows, self.weight, sparse=self.sparse)

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # already resident

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, sparse={self.sparse}"
