"""The tiers the pool budget reads from, and the reads it times.

Every tier serves the same rows (the model's tables): each tier of ``engram.tables.registry``
(memory, file, pinned, shared, the DAX/CXL pool region, Mooncake, sharded) opened from its own copy
of the exported table files, plus ``file_cold`` (a table file with its pages evicted before every
read) and ``<tier>_cache`` (behind the hot cache). ``<tier>_fp8`` exports the tables as
DeepSeek-V4.1 stores them, FP8 values with E8M0 scales (264 bytes a row of head dim 256, not
1,024), read and dequantised in one pass (tables/fp8.py StoredRows); its rows are the fp32 ones
quantised. Each name is opened by the registry (its ``Opened``) and read through
``BudgetTables``. A read is one step's rows for one Engram layer; ``DelayedTable`` injects latency
per round trip of reads to model a farther medium with the same rows.

Shape legend: b batch, t positions of the step, H hash heads, u distinct rows of a step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.model import EngramLM
from ..tables.cache import CachedTable
from ..tables.registry import TIERS as REGISTERED
from ..tables.registry import Opened
from ..tables.store import TableStore
from ..tables.tiers import FileTable
from .pool_steps import Setup, step_group

COLD = ("file",)  # tiers whose pages can be evicted before every read (FileTable.evict)
# Tiers that serve FP8 + E8M0 table files (Mooncake publishes fp32 copies of any file).
FP8 = ("memory", "file", "pinned", "shared", "pool")
# Every name the budget measures: <registered tier>[_fp8][_cold][_cache].
TIERS = tuple(f"{t}{fp8}{cold}{cache}" for t in REGISTERED for fp8 in ("", "_fp8")
              for cold in ("", "_cold") for cache in ("", "_cache")
              if (not cold or t in COLD) and (not fp8 or t in FP8))
FP8_BLOCK = 32  # values per E8M0 scale, as DeepSeek-V4.1 stores its tables
FP8_POOL = ".fp8"  # suffix of the pool region the fp8 pool tiers fill beside pool_path


def split_name(name: str) -> tuple[str, bool, bool, bool]:
    """(registered tier, pages evicted before every read, behind the hot cache, FP8 + E8M0
    table files)."""
    if name not in TIERS:
        raise ValueError(f"unknown tier {name!r}; choose from {TIERS}")
    cache = name.endswith("_cache")
    base = name.removesuffix("_cache")
    cold = base.endswith("_cold")
    base = base.removesuffix("_cold")
    return base.removesuffix("_fp8"), cold, cache, base.endswith("_fp8")


def stored_row_bytes(name: str, head_dim: int) -> int:
    """Bytes a tier reads per row: fp32, or FP8 values and their E8M0 scales (``_fp8``)."""
    from ..tables.fp8 import row_bytes

    return row_bytes(head_dim, "fp8+e8m0" if split_name(name)[3] else "fp32", FP8_BLOCK)


# -- the tiers -------------------------------------------------------------------------------------

@dataclass
class BudgetTables:
    """What the budget reads for one of its tier names: the registered tier's ``Opened`` (its
    stores, closed when the budget is done) as one store per Engram layer, maybe behind the hot
    cache, and what a timed read needs around it (pages to evict, cache counters)."""
    stores: dict[int, TableStore]  # per Engram layer: what a read times
    cold: list[FileTable]  # whose pages are evicted before every read (cold tiers)
    caches: dict[int, CachedTable]  # per layer: the hot cache in front, if any
    opened: Opened | None = None  # the registry's; None: stores the budget wraps itself (sweep)

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()


def export_files(setup: Setup, folder: Path, fp8: bool = False) -> None:
    """The model's tables as table files: fp32, or FP8 values with E8M0 scales (``fp8``)."""
    from ..tables.tablefile import table_path, write_table

    cfg = setup.model.config.engram
    fmt = {"dtype": "fp8", "scale_format": "e8m0", "scale_block": FP8_BLOCK} if fp8 else {}
    for lid, e in setup.model.engrams().items():
        write_table(table_path(folder, lid), e.table.weight.detach(), layer_id=lid, config=cfg,
                    profile=setup.hasher.profile(lid), tag="pool-budget", **fmt)


