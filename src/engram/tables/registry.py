"""Every tier a user can choose, by name: where a served run's table rows are read from.

A tier opens a folder of exported table files (tables/tablefile.py: one file per part of each table
set, ``engram.retrieval.hashing.Hasher.parts``) as one store per part, all with the same call:

    opener(directory, config, hasher, *, verify, device, **options) -> Opened

``open_tier`` puts the optional hot cache (tables/cache.py) and background prefetch
(tables/prefetch.py) in front and assembles each layer's store (tables/hotcold.py), whatever the
tier. The command line's choices (``engram generate --tier``, ``engram export-hf --tier``), the vLLM
plugin's ``engram_serving.tier`` and ``engram pool-budget --tiers`` all come from ``REGISTRY``,
and tests/tables/test_tiers.py checks every registered tier row for row against the in-memory
table: a new tier is added, offered and tested by registering it here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher
from .store import MemoryTable, TableStore
from .tiers import SharedPool, open_parts
from .host import HostTable, PinnedTable

Parts = dict[tuple[str, int], TableStore]  # (part, owner layer) -> store
# Stored dtypes the memory tier keeps as stored on the CPU (HostTable: every lookup gathers and
# dequantises in one pass, fp8.StoredRows); other files are read into an fp32 MemoryTable.
STORED = ("fp8", "bf16", "int8", "int4")


@dataclass
class Opened:
    """What a tier's opener gives: every part's store, and what ``close`` releases."""
    parts: Parts
    resources: list[Any] = field(default_factory=list)  # objects with close(), closed last first

    def close(self) -> None:
        for r in reversed(self.resources):
            r.close()
        self.resources.clear()


@dataclass(frozen=True)
class Tier:
    name: str
    help: str  # one line for --help
    open: Callable[..., Opened]  # (directory, config, hasher, *, verify, device, **options)
    missing: Callable[[], str | None] = lambda: None  # why it cannot open on this machine


REGISTRY: dict[str, Tier] = {}


def register(tier: Tier) -> Tier:
    if tier.name in REGISTRY:
        raise ValueError(f"tier {tier.name!r} is registered already")
    REGISTRY[tier.name] = tier
    return tier


def get_tier(name: str) -> Tier:
    if name not in REGISTRY:
        raise UserError(f"tier must be one of {tuple(REGISTRY)}, got {name!r}")
    return REGISTRY[name]


def tier_help() -> str:
    """Every tier and what it is, for --help."""
    return "; ".join(f"{t.name}: {t.help}" for t in REGISTRY.values())


def open_parts_on(name: str, directory: str | Path, config: EngramConfig, hasher: Hasher | None,
                  *, verify: bool = True, device: torch.device | str = "cpu",
                  **options: Any) -> Opened:
    """Every table file in ``directory`` (each checked against ``hasher``'s stamps) as a store on
    tier ``name``; a tier that cannot open on this machine says what is missing."""
    tier = get_tier(name)
    why = tier.missing()
    if why:
        raise UserError(f"tier {name!r} cannot open on this machine: {why}")
    return tier.open(Path(directory), config, hasher, verify=verify, device=device, **options)


def open_tier(name: str, directory: str | Path, config: EngramConfig, hasher: Hasher, *,
              counts: dict[int, dict[str, torch.Tensor]] | None = None,
              cache_fraction: float = 0.0, prefetch: bool = False, verify: bool = True,
              device: torch.device | str = "cpu", **options: Any) -> dict[int, TableStore]:
    """``{layer: store}`` for the table files in ``directory`` on tier ``name``, each part behind
    a hot cache of ``cache_fraction`` of its rows (``counts``: ``hasher.count_reads`` on training
    text) and background prefetch when asked. Files of another config, layer, hash profile or hot
    index are refused here. ``device``: where the model runs (the pinned tier copies rows there).
    Engram-Nine's parts go each behind its own cache and prefetch, under one HotColdStore per set.
    """
    from .cache import build_cache
    from .hotcold import assemble
    from .prefetch import wrap_prefetch

    parts = open_parts_on(name, directory, config, hasher, verify=verify, device=device,
                          **options).parts
    if cache_fraction > 0:
        if counts is None:
            raise ValueError("a hot cache needs the training text's row counts")
        parts = {(part, lid): build_cache(t, counts[lid][part], cache_fraction)
                 for (part, lid), t in parts.items()}
    if prefetch:
        parts = dict(wrap_prefetch(parts))
    return assemble(parts, config, hasher)


def _no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"tier {name!r} takes no options, got {sorted(options)}")


# -- the tiers -------------------------------------------------------------------------------------

def _copy_rows(store: TableStore, out: torch.Tensor, lo: int = 0, chunk: int = 1 << 16) -> None:
    """out [n, e] = rows lo..lo+n of ``store``, read in chunks."""
    with torch.no_grad():
        for a in range(0, out.shape[0], chunk):
            b = min(out.shape[0], a + chunk)
            out[a:b] = store.lookup(torch.arange(lo + a, lo + b)).to(out.device, out.dtype)


def _open_memory(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
                 device: torch.device | str, **options: Any) -> Opened:
    _no_options("memory", options)
    files = open_parts(directory, config, hasher, verify=verify)
    parts = {}
    for key, f in files.items():
        if torch.device(device).type == "cpu" and f.dtype in STORED:
            parts[key] = HostTable(f)  # as stored: fp8 a quarter of fp32's memory, int4 1/7
        else:  # the file's rows, not a draw they would overwrite (the caller's generator kept)
            rows = torch.empty(f.num_rows, f.dim, device=device)
            _copy_rows(f, rows)
            parts[key] = MemoryTable(f.num_rows, f.dim, rows=rows)
        f.close()
    return Opened(parts)


def _open_file(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
               device: torch.device | str, **options: Any) -> Opened:
    _no_options("file", options)
    parts = open_parts(directory, config, hasher, verify=verify)
    return Opened(dict(parts), list(parts.values()))


def _open_pinned(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
                 device: torch.device | str, **options: Any) -> Opened:
    _no_options("pinned", options)
    parts = {}
    for key, f in open_parts(directory, config, hasher, verify=verify).items():
        parts[key] = PinnedTable(f, device=device)
        f.close()
    return Opened(parts)


def _open_shared(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
                 device: torch.device | str, **options: Any) -> Opened:
    _no_options("shared", options)
    pool = SharedPool(directory, config, hasher, verify=verify)
    return Opened(dict(pool.parts), [pool])


def _open_pool(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
               device: torch.device | str, pool_path: str | Path | None = None, rank: int = 0,
               wait_s: float = 600.0) -> Opened:
    """``pool_path``: a DAX device or any mappable file (default DIRECTORY/tables.pool); rank 0
    fills it from the table files unless it holds these versions, every rank maps it."""
    from .pool import load_pool

    path = Path(pool_path) if pool_path is not None else directory / "tables.pool"
    region = load_pool(path, directory, config, hasher, rank=rank, wait_s=wait_s, verify=verify)
    return Opened(dict(region.parts), [region])


def _open_mooncake(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
                   device: torch.device | str, **options: Any) -> Opened:
    """Starts mooncake_master and mooncake_client on loopback for this process's tables and
    publishes every table file there (each read into memory once, as fp32 or bf16/fp16 rows)."""
    from .mooncake import MooncakeSession, MooncakeTable, publish_table

    _no_options("mooncake", options)
    files = open_parts(directory, config, hasher, verify=verify)
    size = sum(f.num_rows * f.dim * 4 for f in files.values())
    session = MooncakeSession(segment_bytes=2 * size + (64 << 20))
    opened = Opened({}, [session])
    try:
        for (part, lid), f in files.items():
            key = f"engram/{part}/L{lid}"
            rows = torch.empty(f.num_rows, f.dim)
            _copy_rows(f, rows)
            publish_table(session.client, key, rows)
            f.close()
            opened.parts[(part, lid)] = MooncakeTable(session.client, key, session=session)
            opened.resources.append(opened.parts[(part, lid)])
    except BaseException:
        opened.close()
        raise
    return opened


def _mooncake_missing() -> str | None:
    from .mooncake import mooncake_missing

    return mooncake_missing()


def _open_sharded(directory: Path, config: EngramConfig, hasher: Hasher | None, *, verify: bool,
                  device: torch.device | str, group: Any = None) -> Opened:
    """Each rank of ``group`` (the default group; one process: the whole table) reads only its
    own range of rows from the table files."""
    from .sharded import ShardedTable

    parts = {}
    for key, f in open_parts(directory, config, hasher, verify=verify).items():
        parts[key] = ShardedTable(f.num_rows, f.dim, group=group, sparse=False, device=device)
        _copy_rows(f, parts[key].weight.data, lo=parts[key].lo)
        f.close()
    return Opened(parts)


register(Tier("memory", "rows read from the table files into this process's memory",
              _open_memory))
register(Tier("file", "table files mapped read-only, served through the OS page cache (NVMe)",
              _open_file))
register(Tier("pinned", "rows in page-locked host memory, copied to the model's device per "
              "lookup", _open_pinned))
register(Tier("shared", "one read-only mapping of the table files for every process on the "
              "machine", _open_shared))
register(Tier("pool", "a pool region (DAX/CXL device or any mappable file, default "
              "TABLE_DIR/tables.pool) filled once from the table files, mapped read-only",
              _open_pool))
register(Tier("mooncake", "a Mooncake Store started on loopback, rows read with ranged reads "
              "(needs engram[pool] and libibverbs1)", _open_mooncake, _mooncake_missing))
register(Tier("sharded", "rows split by range over torch.distributed ranks and fetched with "
              "all-to-all (one process: the whole table)", _open_sharded))

# The names, in registration order, written out so the command line reads them without importing
# torch (engram.commandline.schema); a tier registered above must be listed here too.
TIERS = ("memory", "file", "pinned", "shared", "pool", "mooncake", "sharded")
if TIERS != tuple(REGISTRY):
    raise ImportError(f"tables.registry.TIERS {TIERS} != the registered tiers {tuple(REGISTRY)}")

