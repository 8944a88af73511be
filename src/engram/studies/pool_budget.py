"""`engram pool-budget`: will an Engram layer's rows arrive in time from a given tier?

The CXL paper (arXiv 2603.10087, "prefetch window"): a step's row ids are known from its token ids
before the forward starts, so the read for the Engram layer at depth k may overlap everything
before it, and must finish within that compute:

    L_tier(rows of the step) < t_embed + sum_{i<k} t_exec(i)          (the layer's window)
    B_tier > T x S_layer x N_eng                                      (the bandwidth bound)

This study measures both sides on one model and serving shape (prefill of b x t tokens, or one
decode step of b sequences): t_exec of every block by forward hooks, the read latency of that
step's real-text rows from every tier (each of ``engram.tables.registry``: memory, a table file,
pinned memory, a shared mapping, the DAX/CXL pool region, the Mooncake Store, sharded; a table file
with its pages evicted; any of them behind the hot cache; the tables as FP8 + E8M0 files on
memory, file, pinned, shared and pool tiers), the wait each Engram layer sees behind
PrefetchTable, and a sweep of latency injected per round trip of reads (CXL, remote DRAM, RDMA)
that finds each layer's break-even. The model and its steps: ``pool_steps``; tiers and reads:
``pool_tiers``; verdict, plot and report: ``pool_report``.

Shape legend: b batch, t positions of the step, H hash heads, u distinct rows of a step.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..interrupts import stderr_line
from ..ranges import AT_LEAST_1, NON_NEGATIVE, check_ranges
from ..training.train import TrainConfig
from .pool_report import layer_budget, write_report
from .pool_steps import build_setup, step_rows, steps, time_layers
from .pool_tiers import (
    FP8_POOL,
    TIERS,
    BudgetTables,
    build_tiers,
    split_name,
    stored_row_bytes,
    sweep,
    time_prefetched,
    time_reads,
)

DEFAULT_TIERS = ("memory", "shared", "pool", "file", "file_cold", "file_cold_cache", "mooncake",
                 "mooncake_cache", "memory_fp8", "pool_fp8", "file_fp8", "file_fp8_cold")


@dataclass
class PoolBudgetConfig:
    out_dir: str = "out/pool"  # budget.json, budget.png, report.md, table files
    run_dir: str | None = None  # a trained run (engram train --out_dir); None: random weights
    # serving shapes to budget
    modes: tuple[str, ...] = field(default=("prefill", "decode"),
                                   metadata={"choices": ("prefill", "decode")})
    batch: int = 4  # sequences per step
    prefill_len: int = 128  # prefill: tokens per sequence (<= the model's seq_len)
    decode_context: int = 64  # decode: prompt length already in the KV cache before the step
    reps: int = 20  # timed steps per measurement (medians; each step has its own text)
    # <tier>[_fp8][_cold][_cache], tier: memory, file, pinned, shared, pool, mooncake or sharded
    # (engram.tables.registry); _fp8: the tables as FP8 + E8M0 files (DeepSeek-V4.1's format;
    # memory, file, pinned, shared, pool); _cold: file pages evicted before every read; _cache:
    # behind the hot cache. Tiers that cannot open on this machine (Mooncake) are left out.
    tiers: tuple[str, ...] = DEFAULT_TIERS
    cache_fraction: float = 0.01  # hot cache in front of the slow tiers, share of each table
    pool_path: str | None = None  # the pool tier's DAX device or mappable file (the fp8 pool
    # tiers': the same path + ".fp8"); None: /dev/shm
    table_dir: str | None = None  # table files of the file tiers (on disk, so eviction is cold);
    # None: a temporary folder inside out_dir, removed at the end
    # Injected extra latency per round trip of reads, microseconds; a read of u distinct rows
    # makes ceil(u / inflight) round trips (the rows of one trip are in flight together).
    inject_us: tuple[float, ...] = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
    inflight: int = 16  # reads in flight per round trip in the latency model
    threads: int = 1  # torch threads (1: steady timings on a shared machine)
    seed: int = 0  # random weights and the text windows

    def __post_init__(self) -> None:
        self.modes, self.tiers = tuple(self.modes), tuple(self.tiers)
        self.inject_us = tuple(float(x) for x in self.inject_us)
        bad = [m for m in self.modes if m not in ("prefill", "decode")]
        if bad or not self.modes:
            raise UserError(f"modes must be prefill and/or decode, got {self.modes}")
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown:
            raise UserError(f"unknown tiers {unknown}; choose from {TIERS}")
        for name in ("batch", "prefill_len", "decode_context", "reps", "inflight"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.cache_fraction < 1 or any(x < 0 for x in self.inject_us):
            raise UserError("need 0 <= cache_fraction < 1 and inject_us >= 0")
        check_ranges(self, threads=AT_LEAST_1, seed=NON_NEGATIVE)  # and every float finite


def run_pool_budget(pc: PoolBudgetConfig, tc: TrainConfig) -> dict[str, Any]:
    """Measure every mode and tier; write budget.json, budget.png and report.md to out_dir."""
    from tqdm.auto import tqdm

    from ..tables.cache import count_rows
    from ..tables.registry import get_tier

    t_start = time.time()
    out_dir = Path(pc.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = build_setup(pc.run_dir, dataclasses.replace(tc, seed=pc.seed), pc.seed)
    eng = setup.model.engrams()
    missing = {}  # tier -> why it cannot open on this machine
    for name in pc.tiers:
        why = get_tier(split_name(name)[0]).missing()
        if why:
            missing[name] = why
            stderr_line(f"engram pool-budget: leaving out {name}: {why}")
    names = tuple(t for t in pc.tiers if t not in missing)
    remote = [t for t in pc.tiers if t.startswith("mooncake")]
    counts = None
    if any(t.endswith("cache") for t in names) or pc.cache_fraction > 0:
        counts = count_rows(setup.hasher, setup.corpus.train, list(eng))  # the static head
    pool_path = pc.pool_path or f"/dev/shm/engram-pool-budget-{os.getpid()}"
    summary: dict[str, Any] = {
        "config": dataclasses.asdict(pc), "train_config": setup.train_config.to_dict(),
        "engram_layers": sorted(eng), "n_layer": len(setup.model.blocks),
        "row_bytes": setup.model.config.engram.head_dim * 4,
        "tier_row_bytes": {t: stored_row_bytes(t, setup.model.config.engram.head_dim)
                           for t in names},
        "heads": setup.model.config.engram.num_heads,
        "table_rows": {lid: e.table.num_rows for lid, e in eng.items()},
        "mooncake": missing.get(remote[0], "used") if remote else "not requested",
        "left_out": missing,
        # pc.threads is set by the entry point (`engram pool-budget`): the count in force here.
        "threads": torch.get_num_threads(), "load_avg_start": os.getloadavg()[0], "modes": {}}
    tiers: dict[str, BudgetTables] = {}
    table_dir = Path(pc.table_dir or tempfile.mkdtemp(prefix=".tables-", dir=out_dir))
    try:
        tiers = build_tiers(setup, names, table_dir, pool_path=pool_path,
                            cache_fraction=pc.cache_fraction, counts=counts)
        for mode in pc.modes:
            batch = steps(setup, mode, pc.batch, pc.prefill_len, pc.decode_context, pc.reps)
            rows = step_rows(setup, batch)
            timing = time_layers(setup.rt, batch)
            reads, waits = {}, {}
            for name, tier in tqdm(tiers.items(), desc=f"{mode}: tiers", leave=False):
                reads[name] = time_reads(tier, rows)
                waits[name] = time_prefetched(setup, tier, batch)
            base = tiers.get("pool") or tiers.get("memory")
            sw = None if base is None else sweep(base, rows, pc.inject_us, pc.inflight, counts,
                                                 pc.cache_fraction, 3 * max(timing["window_s"]))
            tokens = batch[0]["step"].local.numel()
            summary["modes"][mode] = layer_budget(timing, reads, waits, sw, tokens, summary)
    finally:
        for tier in tiers.values():
            tier.close()
        for path in (pool_path, pool_path + FP8_POOL):
            if pc.pool_path is None and os.path.exists(path):
                os.unlink(path)
        if pc.table_dir is None:
            shutil.rmtree(table_dir, ignore_errors=True)
    summary["v41_tables"] = v41_tables()
    summary["wall_s"] = time.time() - t_start
    summary["load_avg_end"] = os.getloadavg()[0]  # other jobs on the machine during the timings
    write_report(summary, out_dir)
    return summary


def v41_tables() -> dict[str, Any]:
    """The table arithmetic of the real DeepSeek-V4.1 (EngramConfig.v4_1()): rows and bytes per
    layer in FP8 + E8M0 scales (the engine's ``rows * (head_dim + head_dim // 32)``) and the
    other row formats."""
    from ..retrieval.config import EngramConfig
    from ..retrieval.primes import rows_per_layer
    from ..tables.fp8 import table_memory

    cfg = EngramConfig.v4_1()
    return table_memory(rows_per_layer(cfg), cfg.head_dim)


def v41_lines(t: dict[str, Any]) -> list[str]:
    gib = 1 << 30
    lines = [f"DeepSeek-V4.1 tables (head dim {t['head_dim']}, bytes per row: "
             + ", ".join(f"{k} {v}" for k, v in t["row_bytes"].items()) + "):"]
    for lid, x in [*t["layers"].items(), ("all", t["total"])]:
        lines.append(f"  layer {lid}: {x['rows']:,} rows, FP8 + E8M0 {x['fp8+e8m0']:,} B "
                     f"({x['fp8+e8m0'] / gib:.1f} GiB; bf16 {x['bf16'] / gib:.1f} GiB)")
    return lines
