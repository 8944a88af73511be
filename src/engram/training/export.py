"""Export a model's or a training run's Engram tables as table files (one per layer).

Lives in training, not tables: reading a run folder needs the run's TrainConfig and checkpoint format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from ..retrieval.hot import is_nine
from ..tables.tablefile import hash_profile, table_path, write_table
from .checkpoint import latest_checkpoint, load_checkpoint
from .train import TrainConfig


def export_tables(source: Any, directory: str | Path, *, dtype: str = "fp32",
                  hasher: NgramHasher | None = None, tag: str = "", scale_block: int = 32,
                  progress: bool = False, scale_format: str = "fp32") -> dict[int, Path]:
    """Write one table file per Engram layer of ``source`` into ``directory``; returns the paths.

    ``source`` is an EngramLM, or a checkpoint: a ``.safetensors`` file, a checkpoints folder, or a
    run folder (``engram train --out_dir``) holding one. ``hasher`` fixes the hash profile; by
    default it is the one training uses (the DeepSeek tokenizer's compression). ``scale_format``
    "e8m0" stores fp8 scales as DeepSeek-V4.1 does (power-of-two exponent bytes).

    Engram-Nine (arXiv 2601.16531): beside each table set's cold file ``layer{id}.table`` go its hot
    rows [S, K*e] as a table file ``layer{id}.hot.table`` and the hot index (keys, MPHF,
    fingerprints) as ``layer{id}.hot.safetensors``; every file carries the index's content hash. A
    table set shared by several layers is written once, under its first layer (the returned
    paths map every layer to the file it reads).
    """
    config, weights, nine = _tables_of(source, getattr(hasher, "index", None))
    if hasher is None:
        from ..retrieval.compress import (
            build_compression,  # loads the tokenizer: only when needed
        )

        hasher = NgramHasher(config, build_compression())
    if nine is not None:
        hasher = _nine_hasher(hasher, *nine[:2])
    if tag == "" and not hasattr(source, "engrams"):
        tag = Path(str(source)).name
    kw = dict(config=config, dtype=dtype, scale_block=scale_block, tag=tag, progress=progress,
              scale_format=scale_format)
    out = {}
    for lid, w in weights.items():
        out[lid] = table_path(directory, lid)
        write_table(out[lid], w, num_rows=getattr(w, "num_rows", None), dim=getattr(w, "dim", None),
                    layer_id=lid, profile=hash_profile(hasher, lid), **kw)
    if nine is not None:
        from ..tables.hotcold import hot_path, write_hot_tier

        index, _, hot = nine
        for lid, rows in hot.items():
            if rows is not None:
                write_table(table_path(directory, lid, "hot"), rows,
                            num_rows=getattr(rows, "num_rows", None),
                            dim=getattr(rows, "dim", None), layer_id=lid,
                            profile=hash_profile(hasher, lid, "hot"), **kw)
            write_hot_tier(hot_path(directory, lid), index, None, config, tag=tag)
        return {lid: out[hasher.owner(lid)] for lid in config.layer_ids}
    return out


def export_nine(model: Any, index: Any, directory: str | Path, **kw: Any) -> dict[int, Path]:
    """export_tables for an in-memory Nine model, whose hot index lives in its NineHasher."""
    return export_tables(_WithIndex(model, index), directory, **kw)


class _WithIndex:
    def __init__(self, model, index):
        self.model, self.index = model, index
        self.config, self.engrams = model.config, model.engrams


def _nine_hasher(hasher: Any, index: Any, shared: bool) -> Any:
    """The NineHasher the files are profiled with; a given one must hold the source's index."""
    from ..retrieval.hot import NineHasher

    if not is_nine(hasher):
        return NineHasher(hasher, index, shared=shared)
    if hasher.index.digest() != index.digest() or hasher.shared != shared:
        raise ValueError("the NineHasher given has another hot index or table sharing than the "
                         "tables being exported")
    return hasher


def _tables_of(source: Any, index: Any = None
               ) -> tuple[EngramConfig, dict[int, Any], tuple | None]:
    """(Engram config, {layer: weight tensor or a (start, stop) row function}, and for Engram-Nine
    (hot index, shared, {layer: hot rows or None}), else None). A shared table set appears once,
    under its first layer. ``index``: a Nine model's hot index (its NineHasher's), unless the
    source carries one."""
    if hasattr(source, "engrams"):  # an EngramLM
        if source.config.engram is None:
            raise ValueError("this model has no Engram layers to export")
        engrams = source.engrams()
        shared = len({id(e.table) for e in engrams.values()}) == 1 < len(engrams)
        weights, hot = {}, {}
        for lid, eng in engrams.items():
            table = eng.table
            if table is None:
                raise ValueError(f"layer {lid} has no table to export")
            if shared and hasattr(table, "cold") and lid != next(iter(engrams)):
                continue  # one shared hot+cold set: written once, under its first layer
            if hasattr(table, "cold"):  # a hot+cold store: cold rows here, hot rows beside
                index = getattr(source, "index", None) or index
                if index is None:
                    raise ValueError("a Nine model's tables need its hot index: pass its NineHasher "
                                     "as hasher=, or export_nine(model, index, directory)")
                hot[lid] = None if table.hot is None else _rows(table.hot)
                table = table.cold
            weights[lid] = _rows(table)
        nine = (index, shared, hot) if hot else None
        return source.config.engram, weights, nine
    path = Path(source)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = latest_checkpoint(folder)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {folder}")
        path = found
    elif not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    state, meta, _ = load_checkpoint(path)
    # The run's TrainConfig says which Engram config built the tables.
    tc = TrainConfig(**meta["config"])
    config = tc.engram_config()
    if config is None:
        raise ValueError(f"checkpoint {path} is of a model without Engram")
    model = state["model"]
    if "hot_index" in state:  # Engram-Nine
        from ..retrieval.hot import HotIndex

        owners = config.layer_ids[:1] if tc.shared_tables else config.layer_ids
        nine = (HotIndex.from_state_dict(state["hot_index"]), tc.shared_tables,
                {lid: model.get(f"blocks.{lid}.engram.table.hot.weight") for lid in owners})
        return config, {lid: model[f"blocks.{lid}.engram.table.cold.weight"]
                        for lid in owners}, nine
    return config, {lid: model[f"blocks.{lid}.engram.table.weight"]
                    for lid in config.layer_ids}, None


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

