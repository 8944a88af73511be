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
from ..retrieval.hot import is_nine

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
             verify: bool = True, engram_layers: str | Path | None = None) -> Served:
    """The newest checkpoint of a ``engram train --out_dir`` folder, ready to generate.

    With a tier other than memory the tables are served from table files in ``table_dir``
    (default ``run_dir/tables``), exported from the checkpoint when missing or stale; optionally
    behind a hot cache of ``cache_fraction`` of each table (``engram.tables.cache.build_cache``: mostly
    static top-k by the training text's n-gram frequencies, the rest LRU) and background prefetch.
    ``engram_layers``: a DeepSeek-V4.1 layer set (``engram import-v41``) replacing the Engram
    weights and tables of a v4.1 run of the same shape; its table files are served on the tier.
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
    nine = "hot_index" in state  # Engram-Nine: hot slots ride behind the cold row ids
    if nine:
        from ..retrieval.hot import HotIndex, NineHasher

        hasher = NineHasher(hasher, HotIndex.from_state_dict(state["hot_index"]),
                            shared=cfg.shared_tables)
    tables: dict[int, Any] = {}
    layer_set = None
    if engram_layers is not None:
        from ..models.v41_layers import check_fits, read_layer_set

        layer_set = read_layer_set(engram_layers)
        check_fits(cfg.model_config(corpus.vocab_size), layer_set, nine=nine)
        if tier != "memory":
            counts = count_rows(hasher, corpus.train) if cache_fraction > 0 else None
            tables = open_tier(layer_set.table_dir, layer_set.config, hasher, tier, counts=counts,
                               cache_fraction=cache_fraction, prefetch=prefetch, verify=verify)
    if tier != "memory" and ecfg is not None and layer_set is None:
        table_dir = Path(table_dir) if table_dir is not None else run_dir / "tables"
        owners = hasher.owners if nine else ecfg.layer_ids
        paths = [table_path(table_dir, lid) for lid in owners]
        if nine and hasher.index.num_slots:
            paths += [table_path(table_dir, lid, "hot") for lid in owners]
        stale = [p for p in paths if not p.exists()
                 or (h := read_header(p)).tag != ckpt.name or h.dtype != table_dtype]
        if nine:
            from ..tables.hotcold import hot_path

            stale += [p for lid in owners if not (p := hot_path(table_dir, lid)).exists()]
        if stale:
            print(f"engram: exporting tables of {ckpt.name} to {table_dir}", file=sys.stderr)
            export_tables(ckpt, table_dir, dtype=table_dtype, hasher=hasher, tag=ckpt.name)
        if nine:  # the hot index the files carry; it must be the one the checkpoint trained
            hasher = nine_hasher_from_files(table_dir, ecfg, hasher.hasher, cfg.shared_tables,
                                            expect=hasher.index)
        counts = None
        if cache_fraction > 0:
            counts = hasher.count_reads(corpus.train) if nine else count_rows(hasher, corpus.train)
        tables = open_tier(table_dir, ecfg, hasher, tier, counts=counts,
                           cache_fraction=cache_fraction, prefetch=prefetch, verify=verify)
    model = build_model(cfg, corpus, tables or None)
    load_dense_state(model, state["model"])
    if layer_set is not None:
        from ..models.v41_layers import load_layer_set

        load_layer_set(model, layer_set, hasher, memory_tables=tier == "memory", verify=verify)
    model.eval()
    return Served(model, hasher, corpus.vocab, ckpt, tok, tables, corpus.train)


def nine_hasher_from_files(table_dir: str | Path, config: Any, hasher: NgramHasher, shared: bool,
                           expect: Any = None) -> Any:
    """An Engram-Nine run's NineHasher from its table files: the hot index (keys, MPHF,
    fingerprints) each table set's ``layer{id}.hot.safetensors`` holds; refused when the sets
    disagree or (``expect``: a HotIndex) differ from the checkpoint's."""
    from ..retrieval.hot import NineHasher
    from ..tables.hotcold import hot_path, read_hot_tier
    from ..tables.tablefile import TableFileError

    index = None
    for lid in config.layer_ids[:1] if shared else config.layer_ids:
        path = hot_path(table_dir, lid)
        got, _ = read_hot_tier(path, config)
        want = expect if expect is not None else index
        if want is not None and got.digest() != want.digest():
            raise TableFileError(
                f"{path} holds another hot index ({got.num_slots} slots, digest {got.digest()}) "
                f"than {'the checkpoint' if expect is not None else 'the first table set'} "
                f"({want.num_slots} slots, digest {want.digest()}): tables of another run or an "
                f"interrupted export; delete {table_dir} (or choose another table_dir) to "
                "re-export")
        index = index or got
    return NineHasher(hasher, index, shared=shared)


