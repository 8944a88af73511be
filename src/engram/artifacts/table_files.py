"""A model's or a checkpoint's Engram tables as table files (one per part of a table set).

Lives in artifacts, not tables: a checkpoint is a run folder's part; tables/ owns the file's bytes.
A checkpoint's Engram config comes from its saved run config through ``engram_of``, which the
layer that wrote the config passes in (training.run_tables: the run's TrainConfig).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import InputNotFound, UserError
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher, NgramHasher
from ..retrieval.hot import checkpoint_hasher
from ..tables.hotcold import index_paths, parts_of, write_index_files
from ..tables.tablefile import read_header, table_path, table_paths, write_table
from .checkpoint import latest_checkpoint, load_checkpoint

# A run's saved config (a checkpoint meta's "config") -> (its Engram config or None, whether one
# table set is shared by every layer).
EngramOf = Callable[[dict[str, Any]], tuple[EngramConfig | None, bool]]

# A table set's entries in a model's state dict, after "blocks.{layer}.engram.table.": a plain
# table's own weight is its cold part; a hot+cold store (tables/hotcold.py) names its parts.
_STATE_PARTS = {"weight": "cold", "cold.weight": "cold", "hot.weight": "hot"}


def export_tables(source: Any, directory: str | Path, *, dtype: str = "fp32",
                  hasher: Hasher | None = None, tag: str = "", scale_block: int = 32,
                  progress: bool = False, scale_format: str = "fp32",
                  kept: list[Path] | None = None, engram_of: EngramOf | None = None
                  ) -> dict[int, Path]:
    """Write every table file of ``source`` into ``directory``; returns each layer's cold file.

    ``source`` is an EngramLM, or a checkpoint: a ``.safetensors`` file, a checkpoints folder, or a
    run folder (``engram train --out_dir``) holding one. ``hasher`` (``Hasher``) fixes the table
    sets, their parts and the stamps; by default the one training uses (the DeepSeek tokenizer's
    compression; a checkpoint's saved hot index). A Nine model needs its NineHasher.
    ``scale_format`` "e8m0" stores fp8 scales as DeepSeek-V4.1 does (power-of-two exponent bytes).

    One file per part of each table set (``hasher.owners`` x ``hasher.parts``): ``layer{id}.table``
    and, for Engram-Nine (arXiv 2601.16531), its hot rows ``[S, K*e]`` as ``layer{id}.hot.table``
    and the hot index (keys, MPHF, fingerprints) as ``layer{id}.hot.safetensors``; every file
    carries the stamp (``hasher.profile``). A table set shared by several layers is written once, under
    its first layer (the returned paths map every layer to the file it reads).
    ``kept``: given, a table file already holding exactly its rows is kept and named there
    (``tables.tablefile.write_table``). ``engram_of``: a checkpoint's Engram config and table
    sharing from its saved run config (needed for a checkpoint; training.run_tables passes it).
    """
    config, sets, hasher, source_tag = _tables_of(source, hasher, engram_of)
    kw = dict(config=config, dtype=dtype, scale_block=scale_block, tag=tag or source_tag,
              progress=progress, scale_format=scale_format)
    for lid, parts in sets.items():
        for part, rows in parts.items():
            write_table(table_path(directory, lid, part), rows,
                        num_rows=getattr(rows, "num_rows", None), dim=getattr(rows, "dim", None),
                        layer_id=lid, profile=hasher.profile(lid, part), kept=kept, **kw)
    write_index_files(directory, hasher, config, tag=kw["tag"])
    return {lid: table_path(directory, hasher.owner(lid)) for lid in config.layer_ids}


def _default_hasher(config: EngramConfig) -> NgramHasher:
    from ..retrieval.compress import build_compression  # loads the tokenizer: only when needed

    return NgramHasher(config, build_compression())


def _tables_of(source: Any, hasher: Hasher | None, engram_of: EngramOf | None
               ) -> tuple[EngramConfig, dict[int, dict[str, Any]], Hasher, str]:
    """(Engram config, {owner layer: {part: weight tensor or a (start, stop) row function}}, the
    hasher, the source's default tag)."""
    if isinstance(source, nn.Module):  # an EngramLM
        if source.config.engram is None:
            raise ValueError("this model has no Engram layers to export")
        config, engrams = source.config.engram, source.engrams()
        hasher = hasher or _default_hasher(config)
        if any(e.table is None for e in engrams.values()):
            raise ValueError(f"layers {[lid for lid, e in engrams.items() if e.table is None]} "
                             "have no table to export")
        if len({id(e.table) for e in engrams.values()}) != len(hasher.owners):
            raise ValueError(f"the model has {len({id(e.table) for e in engrams.values()})} "
                             f"table sets, the hasher {len(hasher.owners)}: another sharing")
        return config, {lid: {part: _rows(t) for part, t in
                              parts_of(engrams[lid].table, hasher).items()}
                        for lid in hasher.owners}, hasher, ""
    if engram_of is None:
        raise ValueError("a checkpoint's tables need engram_of, its Engram config from its saved "
                         "config (engram.training.run_tables.export_tables passes the run's)")
    path = Path(source)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = latest_checkpoint(folder)
        if found is None:
            raise InputNotFound(f"no checkpoint in {folder}")
        path = found
    elif not path.exists():
        raise InputNotFound(f"no checkpoint at {path}")
    state, meta, _ = load_checkpoint(path)
    # The run's saved config says which Engram config built the tables.
    config, shared = engram_of(meta["config"])
    if config is None:
        raise UserError(f"checkpoint {path} is of a model without Engram")
    hasher = checkpoint_hasher(hasher or _default_hasher(config), state, shared)
    sets = {}
    for lid in hasher.owners:
        prefix = f"blocks.{lid}.engram.table."
        found = {_STATE_PARTS[k[len(prefix):]]: v for k, v in state["model"].items()
                 if k.startswith(prefix)}
        sets[lid] = {part: found[part] for part in hasher.parts}
    return config, sets, hasher, path.name  # the checkpoint file, as the runtime stamps it


def _rows(table: Any) -> Any:
    """A table's weight tensor (in memory), or a row function over any other store."""
    w = getattr(table, "weight", None)
    return w.detach().cpu() if isinstance(w, torch.Tensor) else _StoreRows(table)


class _StoreRows:
    """A (start, stop) row function over any TableStore, so a file can be re-exported."""

    def __init__(self, store):
        self.store, self.num_rows, self.dim = store, store.num_rows, store.dim

    def __call__(self, a: int, b: int) -> torch.Tensor:
        return self.store.lookup(torch.arange(a, b)).float().cpu()


def stale_tables(folder: Path, hasher: Hasher, tag: str, dtype: str | None) -> str:
    """Why ``folder`` cannot serve checkpoint ``tag`` (``dtype``: None takes any); "" if it can."""
    for p in table_paths(folder, hasher):
        if not p.exists():
            return f"{p.name} is missing"
        h = read_header(p)
        if h.tag != tag:
            return f"{p.name} is of {h.tag or 'another checkpoint'}"
        if dtype is not None and h.dtype != dtype:
            return f"{p.name} holds {h.dtype} rows, {dtype} asked"
    missing = [p.name for p in index_paths(folder, hasher) if not p.exists()]
    return f"{missing[0]} is missing" if missing else ""
