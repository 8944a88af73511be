"""What the benchmarks share: the median time of a call (machines are noisy: the median of
several calls after a warm-up, never one)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


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