def open_tier(table_dir: str | Path, config: Any, hasher: NgramHasher, tier: str, *,
              counts: dict[int, Any] | None = None, cache_fraction: float = 0.0,
              prefetch: bool = False, verify: bool = True,
              device: torch.device | str = "cpu") -> dict[int, Any]:
    """``{layer: store}`` for the table files in ``table_dir`` on ``tier`` (not "memory"),
    optionally behind a hot cache (``counts``: each layer's row frequencies on training text) and
    background prefetch. Files of another config, layer or hash profile are refused here.
    ``device``: where the model runs; the pinned tier copies looked-up rows there (its own
    default, the GPU when there is one, would hand a CPU model rows on the GPU).

    With an Engram-Nine hasher (``NineHasher``) each table set's cold and hot files go on the tier,
    each behind its own cache (``counts[layer]`` = (cold, hot) from ``NineHasher.count_reads``) and
    prefetch, under one :class:`HotColdStore` (the same object for every layer of a shared set).
    """
    from ..tables.cache import build_cache
    from ..tables.prefetch import wrap_prefetch
    from ..tables.tiers import PinnedTable, SharedPool, open_tables

    if tier not in TIERS or tier == "memory":
        raise ValueError(f"tier must be one of {TIERS[1:]} for table files, got {tier!r}")
    nine = is_nine(hasher)
    if tier == "shared":
        pool = SharedPool(table_dir, config, hasher, verify=verify)
        parts = {("cold", lid): t for lid, t in pool.tables.items()}
        parts.update({("hot", lid): t for lid, t in pool.hot_tables.items()})
    else:
        parts = {("cold", lid): t for lid, t in open_tables(table_dir, config, hasher,
                                                             verify=verify).items()}
        if nine:
            parts.update({("hot", lid): t for lid, t in open_tables(
                table_dir, config, hasher, "hot", verify=verify).items()})
        if tier == "pinned":
            parts = {k: PinnedTable(t, device=device) for k, t in parts.items()}
    if cache_fraction > 0:
        if counts is None:
            raise ValueError("a hot cache needs the training text's row counts")
        parts = {(kind, lid): build_cache(t, counts[lid][kind == "hot"] if nine else counts[lid],
                                          cache_fraction) for (kind, lid), t in parts.items()}
    if prefetch:
        parts = dict(wrap_prefetch(parts))
    if not nine:
        return {lid: t for (_, lid), t in parts.items()}
    from ..tables.hotcold import HotColdStore

    stores = {lid: HotColdStore(t.num_rows, config.head_dim, config.max_ngram_size - 1,
                                config.n_head_per_ngram, hasher.index.num_slots, cold=t,
                                hot=parts.get(("hot", lid)))
              for (kind, lid), t in parts.items() if kind == "cold"}
    return {lid: stores[hasher.owner(lid)] for lid in config.layer_ids}


def load_dense_state(model: EngramLM, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into a model whose tables may live in outside stores (their rows
    come from the stores, so the checkpoint's table entries are skipped for those layers)."""
    own = set(model.state_dict())
    outside = {k for k in state if ".engram.table." in k and k not in own}
    missing = own - set(state)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict({k: v for k, v in state.items() if k not in outside}, strict=True)
