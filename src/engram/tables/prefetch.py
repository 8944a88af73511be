"""Prefetch: gather each Engram layer's rows in the background while the layers before it compute.

Row ids depend on token ids only (paper section 2.5, spec section 4), so when a batch arrives the
engine hashes it for every Engram layer at once and hands each layer's rows to its table's
``prefetch``; a worker de-duplicates them, looks them up through the cache, reads the misses from
the slow tier and (with CUDA) copies them to the device on a side stream from a pinned staging
buffer. The forward pass runs meanwhile; an Engram layer's ``lookup`` waits only for its own
layer's gather (one future per layer and batch). The paper's budget: the gather for layer k must
finish within the compute of layers 1..k-1.

The model needs no change: ``PrefetchTable`` is a store like any other, so
``EngramLM(config, tables={layer: PrefetchTable(...)})`` is all it takes.

Shape legend: n row ids of a batch (b * t * H), u distinct ids among them, e row width.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .store import SplitLookup, TableStore
from .tiers import check_rows


@dataclass
class PrefetchStats:
    prefetched: int = 0  # batches gathered in the background
    used: int = 0  # lookups served by a prefetched gather
    sync: int = 0  # lookups with no matching prefetch, gathered on the spot
    inline: int = 0  # prefetched reads no worker had started yet: run by the layer itself
    dropped: int = 0  # prefetches never looked up (evicted by newer ones)
    wait_s: float = 0.0  # time lookups spent waiting for their gather (0 = fully overlapped)


class PrefetchTable:
    """``inner`` with background gathers: ``prefetch(rows)`` starts one, ``lookup(rows)`` joins it.

    ``prefetch`` de-duplicates the rows in the caller's thread; when ``inner`` splits its lookup
    (``engram.tables.store.SplitLookup``: a ``engram.tables.cache.CachedTable``) it
    reserves them there at once and hands only the misses to a worker, which reads them from the
    inner store's source (the tier behind the cache). A lookup whose rows match no pending
    prefetch reads through ``inner`` directly, so results never depend on whether a prefetch
    happened (tested: prefetched model output == in-memory output).

    A serving structure: rows come back without autograd history.

    Its arguments:

    - ``inner``: the store behind (a CachedTable over a FileTable, a PinnedTable, ...).
    - ``executor``: worker threads, shared by all layers of a model (``wrap_prefetch``).
    - ``device``: where rows are needed; with a CUDA device the worker stages them in pinned host
      memory and copies them on a side stream, and the lookup makes the compute stream wait
      for that copy only. Give a cache in front ``device="cuda"`` too, so hits stay there.
    - ``max_pending``: prefetches kept waiting for their lookup; older ones are dropped.
    """

    def __init__(self, inner: TableStore, executor: ThreadPoolExecutor | None = None, *,
                 device: torch.device | str | None = None, max_pending: int = 4):
        self.inner, self.num_rows, self.dim = inner, inner.num_rows, inner.dim
        self._own = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch")
        self.device = None if device is None else torch.device(device)
        self.max_pending = max_pending
        self._split = isinstance(inner, SplitLookup)
        self._stream = (torch.cuda.Stream(self.device)
                        if self.device is not None and self.device.type == "cuda" else None)
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.stats = PrefetchStats()

    # -- the caller's side, when the batch arrives -------------------------------------------------
    def prefetch(self, rows: torch.Tensor) -> None:
        flat = check_rows(rows, self.num_rows)  # [n]
        # Zipfian text repeats rows a lot within a batch: each distinct row is read once.
        uniq, inv = np.unique(flat.numpy(), return_inverse=True)  # [u], [n]
        if self._split:
            res = self.inner.reserve(uniq, flat.numel(), np.bincount(inv, minlength=uniq.size))
            args = ((self.inner.source, res.miss_rows, self.inner.device)
                    if res.miss_rows.numel() else None)
        else:
            res, args = None, (self.inner, torch.from_numpy(uniq), self.device)
        job = None if args is None else self.executor.submit(self._fetch, *args)
        with self._lock:
            self._pending.append(_Pending(flat, inv, res, job, args))
            self.stats.prefetched += 1
            while len(self._pending) > self.max_pending:
                old = self._pending.popleft()
                if old.job is not None:
                    old.job.cancel()
                self.stats.dropped += 1

    # -- the worker's side -------------------------------------------------------------------------
    @torch.no_grad()
    def _fetch(self, store: TableStore, rows: torch.Tensor,
               device: torch.device | None) -> tuple[torch.Tensor, Any]:
        """Rows [u] from ``store`` -> (values [u, e] on ``device``, CUDA event or None)."""
        if device is None or device.type != "cuda" or self._stream is None:
            vals = store.lookup(rows)
            return (vals if device is None else vals.to(device)), None
        # The store's lookup runs on the side stream too: a store that copies to the device itself
        # (a PinnedTable on "cuda", PinnedTable's default with CUDA) then copies there, and the
        # event below covers its copy; pinning such rows (already on the device) would raise.
        with torch.cuda.stream(self._stream):
            vals = store.lookup(rows)
            if vals.device.type == "cpu" and not vals.is_pinned():
                vals = vals.pin_memory()
            dev = vals.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return dev, event

    # -- the layer's side --------------------------------------------------------------------------
    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        flat = check_rows(rows, self.num_rows)
        entry = self._take(flat)
        if entry is None:
            self.stats.sync += 1
            with torch.no_grad():
                out = self.inner.lookup(flat)
            out = out if self.device is None else out.to(self.device)
            return out.view(*rows.shape, self.dim)
        fetched = None
        if entry.job is not None:
            t0 = time.perf_counter()
            if entry.job.cancel():
                # No worker got to it (busy, or no free CPU): reading it here beats waiting for
                # one to be scheduled, so the worst case is a plain synchronous read.
                fetched, event = self._fetch(*entry.args)
                self.stats.inline += 1
            else:
                fetched, event = entry.job.result()
            self.stats.wait_s += time.perf_counter() - t0
            if event is not None:
                stream = torch.cuda.current_stream(fetched.device)
                stream.wait_event(event)  # only this layer's copy, not the whole side stream
                fetched.record_stream(stream)
        self.stats.used += 1
        vals = fetched if entry.res is None else self.inner.complete(entry.res, fetched)  # [u, e]
        if self.device is not None:
            vals = vals.to(self.device)
        out = vals.index_select(0, torch.from_numpy(entry.inv).to(vals.device))  # [n, e]
        return out.view(*rows.shape, self.dim)

    def _take(self, flat: torch.Tensor) -> _Pending | None:
        with self._lock:
            for i, p in enumerate(self._pending):
                if p.rows.numel() == flat.numel() and torch.equal(p.rows, flat):
                    del self._pending[i]
                    return p
        return None

    def close(self) -> None:
        with self._lock:
            for p in self._pending:
                if p.job is not None:
                    p.job.cancel()
            self._pending.clear()
        if self._own:
            self.executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"PrefetchTable(inner={self.inner!r}, device={self.device})"


@dataclass
class _Pending:
    rows: torch.Tensor  # [n] as asked
    inv: np.ndarray  # [n] position of each in the distinct rows
    res: Any  # the SplitLookup's reservation, or None
    job: Future | None  # the background read (None: everything was a cache hit)
    args: tuple | None  # its arguments, to run it inline if no worker has started it


def wrap_prefetch(tables: dict[int, TableStore], workers: int | None = None,
                  device: torch.device | str | None = None,
                  **kwargs: Any) -> dict[int, PrefetchTable]:
    """Wrap every layer's store in a PrefetchTable sharing one pool (one worker per layer by
    default, so the first layer's rows are not queued behind a later layer's)."""
    pool = ThreadPoolExecutor(workers or max(1, len(tables)), thread_name_prefix="engram-prefetch")
    return {lid: PrefetchTable(t, pool, device=device, **kwargs) for lid, t in tables.items()}


def prefetch_batch(model: Any, hash_ids: dict[int, torch.Tensor]) -> None:
    """Announce a batch's rows to every Engram layer's table (call before ``model(...)``).

    All layers' ids come from one hashing pass over the token ids; each table gets its own layer's
    global rows, which it may start gathering at once.
    """
    for lid, engram in model.engrams().items():
        if engram.table is not None:
            engram.table.prefetch(engram.rows(hash_ids[lid]))
