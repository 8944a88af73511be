"""Serving a trained run: its newest checkpoint as a model whose tables live on a chosen tier.

memory (the checkpoint's own tables), file (memory-mapped table files, exported from the checkpoint
when missing or stale), pinned (host memory, copied to the device per lookup) or shared (one
read-only mapping for every process on the machine); optionally behind a hot cache and prefetch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.model import EngramLM
from ..retrieval.hashing import NgramHasher

TIERS = ("memory", "file", "pinned", "shared")


@dataclass
class Served:
    model: EngramLM
    hasher: NgramHasher | None
    vocab: np.ndarray  # [V] model id -> raw id
    checkpoint: Path
    tokenizer: Any  # the tokenizers.Tokenizer the corpus and the hasher were built with
    tables: dict[int, Any] = field(default_factory=dict)  # the stores, outermost first
    train_tokens: np.ndarray | None = None  # the run's training stream (raw ids): row counts


def load_run(run_dir: str | Path, *, tier: str = "memory", table_dir: str | Path | None = None,
             table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
             verify: bool = True) -> Served:
    """The newest checkpoint of a ``engram train --out_dir`` folder, ready to generate.

    With a tier other than memory the tables are served from table files in ``table_dir``
    (default ``run_dir/tables``), exported from the checkpoint when missing or stale; optionally
    behind a hot cache of ``cache_fraction`` of each table (``engram.tables.cache.build_cache``: mostly
    static top-k by the training text's n-gram frequencies, the rest LRU) and background prefetch.
    """
    from ..retrieval.compress import default_tokenizer
    from ..tables.cache import count_rows
    from ..tables.tablefile import read_header, table_path
    from ..training.checkpoint import latest_checkpoint, load_checkpoint
    from ..training.corpus import build_corpus
    from ..training.export import export_tables
    from ..training.train import TrainConfig, build_model

    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir / "checkpoints") if run_dir.is_dir() else None
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir}/checkpoints (train one with "
                                f"`engram train --out_dir={run_dir}`)")
    state, meta, step = load_checkpoint(ckpt)
    cfg = TrainConfig(**meta["config"])
    tok = default_tokenizer()  # loaded once: corpus, compression and decoding share it
    corpus = build_corpus(cfg.data_config(), tok)
    ecfg = cfg.engram_config()
    hasher = cfg.hasher(tok)
    if "hot_index" in state:  # Engram-Nine: hot slots ride behind the cold row ids
        from ..retrieval.hot import HotIndex, NineHasher

        if tier != "memory":
            raise ValueError("an Engram-Nine run serves from tier='memory' only for now (its table "
                             "files, with the hot tier, come from export_tables)")
        hasher = NineHasher(hasher, HotIndex.from_state_dict(state["hot_index"]),
                            shared=cfg.shared_tables)
    tables: dict[int, Any] = {}
    if tier != "memory" and ecfg is not None:
        table_dir = Path(table_dir) if table_dir is not None else run_dir / "tables"
        paths = [table_path(table_dir, lid) for lid in ecfg.layer_ids]
        stale = [p for p in paths if not p.exists() or read_header(p).tag != ckpt.name
                 or read_header(p).dtype != table_dtype]
        if stale:
            print(f"engram: exporting tables of {ckpt.name} to {table_dir}", file=sys.stderr)
            export_tables(ckpt, table_dir, dtype=table_dtype, hasher=hasher, tag=ckpt.name)
        counts = count_rows(hasher, corpus.train) if cache_fraction > 0 else None
        tables = open_tier(table_dir, ecfg, hasher, tier, counts=counts,
                           cache_fraction=cache_fraction, prefetch=prefetch, verify=verify)
    model = build_model(cfg, corpus, tables or None)
    load_dense_state(model, state["model"])
    model.eval()
    return Served(model, hasher, corpus.vocab, ckpt, tok, tables, corpus.train)


def open_tier(table_dir: str | Path, config: Any, hasher: NgramHasher, tier: str, *,
              counts: dict[int, torch.Tensor] | None = None, cache_fraction: float = 0.0,
              prefetch: bool = False, verify: bool = True) -> dict[int, Any]:
    """``{layer: store}`` for the table files in ``table_dir`` on ``tier`` (not "memory"),
    optionally behind a hot cache (``counts``: each layer's row frequencies on training text) and
    background prefetch. Files of another config, layer or hash profile are refused here."""
    from ..tables.cache import build_cache
    from ..tables.prefetch import wrap_prefetch
    from ..tables.tiers import PinnedTable, SharedPool, open_tables

    if tier not in TIERS or tier == "memory":
        raise ValueError(f"tier must be one of {TIERS[1:]} for table files, got {tier!r}")
    if tier == "shared":
        tables = dict(SharedPool(table_dir, config, hasher, verify=verify).tables)
    else:
        tables = dict(open_tables(table_dir, config, hasher, verify=verify))
        if tier == "pinned":
            tables = {lid: PinnedTable(t) for lid, t in tables.items()}
    if cache_fraction > 0:
        if counts is None:
            raise ValueError("a hot cache needs the training text's row counts")
        tables = {lid: build_cache(t, counts[lid], cache_fraction) for lid, t in tables.items()}
    if prefetch:
        tables = dict(wrap_prefetch(tables))
    return tables


def load_dense_state(model: EngramLM, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into a model whose tables may live in outside stores (their rows
    come from the stores, so the checkpoint's table entries are skipped for those layers)."""
    own = set(model.state_dict())
    outside = {k for k in state if ".engram.table." in k and k not in own}
    missing = own - set(state)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict({k: v for k, v in state.items() if k not in outside}, strict=True)
