"""The pool budget's tiers: every name it offers (each registered tier, the evicted file, the
caches, the FP8 + E8M0 files; Mooncake when it is available) returns the in-memory rows of a step
(the fp8 tiers: those rows quantised, bit for bit); injected latency adds its round trips and
changes no row; the break-even is read off a sweep correctly."""

import math
import time

import numpy as np
import pytest
import torch

from engram.studies.pool_steps import build_setup, step_rows, steps
from engram.studies.pool_tiers import (
    TIERS,
    BudgetTables,
    DelayedTable,
    break_even,
    build_tiers,
    split_name,
    stored_row_bytes,
    time_reads,
)
from engram.tables.cache import count_rows
from engram.tables.fp8 import dequantize_fp8, quantize_fp8_e8m0
from engram.tables.registry import REGISTRY
from engram.training.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    return build_setup(None, TrainConfig(max_chars=30_000, engram_layers=(1, 3),
                                         table_size=3000), seed=0)


def test_every_tier_returns_memory_rows(setup, tmp_path):
    names = tuple(t for t in TIERS if REGISTRY[split_name(t)[0]].missing() is None)
    assert {"memory", "pool", "file_cold_cache", "sharded_cache", "memory_fp8", "pool_fp8_cache",
            "file_fp8_cold_cache", "shared_fp8", "pinned_fp8"} <= set(names)
    tables = {lid: e.table.weight.detach() for lid, e in setup.model.engrams().items()}
    fp8 = {lid: dequantize_fp8(*quantize_fp8_e8m0(w, 32)) for lid, w in tables.items()}
    counts = count_rows(setup.hasher, setup.corpus.train)
    tiers = build_tiers(setup, names, tmp_path / "t", pool_path=str(tmp_path / "pool"),
                        cache_fraction=0.05, counts=counts)
    try:
        assert set(tiers) == set(names)
        rows = step_rows(setup, steps(setup, "prefill", 2, 32, 8, 3))
        with torch.no_grad():
            for name, tier in tiers.items():
                for step in rows:
                    for f in tier.cold:
                        f.evict()
                    for lid, r in step.items():
                        want = (fp8 if split_name(name)[3] else tables)[lid][r]
                        assert torch.equal(tier.stores[lid].lookup(r), want), name
        reads = time_reads(tiers["file_cold_cache"], rows)
        for lid, r in reads.items():
            assert r["rows"] == rows[0][lid].numel() and 0 < r["misses"] <= r["distinct"]
    finally:
        for tier in tiers.values():
            tier.close()
    with pytest.raises(ValueError, match="unknown tier 'memory_cold'"):
        split_name("memory_cold")
    assert split_name("file_fp8_cold_cache") == ("file", True, True, True)
    assert split_name("pool_cache") == ("pool", False, True, False)
    assert "mooncake_fp8" not in TIERS and "sharded_fp8" not in TIERS
    head_dim = setup.model.config.engram.head_dim
    assert stored_row_bytes("pool_fp8", head_dim) == head_dim + head_dim // 32
    assert stored_row_bytes("pool", head_dim) == 4 * head_dim


def test_injected_latency_adds_round_trips(setup):
    store = setup.model.engrams()[1].table
    rows = torch.arange(0, 640, 2).view(4, 20, 4)  # 320 distinct rows
    slow = DelayedTable(store, 200e-6, inflight=32)  # 10 round trips of 200 us
    with torch.no_grad():
        t0 = time.perf_counter()
        out = slow.lookup(rows)
        dt = time.perf_counter() - t0
        assert torch.equal(out, store.lookup(rows))
    assert dt >= 10 * 200e-6
    reads = time_reads(BudgetTables({1: slow}, [], {}), [{1: rows}])
    assert reads[1]["latency_s"] >= 2e-3 and reads[1]["distinct"] == 320


def test_break_even_from_sweep():
    pts = [{"latency_s": (10 + 5 * x) * 1e-6, "misses": 80} for x in (0, 1, 10, 100)]
    be = break_even(60e-6, [0, 1, 10, 100], pts, inflight=16)  # 5 trips; 10 + 5x = 60 at x=10
    assert be["trips"] == 5 and be["model_us"] == pytest.approx(10.0)
    assert be["measured_us"] == pytest.approx(10.0) and not be["beyond_sweep"]
    # A window the read misses even with nothing injected, and one it never misses.
    assert break_even(5e-6, [0, 1], pts[:2], 16)["measured_us"] == 0.0
    far = break_even(1.0, [0, 1], pts[:2], 16)
    assert far["measured_us"] is None and far["beyond_sweep"]
    # A sweep stopped early (latency None) brackets the break-even by the next point.
    stopped = pts[:2] + [{"latency_s": None, "misses": 80}]
    assert break_even(30e-6, [0, 1, 10], stopped, 16)["measured_us"] == 10
    assert math.isfinite(break_even(30e-6, [0, 1, 10], stopped, 16)["model_us"])
    assert np.isclose(break_even(30e-6, [0, 1, 10], stopped, 16)["model_us"], 4.0)
