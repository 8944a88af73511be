"""Serving a trained run: its newest checkpoint as a model whose tables live on a chosen tier.

memory (the checkpoint's own tables) or any tier of ``engram.tables.registry`` (file, pinned,
shared, pool, mooncake, sharded, ...: table files exported from the checkpoint when missing or
stale, opened on that tier); optionally behind a hot cache and prefetch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputNotFound, UserError
from ..models.model import EngramLM
from ..retrieval.hashing import Hasher
from ..tables.registry import TIERS, open_tier  # TIERS: the command line's --tier choices


@dataclass
class Served:
    model: EngramLM
    hasher: Hasher | None  # a NgramHasher, or a NineHasher for an Engram-Nine run
    vocab: np.ndarray  # [V] model id -> raw id
    checkpoint: Path
    tokenizer: Any  # the tokenizers.Tokenizer the corpus and the hasher were built with
    tables: dict[int, Any] = field(default_factory=dict)  # the stores, outermost first
    train_tokens: np.ndarray | None = None  # the run's training stream (raw ids): row counts


def load_run(run_dir: str | Path, *, tier: str = "memory", table_dir: str | Path | None = None,
             table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
             verify: bool = True, engram_layers: str | Path | None = None,
             **options: Any) -> Served:
    """The newest checkpoint of a ``engram train --out_dir`` folder, ready to generate.

    ``tier="memory"`` serves the checkpoint's own tables. Any other tier (``TIERS``) serves them
    from table files in ``table_dir`` (default ``run_dir/tables``), exported from the checkpoint
    when missing or stale, opened on that tier (``options``: the tier's own, e.g. ``pool_path``);
    optionally behind a hot cache of ``cache_fraction`` of each table
    (``engram.tables.cache.build_cache``: mostly static top-k by the training text's n-gram
    frequencies, the rest LRU) and background prefetch. ``engram_layers``: a DeepSeek-V4.1 layer
    set (``engram import-v41``) replacing the Engram weights and tables of a v4.1 run of the same
    shape; its table files are served on the tier.
    """
    from ..retrieval.hot import checkpoint_hasher
    from ..tables.hotcold import check_index_files, index_paths
    from ..tables.tablefile import read_header, table_paths
    from ..training.checkpoint import latest_checkpoint, load_checkpoint
    from ..training.corpus import build_corpus
    from ..training.export import export_tables
    from ..training.train import TrainConfig, build_model, check_same_data

    if tier not in TIERS:
        raise UserError(f"tier must be one of {TIERS}, got {tier!r}")
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir / "checkpoints") if run_dir.is_dir() else None
    if ckpt is None:
        raise InputNotFound(f"no checkpoint under {run_dir}/checkpoints (train one with "
                                f"`engram train --out_dir={run_dir}`)")
    state, meta, step = load_checkpoint(ckpt)
    cfg = TrainConfig(**meta["config"])
    corpus = build_corpus(cfg.data_config())
    check_same_data(corpus, meta, ckpt)  # the data the checkpoint was trained on, tokens and all
    tok = corpus.tokenizer()  # the one the data was made with: hasher and decoding share it
    ecfg = cfg.engram_config()
    hasher = cfg.hasher(compression=corpus.compression())
    if hasher is not None:  # the one training used: Engram-Nine's carries the saved hot index
        hasher = checkpoint_hasher(hasher, state, cfg.shared_tables)
    tables: dict[int, Any] = {}
    layer_set = None
    if engram_layers is not None:
        from ..models.v41_layers import check_fits, read_layer_set

        layer_set = read_layer_set(engram_layers)
        check_fits(cfg.model_config(corpus.vocab_size), layer_set, hasher.parts)
        if tier != "memory":
            counts = hasher.count_reads(corpus.train) if cache_fraction > 0 else None
            tables = open_tier(tier, layer_set.table_dir, layer_set.config, hasher, counts=counts,
                               cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                               **options)
    if tier != "memory" and ecfg is not None and layer_set is None:
        table_dir = Path(table_dir) if table_dir is not None else run_dir / "tables"
        stale = [p for p in table_paths(table_dir, hasher) if not p.exists()
                 or (h := read_header(p)).tag != ckpt.name or h.dtype != table_dtype]
        stale += [p for p in index_paths(table_dir, hasher) if not p.exists()]
        if stale:
            print(f"engram: exporting tables of {ckpt.name} to {table_dir}", file=sys.stderr)
            export_tables(ckpt, table_dir, dtype=table_dtype, hasher=hasher, tag=ckpt.name)
        check_index_files(table_dir, ecfg, hasher)  # the hot index the checkpoint trained
        counts = hasher.count_reads(corpus.train) if cache_fraction > 0 else None
        tables = open_tier(tier, table_dir, ecfg, hasher, counts=counts,
                           cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                           **options)
    model = build_model(cfg, corpus, tables or None)
    load_dense_state(model, state["model"], outside=tables)
    if layer_set is not None:
        from ..models.v41_layers import load_layer_set

        load_layer_set(model, layer_set, hasher, memory_tables=tier == "memory", verify=verify)
    model.eval()
    return Served(model, hasher, corpus.vocab, ckpt, tok, tables, corpus.train)


def load_dense_state(model: EngramLM, state: dict[str, torch.Tensor],
                     outside: Iterable[int] = ()) -> None:
    """Load a full state dict into a model whose tables may live in outside stores: their rows
    come from the stores, so the checkpoint's table entries are skipped for those layers
    (``outside``: layers whose tables came from a tier, which keep their rows even when the store
    is a module with parameters of its own, e.g. the memory or sharded tier)."""
    own = model.state_dict()
    kept = tuple(f"blocks.{lid}.engram.table." for lid in outside)
    keep = {k: v for k, v in own.items() if k.startswith(kept)}
    skip = {k for k in state if ".engram.table." in k and (k not in own or k in keep)}
    missing = set(own) - set(state) - set(keep)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict({**{k: v for k, v in state.items() if k not in skip}, **keep},
                          strict=True)
