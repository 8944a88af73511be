"""Starting a file-tier run (training/tier_tables.py): what its config needs, the budget one step
takes, and moving a model's tables to their files (fresh: their initial rows drawn chunk by chunk
straight into them; resumed: the folder checked to be this run's), one process's whole tables or
a torchrun rank's shard of them (training/tier_shards.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..artifacts.tier_files import TierError, TierFiles
from ..errors import UserError
from ..tables.store import normal_chunks
from .optim import make_table_optimizer
from .tier_tables import WS_INDEX, TierTables
from .working_table import WorkingShard, WorkingTable

if TYPE_CHECKING:
    from .tier_shards import Shard

TIERS = ("memory", "file")  # engram train --table_tier


def state_layout(optimizer: str, dim: int) -> dict[str, tuple[list[int], str]]:
    """The table optimiser's per-row state buffers: name -> (per-row shape, dtype name)."""
    st: dict = {}
    opt = make_table_optimizer(optimizer, [nn.Parameter(torch.zeros(1, dim))], lr=1.0)
    opt._resize(st, dim, 1, torch.device("cpu"))
    return {k: (list(st[k].shape[1:]), str(st[k].dtype).removeprefix("torch."))
            for k in opt._buffers()}


def step_bound(cfg: Any, engram: nn.Module, rows: int | None = None) -> int:
    """The most distinct rows one step can read from a layer's table (or from ``rows`` of it: a
    shard's)."""
    heads = len(engram.head_sizes) if engram.head_sizes is not None else engram.d_mem // \
        engram.table.dim
    return min(engram.table.num_rows if rows is None else rows,
               cfg.batch_size * cfg.seq_len * cfg.grad_accum * heads)

def check_tier(cfg: Any) -> None:
    """What a tier run needs of its config (one line, before any work)."""
    if cfg.table_tier not in TIERS:
        raise UserError(f"table_tier must be one of {', '.join(TIERS)}, got {cfg.table_tier!r}")
    if cfg.table_tier == "memory":
        return
    if not cfg.engram or cfg.nine:
        raise UserError("table_tier=file trains plain Engram tables (engram=true, no hot_rows / "
                        "shared_tables)")
    if cfg.device != "cpu" or cfg.precision != "fp32" or cfg.compile:
        raise UserError("table_tier=file trains on the CPU in fp32, uncompiled (device=cpu, "
                        "precision=fp32, compile=false)")


def check_fits_memory(cfg: Any) -> None:
    """Tables in memory that cannot fit are refused before any allocation (issue 48: a huge
    table_size ended in torch's allocator traceback): the rows and their optimiser state against
    the memory this machine has available (Linux's MemAvailable; unchecked where it is not told)."""
    if cfg.table_tier != "memory" or not cfg.engram:
        return
    available = available_memory()
    if available is None:
        return
    from ..retrieval.primes import rows_per_layer

    ecfg = cfg.engram_config()
    rows = sum(rows_per_layer(ecfg).values())
    need = rows * row_bytes(cfg.table_optimizer, ecfg.head_dim)
    if need > available:
        raise UserError(f"the tables need {need / 2**30:,.1f} GiB in memory ({rows:,} rows of "
                        f"{ecfg.head_dim} values with their {cfg.table_optimizer} state) and this "
                        f"machine has {available / 2**30:,.1f} GiB available: lower table_size, "
                        "or keep them in files with --table_tier file")


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def row_bytes(optimizer: str, dim: int) -> int:
    """Bytes of one row (float32) and its optimiser state, in the files."""
    return dim * 4 + sum(int(np.prod(t)) * getattr(torch, d).itemsize
                         for t, d in state_layout(optimizer, dim).values())


def budget_need(cfg: Any, model: nn.Module, held: dict[int, int] | None = None) -> int:
    """The least budget (bytes) a tier run of ``cfg`` takes: one step's most rows with their
    state, and a byte a table row for the journal's marks (``held``: a shard's rows a layer)."""
    held = held or {lid: e.table.num_rows for lid, e in model.engrams().items()}
    return sum(step_bound(cfg, e, held[lid]) * (row_bytes(cfg.table_optimizer, e.table.dim) +
                                                WS_INDEX) + held[lid]
               for lid, e in model.engrams().items())


