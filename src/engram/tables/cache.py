"""A hot-row cache in front of any table store, and the n-gram row frequencies that seed it.

N-gram traffic is Zipfian (spec section 4), so a small cache catches most reads: a static part holds
the top-k rows by frequency measured on a token stream (they never leave), and an LRU part adapts
to the rest. Everything is vectorised over a batch's rows; the LRU is exact at row granularity with
a documented order inside a batch, so its hit/miss counts can be checked against a plain reference.

Shape legend: r rows in the table, e row width, n row ids asked for, u distinct ids among them,
C cache capacity (static + LRU slots), w a row's width as the tier stores it (e, or int8 / int4
blocks' bytes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..retrieval.hashing import NgramHasher
from .fp8 import StoredRows
from .store import StoredReads, TableStore
from .tiers import check_rows


@dataclass
class CacheStats:
    lookups: int = 0  # row ids asked for (every occurrence)
    hits: int = 0  # occurrences whose row was cached before the call
    fetched: int = 0  # distinct rows read from the tier behind the cache

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "hits": self.hits, "misses": self.misses,
                "fetched": self.fetched, "hit_rate": self.hit_rate}


@dataclass
class Reservation:
    """A lookup between its two halves: hits copied out, misses still to be fetched."""
    uniq: np.ndarray  # [u] distinct rows, ascending
    slots: np.ndarray  # [u] their cache slots before the call (-1: miss)
    values: torch.Tensor  # [u, w] hits filled in, misses not yet (as the cache holds rows)
    miss: np.ndarray  # [misses] positions in uniq of the misses
    miss_rows: torch.Tensor  # [misses] the rows to fetch from the tier behind


class CachedTable:
    """``inner`` behind a cache of ``capacity`` rows: ``hot_rows`` pinned, LRU for the rest.

    LRU semantics, exact: a lookup first classifies every occurrence as hit or miss against the
    cache as it was before the call; then its distinct non-static rows are touched in ascending id
    order (a hit moves to most recent; a miss is inserted, evicting the least recent), as a
    row-by-row LRU would. Misses are read from ``inner`` once each.

    A lookup has two halves, so a prefetcher can fetch only the misses in the background:
    ``reserve(rows)`` (classify, copy the hits out) and ``complete(reservation, fetched)`` (fill the
    misses in, update the LRU). The bookkeeping is numpy (a decode step's lookup of ~100 rows costs
    tens of microseconds; torch's per-op overhead would be 10x that) and the LRU order is a queue
    with lazy deletion, so finding victims never scans the cache.

    A serving structure: rows come back without autograd history (train on MemoryTable).

    Its arguments:

    - ``inner``: the slower store (a FileTable, a PinnedTable, a SharedPool's table, ...).
    - ``capacity``: total cached rows C (static + LRU).
    - ``hot_rows``: rows to pin, most important first (``hot_rows(counts, k)``); at most C are kept.
    - ``device``: where cached rows live (an accelerator's memory for a device-side hot cache).

    Rows are held as the tier stores them where it stores them narrower than it reads them
    (``StoredReads``: bf16, fp16, int8, int4 table files; issue 47), on the CPU: an int8 row of 32
    values takes 34 bytes, not 128, and every read widens it as the tier's own read does
    (fp8.StoredRows), so a cached row reads bit for bit as the tier gives it.
    """

    @torch.no_grad()
    def __init__(self, inner: TableStore, capacity: int, hot_rows: torch.Tensor | None = None,
                 device: torch.device | str = "cpu"):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.inner, self.num_rows, self.dim = inner, inner.num_rows, inner.dim
        self.capacity = int(min(capacity, inner.num_rows))
        self.device = torch.device(device)
        hot = (np.empty(0, np.int64) if hot_rows is None
               else check_rows(hot_rows, self.num_rows).numpy())
        _, first = np.unique(hot, return_index=True)  # drop repeats, keep the given order
        hot = hot[np.sort(first)][: self.capacity]
        self.n_static = S = hot.size
        self.n_lru = n_lru = self.capacity - S
        sample = inner.lookup(torch.from_numpy(hot[:1]) if S else torch.zeros(1, dtype=torch.long))
        self.out_dtype = sample.dtype
        self.stored = (inner.stored_format() if isinstance(inner, StoredReads)
                       and self.device.type == "cpu" else None)  # (dtype, w, blocks) or None
        dtype, width, self.blocks = self.stored or (self.out_dtype, self.dim, None)
        self._fetch = inner.gather_stored if self.stored else inner.lookup
        self.slot = np.full(self.num_rows, -1, dtype=np.int32)  # [r] row -> slot, or -1
        self.row_of = np.full(self.capacity, -1, dtype=np.int64)  # [C] slot -> row, or -1
        self.values = torch.empty(self.capacity, width, dtype=dtype,
                                  device=self.device)  # [C, w]
        # Recency per LRU slot (slot S + i); empty slots get distinct stamps below every real one,
        # so they fill first and in slot order. The queue lists (LRU slot, stamp) in stamp order;
        # an entry is live while the slot still has that stamp.
        self.stamp = np.arange(-n_lru, 0, dtype=np.int64)  # [C - S]
        self._q_slot = np.arange(n_lru, dtype=np.int64)
        self._q_stamp = self.stamp.copy()
        self._head, self._tail = 0, n_lru
        self.clock = 0
        for a in range(0, S, 1 << 16):
            part = torch.from_numpy(hot[a:a + (1 << 16)])
            self.values[a:a + part.numel()] = self._fetch(part).to(self.device)
        self.slot[hot] = np.arange(S, dtype=np.int32)
        self.row_of[:S] = hot
        self.stats = CacheStats()
        self._lock = threading.Lock()  # a prefetch worker and the caller may both look up

    # -- the store protocol ------------------------------------------------------------------------
    @property
    def source(self) -> TableStore:
        """Where misses are read from (the SplitLookup protocol, engram.tables.store): the tier,
        or its rows as stored when the cache holds them so."""
        return _AsStored(self.inner) if self.stored else self.inner

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held."""
        return self.values.numel() * self.values.element_size()

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        flat = check_rows(rows, self.num_rows).numpy()  # [n]
        uniq, inv = np.unique(flat, return_inverse=True)  # [u], [n]
        res = self.reserve(uniq, flat.size, _counts(inv, uniq.size))
        fetched = self._fetch(res.miss_rows) if res.miss.size else None
        vals = self.complete(res, fetched)  # [u, e]
        return vals.index_select(0, torch.from_numpy(inv).to(self.device)).view(*rows.shape,
                                                                                self.dim)

    def prefetch(self, rows: torch.Tensor) -> None:
        self.inner.prefetch(rows)

    # -- the two halves (engram.tables.store.SplitLookup) ------------------------------------------
    @torch.no_grad()
    def reserve(self, uniq: np.ndarray, n: int | None = None,
                counts: np.ndarray | None = None) -> Reservation:
        """Classify distinct ascending rows ``uniq`` [u] (asked ``counts`` times each, ``n`` in all)
        and copy out the hits."""
        with self._lock:
            slots = self.slot[uniq].astype(np.int64)  # [u]
            hit = slots >= 0
            self.stats.lookups += uniq.size if n is None else n
            self.stats.hits += int(hit.sum() if counts is None else counts[hit].sum())
            vals = torch.empty(uniq.size, self.values.shape[1], dtype=self.values.dtype,
                               device=self.device)  # [u, w]
            h = np.flatnonzero(hit)
            if h.size:
                _copy_rows(vals, h, self.values, slots[h])
            miss = np.flatnonzero(~hit)
            self.stats.fetched += miss.size
            return Reservation(uniq, slots, vals, miss, torch.from_numpy(uniq[miss]))

    @torch.no_grad()
    def complete(self, res: Reservation, fetched: torch.Tensor | None) -> torch.Tensor:
        """Fill the misses' rows [misses, w] in and update the LRU; -> values [u, e]."""
        vals = res.values
        if res.miss.size:
            _copy_rows(vals, res.miss, fetched.to(self.device, vals.dtype), slice(None))
        with self._lock:
            self._touch(res.uniq, res.slots, vals)
        if self.stored:  # widened as the tier's own read widens them
            return StoredRows(vals, None, self.blocks).gather(None, self.out_dtype)
        return vals

    # -- LRU ---------------------------------------------------------------------------------------
    def _touch(self, uniq: np.ndarray, slots: np.ndarray, vals: torch.Tensor) -> None:
        """Touch the distinct non-static rows in ascending order, as a row-by-row LRU would.

        ``slots`` are from the reservation; a row that another lookup evicted or cached since then
        is looked up again here, so interleaved reservations keep the cache consistent.
        """
        S, n_lru = self.n_static, self.n_lru
        slots = self.slot[uniq].astype(np.int64)
        dyn = np.flatnonzero((slots < 0) | (slots >= S))  # [m] positions the LRU part handles
        if n_lru == 0 or dyn.size == 0:
            return
        rows_d, slots_d, m = uniq[dyn], slots[dyn], dyn.size
        stamps = self.clock + np.arange(m)  # ascending row order = touch order
        self.clock += m
        if m >= n_lru:  # only the last n_lru touched rows survive: rebuild the LRU part
            keep = slice(m - n_lru, m)
            old = self.row_of[S:]
            self.slot[old[old >= 0]] = -1
            self.row_of[S:] = rows_d[keep]
            self.slot[rows_d[keep]] = np.arange(S, self.capacity, dtype=np.int32)
            _copy_rows(self.values, slice(S, None), vals, dyn[keep])
            self.stamp[:] = stamps[keep]
            self._q_slot, self._q_stamp = np.arange(n_lru), self.stamp.copy()
            self._head, self._tail = 0, n_lru
            return
        hit = slots_d >= 0
        lslot = np.empty(m, dtype=np.int64)  # LRU slot of each touched row
        lslot[hit] = slots_d[hit] - S
        self.stamp[lslot[hit]] = stamps[hit]  # their old queue entries go stale
        new = np.flatnonzero(~hit)
        if new.size:
            victims = self._pop(new.size)  # the least recent slots; m < n_lru leaves enough
            old = self.row_of[victims + S]
            self.slot[old[old >= 0]] = -1
            self.row_of[victims + S] = rows_d[new]
            self.slot[rows_d[new]] = (victims + S).astype(np.int32)
            _copy_rows(self.values, victims + S, vals, dyn[new])
            self.stamp[victims] = stamps[new]
            lslot[new] = victims
        self._push(lslot, stamps)

    def _pop(self, k: int) -> np.ndarray:
        """The k live queue entries with the oldest stamps (consumed)."""
        out, need = [], k
        while need:
            end = min(self._tail, self._head + max(2 * need, 256))
            if end == self._head:
                raise RuntimeError("LRU queue exhausted (a bug: every LRU slot has a live entry)")
            qs = self._q_slot[self._head:end]
            live = np.flatnonzero(self.stamp[qs] == self._q_stamp[self._head:end])[:need]
            out.append(qs[live])
            need -= live.size
            self._head = self._head + int(live[-1]) + 1 if need == 0 else end
        return np.concatenate(out)

    def _push(self, lslot: np.ndarray, stamps: np.ndarray) -> None:
        if self._tail + lslot.size > self._q_slot.size:  # compact to the live entries, then grow
            qs, st = self._q_slot[self._head:self._tail], self._q_stamp[self._head:self._tail]
            live = self.stamp[qs] == st
            qs, st = qs[live], st[live]
            size = max(4 * self.n_lru, 2 * (qs.size + lslot.size))
            self._q_slot, self._q_stamp = np.empty(size, np.int64), np.empty(size, np.int64)
            self._q_slot[:qs.size], self._q_stamp[:qs.size] = qs, st
            self._head, self._tail = 0, qs.size
        self._q_slot[self._tail:self._tail + lslot.size] = lslot
        self._q_stamp[self._tail:self._tail + lslot.size] = stamps
        self._tail += lslot.size

    # -- inspection --------------------------------------------------------------------------------
    def cached_rows(self) -> torch.Tensor:
        """Rows held now (static first, then LRU slots in slot order)."""
        r = self.row_of
        return torch.from_numpy(r[r >= 0])

    def reset_stats(self) -> None:
        self.stats = CacheStats()

    def __repr__(self) -> str:
        return (f"CachedTable(capacity={self.capacity}, static={self.n_static}, "
                f"hit_rate={self.stats.hit_rate:.3f}, inner={self.inner!r})")


def _copy_rows(dst: torch.Tensor, di: Any, src: torch.Tensor, si: Any) -> None:
    """dst[di] = src[si] for numpy index arrays or slices. On the CPU through numpy views: for the
    ~100 rows of a decode step that is several times cheaper than torch's advanced indexing."""
    if dst.device.type == "cpu" and dst.dtype in _NUMPY_OK and src.dtype == dst.dtype:
        dst.numpy()[di] = src.numpy()[si]
        return
    ix = [i if isinstance(i, slice) else torch.from_numpy(i).to(dst.device) for i in (di, si)]
    dst[ix[0]] = src[ix[1]]


_NUMPY_OK = (torch.float32, torch.float16, torch.float64, torch.uint8)


class _AsStored:
    """A StoredReads tier whose lookup gives its rows as stored: what a cache holding rows so
    reads its misses from (a prefetch worker among them)."""

    def __init__(self, inner: Any):
        self.inner, self.num_rows, self.dim = inner, inner.num_rows, inner.dim

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        return self.inner.gather_stored(rows)

    def prefetch(self, rows: torch.Tensor) -> None:
        self.inner.prefetch(rows)


def _counts(inv: np.ndarray, u: int) -> np.ndarray:
    return np.bincount(inv, minlength=u)


def build_cache(store: TableStore, counts: torch.Tensor, fraction: float,
                static_share: float = 0.9, device: torch.device | str = "cpu") -> CachedTable:
    """A cache of ``fraction`` of the table's rows: ``static_share`` of it the most frequent rows by
    ``counts`` (``count_rows`` on training text), the rest LRU.

    Why 0.9: on held-out text (benchmarks/offload.py, King James Bible + People's Daily) frequency
    on the training split predicts reads better than recency; at 1% of the table static-only hits
    23.6%, 90/10 23.3%, 50/50 22.0%, LRU-only 16.1%, and 90/10 is best at 10%.
    """
    cap = int(fraction * store.num_rows)
    return CachedTable(store, cap, hot_rows(counts, int(static_share * cap)), device=device)


# -- n-gram row frequencies ------------------------------------------------------------------------

def count_rows(hasher: NgramHasher, tokens: Any, layers: list[int] | None = None,
               window: int = 1 << 15) -> dict[int, torch.Tensor]:
    """``{layer: counts [r]}``: how often each global row of a plain hasher's tables is read over a
    raw token stream [n] (``hasher.count_reads``'s cold part, for ``layers`` or every layer)."""
    reads = hasher.count_reads(tokens, window)
    return {lid: reads[lid]["cold"] for lid in (hasher.layer_ids if layers is None else layers)}


def hot_rows(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent rows (ties by lower id), most frequent first; never rows never seen."""
    k = min(int(k), int((counts > 0).sum()))
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    # Stable sort on -count keeps ties in id order, so the choice is reproducible.
    return torch.sort(-counts, stable=True).indices[:k]


def zipf_exponent(counts: torch.Tensor, min_rank: int = 1, max_rank: int | None = None) -> float:
    """Least-squares slope s of log(frequency) = c - s log(rank) over ranks [min_rank, max_rank]."""
    f = torch.sort(counts[counts > 0].double(), descending=True).values
    hi = f.numel() if max_rank is None else min(max_rank, f.numel())
    if hi - min_rank < 2:
        raise ValueError("too few distinct rows to fit a Zipf exponent")
    ranks = torch.arange(min_rank, hi + 1, dtype=torch.float64)
    x, y = ranks.log(), f[min_rank - 1:hi].log()
    x0, y0 = x - x.mean(), y - y.mean()
    return float(-(x0 * y0).sum() / (x0 * x0).sum())
