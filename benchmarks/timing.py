"""What the benchmarks share: the median time of a call (machines are noisy: the median of
several calls after a warm-up, never one), and the row ids a timed lookup reads."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeat: int = 15, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def llc_bytes() -> int:
    """The largest CPU cache this machine names (sysfs), or 32 MiB where none is named."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 32 << 20


class IdSets:
    """Row ids [n] for timed lookups. ``same``: one set, every call, as a hot loop over the same
    step would read: its rows stay in L2 / L3 after the first call, whatever the table's size.
    ``fresh()``: the next of enough sets that the rows a set reads have left the CPU's caches when
    it comes round again (``count`` sets of ``n`` rows of ``row_bytes``, at least twice
    ``cache_bytes`` of rows between two reads of a set): a table many times the last-level cache
    then costs what its rows' bytes cost from memory, which is what a decode step's random rows
    of a large table cost. Pass the smallest row a timed path reads."""

    def __init__(self, rows: int, n: int, row_bytes: int, cache_bytes: int,
                 generator: torch.Generator):
        count = max(2, -(-2 * cache_bytes // max(1, n * row_bytes)))
        self.sets = [torch.randint(0, rows, (n,), generator=generator) for _ in range(count)]
        self.at = 0

    @property
    def same(self) -> torch.Tensor:
        return self.sets[0]

    def fresh(self) -> torch.Tensor:
        self.at = (self.at + 1) % len(self.sets)
        return self.sets[self.at]

    def conditions(self, reads: dict[str, Callable[[torch.Tensor], object]]
                   ) -> dict[str, dict[str, Callable[[], object]]]:
        """Each read (name -> f(ids)) as a timed call under both conditions: "from_memory" (new
        ids every call) and "in_cache" (``same`` every call)."""
        return {"from_memory": {k: (lambda f=f: f(self.fresh())) for k, f in reads.items()},
                "in_cache": {k: (lambda f=f: f(self.same)) for k, f in reads.items()}}


def read_all(lookup, rows: int, chunk: int = 1 << 16) -> None:
    """Every row once through ``lookup``: a warm tier's pages resident (and mapped, for a
    mapping), so that its timed reads of new ids pay for the CPU's caches, not the disk's."""
    for lo in range(0, rows, chunk):
        lookup(torch.arange(lo, min(rows, lo + chunk)))