def build_tiers(setup: Setup, names: tuple[str, ...], folder: Path, *, pool_path: str,
                cache_fraction: float,
                counts: dict[int, torch.Tensor] | None = None) -> dict[str, BudgetTables]:
    """Every requested tier over the same rows, each opened by the registry from its own copy of
    the table files (so evicting one copy's pages leaves the others warm). ``pool_path``: where
    the pool tier's region lives (a DAX device, a file on /dev/shm, ...; the fp8 pool tiers' at
    ``pool_path + FP8_POOL``)."""
    from ..tables.cache import build_cache
    from ..tables.registry import open_parts_on

    cfg, hasher = setup.model.config.engram, setup.hasher
    out: dict[str, BudgetTables] = {}
    try:
        for name in names:
            base, cold, cache, fp8 = split_name(name)
            export_files(setup, folder / name, fp8)  # written and fsynced: evictable at once
            # fp8 tiers fill a region of their own (the same tag would pass the fp32 one as
            # current)
            options = {"pool_path": pool_path + FP8_POOL * fp8} if base == "pool" else {}
            # verify reads every byte once: a warm tier's page cache is warm
            opened = open_parts_on(base, folder / name, cfg, hasher, verify=not cold, **options)
            stores = {lid: t for (_, lid), t in opened.parts.items()}
            caches = ({lid: build_cache(s, counts[lid], cache_fraction)
                       for lid, s in stores.items()} if cache else {})
            out[name] = BudgetTables(caches or stores, list(stores.values()) if cold else [],
                                     caches, opened)
    except BaseException:
        for tier in out.values():
            tier.close()
        raise
    return out


# -- reads -----------------------------------------------------------------------------------------

class DelayedTable:
    """``inner`` with latency injected per round trip: a read of u distinct rows waits
    ceil(u / inflight) x ``extra_s`` more (spinning: sleep is too coarse for microseconds).
    Models a farther medium (CXL, remote DRAM, an RDMA round trip) with the same rows."""

    def __init__(self, inner: TableStore, extra_s: float, inflight: int):
        self.inner, self.extra_s, self.inflight = inner, extra_s, inflight
        self.num_rows, self.dim = inner.num_rows, inner.dim

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.inner.lookup(rows)
        a = np.sort(rows.reshape(-1).numpy())  # distinct count: sort + diff is ~10x np.unique here
        u = int(a.size and np.count_nonzero(np.diff(a)) + 1)
        until = time.perf_counter() + math.ceil(u / self.inflight) * self.extra_s  # L0 + trips x d
        while time.perf_counter() < until:
            pass
        return out

    def prefetch(self, rows: torch.Tensor) -> None:
        self.inner.prefetch(rows)


