"""Export a model's or a training run's Engram tables as table files (one per layer).

Lives in training, not tables: reading a run folder needs the run's TrainConfig and checkpoint format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from ..tables.tablefile import hash_profile, table_path, write_table
from .checkpoint import latest_checkpoint, load_checkpoint
from .train import TrainConfig


def export_tables(source: Any, directory: str | Path, *, dtype: str = "fp32",
                  hasher: NgramHasher | None = None, tag: str = "", scale_block: int = 32,
                  progress: bool = False) -> dict[int, Path]:
    """Write one table file per Engram layer of ``source`` into ``directory``; returns the paths.

    ``source`` is an EngramLM, or a checkpoint: a ``.safetensors`` file, a checkpoints folder, or a
    run folder (``engram train --out_dir``) holding one. ``hasher`` fixes the hash profile; by
    default it is the one training uses (the DeepSeek tokenizer's compression).
    """
    config, weights, hot, shared = _tables_of(source)
    if hasher is None:
        from ..retrieval.compress import (
            build_compression,  # loads the tokenizer: only when needed
        )

        hasher = NgramHasher(config, build_compression())
    if tag == "" and not hasattr(source, "engrams"):
        tag = Path(str(source)).name
    out = {}
    for lid, w in weights.items():
        out[lid] = table_path(directory, lid)
        write_table(out[lid], w, num_rows=getattr(w, "num_rows", None), dim=getattr(w, "dim", None),
                    layer_id=lid, config=config,
                    # A shared table set is hashed with the first layer's multipliers.
                    profile=hash_profile(hasher, config.layer_ids[0] if shared else lid),
                    dtype=dtype, scale_block=scale_block, tag=tag, progress=progress)
    if hot is not None:  # Engram-Nine: keys, MPHF, fingerprints and hot rows beside the cold tables
        from ..tables.hotcold import hot_path, write_hot_tier

        for lid, (index, rows) in hot.items():
            write_hot_tier(hot_path(directory, lid), index, rows, config, tag=tag)
    return out


def export_nine(model: Any, index: Any, directory: str | Path, **kw: Any) -> dict[int, Path]:
    """export_tables for an in-memory Nine model, whose hot index lives in its NineHasher."""
    return export_tables(_WithIndex(model, index), directory, **kw)


class _WithIndex:
    def __init__(self, model, index):
        self.model, self.index = model, index
        self.config, self.engrams = model.config, model.engrams


def _tables_of(source: Any) -> tuple[EngramConfig, dict[int, Any], dict | None, bool]:
    """(Engram config, {layer: weight tensor or a (start, stop) row function},
    {layer: (hot index, hot rows)} or None, whether the layers share one table set)."""
    if hasattr(source, "engrams"):  # an EngramLM
        if source.config.engram is None:
            raise ValueError("this model has no Engram layers to export")
        weights, hot = {}, {}
        for lid, eng in source.engrams().items():
            table = eng.table
            if table is None:
                raise ValueError(f"layer {lid} has no table to export")
            if hasattr(table, "cold"):  # a hot+cold store: cold rows here, hot rows beside
                if getattr(source, "index", None) is None:
                    raise ValueError("a Nine model's tables need its hot index: export_nine(model, "
                                     "hasher.index, directory)")
                hot[lid] = (source.index, None if table.hot is None else table.hot.weight.detach())
                table = table.cold
            w = getattr(table, "weight", None)
            weights[lid] = w.detach().cpu() if isinstance(w, torch.Tensor) else _StoreRows(table)
        shared = len({id(e.table) for e in source.engrams().values()}) == 1 < len(weights)
        return source.config.engram, weights, hot or None, shared
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

        index = HotIndex.from_state_dict(state["hot_index"])
        hot = {lid: (index, model.get(f"blocks.{lid}.engram.table.hot.weight"))
               for lid in config.layer_ids}
        return config, {lid: model[f"blocks.{lid}.engram.table.cold.weight"]
                        for lid in config.layer_ids}, hot, tc.shared_tables
    return config, {lid: model[f"blocks.{lid}.engram.table.weight"]
                    for lid in config.layer_ids}, None, False


class _StoreRows:
    """A (start, stop) row function over any TableStore, so a file can be re-exported."""

    def __init__(self, store):
        self.store, self.num_rows, self.dim = store, store.num_rows, store.dim

    def __call__(self, a: int, b: int) -> torch.Tensor:
        return self.store.lookup(torch.arange(a, b)).float().cpu()