def attach(cfg: Any, model: nn.Module, fresh: bool, shard: Shard | None = None) -> TierTables:
    """Move the model's tables to the file tier (``fresh``: from their initial rows; else the
    folder of the checkpoint being resumed); under torchrun this rank's ``shard`` of them, in its
    own folder. The caller sets ``optim`` and wraps its batches."""
    engrams = {lid: e for lid, e in model.engrams().items()}
    folder = Path(cfg.table_dir or Path(cfg.out_dir) / "tier")
    folder = folder if shard is None else folder / shard.folder
    span = {lid: (0, e.table.num_rows) if shard is None else shard.span(lid)
            for lid, e in engrams.items()}
    layout = {lid: state_layout(cfg.table_optimizer, e.table.dim) for lid, e in engrams.items()}
    need = budget_need(cfg, model, {lid: hi - lo for lid, (lo, hi) in span.items()})
    budget = need * 2 if cfg.table_budget_mb is None else int(cfg.table_budget_mb * 2**20)
    if budget < need:
        whose = "" if shard is None else " of a rank's shard"
        raise UserError(f"table_budget_mb={cfg.table_budget_mb:g} is below one step's rows"
                        f"{whose}: {need / 2**20:.2f} MB (batch_size x seq_len x grad_accum x "
                        "heads rows and their optimiser state); raise it")
    _check_writable(folder)
    if fresh:
        old = folder / "tier.json"
        if old.exists():
            try:
                theirs = TierFiles.open(folder).meta.get("out_dir")
            except TierError:
                theirs = None
            if theirs != str(Path(cfg.out_dir).resolve()):
                raise TierError(f"{folder} holds the tables of another run ({theirs}); use "
                                "another --table_dir (nothing was changed)")
        mine = None if shard is None else [shard.rank, shard.world]
        files = TierFiles.create(folder, Path(cfg.out_dir),
                                 {lid: (hi - lo, engrams[lid].table.dim)
                                  for lid, (lo, hi) in span.items()},
                                 {lid: initial_rows(e.table, *span[lid])
                                  for lid, e in engrams.items()},
                                 next(iter(layout.values())), cfg.table_optimizer, mine)
    else:
        files = TierFiles.open(folder)
        want = {str(lid): [hi - lo, engrams[lid].table.dim] for lid, (lo, hi) in span.items()}
        if files.meta["layers"] != want or files.meta["optimizer"] != cfg.table_optimizer:
            raise TierError(f"{folder} holds tables of another shape or optimiser "
                            f"({files.meta['layers']}, {files.meta['optimizer']}); this run "
                            f"needs {want}, {cfg.table_optimizer}")
        if shard is not None and files.meta.get("shard") != [shard.rank, shard.world]:
            raise TierError(f"{folder} holds the tier tables of rank/world "
                            f"{files.meta.get('shard')}, not this rank's [{shard.rank}, "
                            f"{shard.world}]: the folder was moved or changed by hand")
    for lid, e in engrams.items():  # frees the in-memory table (if it was built)
        e.table = WorkingTable(files, lid) if shard is None else \
            WorkingShard(files, lid, e.table.num_rows, shard.group)
    return TierTables(cfg, engrams, files, budget, shard)


def initial_rows(table: nn.Module, lo: int = 0, hi: int | None = None):
    """The table's initial rows [lo, hi), chunk [k, e] by chunk: made now from the generator state
    its init recorded (built under ``store.deferred_rows``: the rows were never in memory; a
    shard's are drawn as the whole table's, the rows before ``lo`` dropped), or its own."""
    hi = table.num_rows if hi is None else hi
    if not getattr(table, "deferred", False):
        return iter([table.weight.detach()[lo:hi]])
    g = torch.Generator()
    g.set_state(table.init_state)
    return _between(normal_chunks(table.num_rows, table.dim, table.init_std, g), lo, hi)


def _between(chunks, lo: int, hi: int):
    at = 0
    for c in chunks:
        a, z = max(lo, at), min(hi, at + c.shape[0])
        if a < z:
            yield c[a - at:z - at]
        at += c.shape[0]
        if at >= hi:
            return


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TierError(f"cannot write the tier tables to {folder}: {e.strerror or e}") from None