@torch.no_grad()
def time_reads(tier: BudgetTables,
               rows: list[dict[int, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """Per Engram layer: median latency of reading a step's rows, rows/s, distinct rows, misses."""
    out = {}
    for lid, store in tier.stores.items():
        lat, dist, miss = [], [], []
        for i, step in enumerate([rows[0]] + rows):  # the first is a warm-up
            for f in tier.cold:
                f.evict()
            cache = tier.caches.get(lid)
            before = cache.stats.fetched if cache is not None else 0
            t0 = time.perf_counter()
            store.lookup(step[lid])
            dt = time.perf_counter() - t0
            if i:
                u = np.unique(step[lid].numpy()).size
                lat.append(dt)
                dist.append(u)
                miss.append(cache.stats.fetched - before if cache is not None else u)
        n = rows[0][lid].numel()
        out[lid] = {"latency_s": float(np.median(lat)), "rows": n,
                    "distinct": float(np.median(dist)), "misses": float(np.median(miss)),
                    "rows_per_s": n / float(np.median(lat))}
    return out


@torch.no_grad()
def time_prefetched(setup: Setup, tier: BudgetTables, batch: list[dict]) -> dict[str, Any]:
    """The model served from the tier behind PrefetchTable: each layer's rows are announced when
    the step starts; the wait each Engram layer sees for its rows (0: the read fit its window)."""
    from ..serving.loader import load_dense_state
    from ..tables.prefetch import wrap_prefetch

    tables = wrap_prefetch(tier.stores)
    model = EngramLM(setup.model.config, tables=tables)
    load_dense_state(model, setup.model.state_dict())
    rt = replace(setup.rt, model=model.eval(), tables=tables)
    waits = {lid: [] for lid in tables}
    fwd = []
    for i, step in enumerate([batch[0]] + batch):
        group = step_group(rt, step)
        for f in tier.cold:
            f.evict()
        w0 = {lid: t.stats.wait_s for lid, t in tables.items()}
        t0 = time.perf_counter()
        rt.run(step["step"], group)  # ids known at the step's start: reads begin as it does
        if i:
            fwd.append(time.perf_counter() - t0)
            for lid, t in tables.items():
                waits[lid].append(t.stats.wait_s - w0[lid])
    for t in tables.values():
        t.close()
    tables[next(iter(tables))].executor.shutdown(wait=True)
    return {"forward_s": float(np.median(fwd)),
            "wait_s": {lid: float(np.median(w)) for lid, w in waits.items()}}


@torch.no_grad()
def sweep(base: BudgetTables, rows: list[dict], inject_us: tuple[float, ...], inflight: int,
          counts: dict[int, torch.Tensor] | None, cache_fraction: float,
          stop_s: float = math.inf) -> dict[str, Any]:
    """Read latency of each layer's step rows with latency injected per round trip, straight from
    the base tier and behind a fresh hot cache (only misses pay the trip). Once every layer's read
    takes longer than ``stop_s`` the larger injections are not run (latency None)."""
    from ..tables.cache import build_cache

    out: dict[str, Any] = {"inject_us": list(inject_us), "inflight": inflight}
    for variant in ("pool", "pool_cache"):
        if variant == "pool_cache" and counts is None:
            continue
        res = {lid: [] for lid in base.stores}
        for us in inject_us:
            if all(pts and (pts[-1]["latency_s"] or math.inf) > stop_s for pts in res.values()):
                for pts in res.values():
                    pts.append({"latency_s": None, "misses": pts[-1]["misses"]})
                continue
            stores = {lid: DelayedTable(s, us * 1e-6, inflight) for lid, s in base.stores.items()}
            caches = {}
            if variant == "pool_cache":
                caches = {lid: build_cache(s, counts[lid], cache_fraction)
                          for lid, s in stores.items()}
            reads = time_reads(BudgetTables(caches or stores, [], caches), rows)
            for lid, r in reads.items():
                res[lid].append({"latency_s": r["latency_s"], "misses": r["misses"]})
        out[variant] = res
    return out


def break_even(window_s: float, inject_us: list[float], points: list[dict], inflight: int) -> dict:
    """Largest injected latency per round trip at which the read still fits the window: from the
    measured sweep (linear between the bracketing points) and from the model L0 + trips x delta."""
    lat = [math.inf if p["latency_s"] is None else p["latency_s"] for p in points]
    trips = max(1, math.ceil(points[0]["misses"] / inflight))
    model_us = (window_s - lat[0]) / trips * 1e6
    measured = None
    if lat[0] >= window_s:
        measured = 0.0  # does not fit even with nothing injected
    else:
        for (x0, y0), (x1, y1) in zip(zip(inject_us, lat), zip(inject_us[1:], lat[1:])):
            if y1 >= window_s > y0:
                measured = (x1 if math.isinf(y1) else  # stopped early: bracket by the next point
                            x0 + (window_s - y0) / (y1 - y0) * (x1 - x0))
                break
    return {"measured_us": measured, "model_us": model_us, "trips": trips,
            "beyond_sweep": measured is None and lat[0] < window_s}
