"""The reference LM with Engram-Nine memory: hot+cold tables, optionally one set shared by layers.

arXiv 2601.16531 (section 4): one table set read by several layers (2, 4 and 6 of 12 there), each
layer with its own gate, projections and conv. The Engram modules are the ordinary ones, swapped in
with a ``HotColdStore`` and global ids (the ids carry the hot slots after the cold rows, see
``engram.retrieval.hot.NineHasher``); the backbone is ``EngramLM`` unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..module import Engram
from ..retrieval.hashing import Hasher
from ..retrieval.hot import NineHasher
from ..retrieval.primes import prime_table_sizes
from ..tables.hotcold import HotColdStore
from .model import EngramLM
from .model_config import ModelConfig


def build_lm(config: ModelConfig, hasher: Hasher | None = None,
             tables: dict[int, Any] | None = None, *, hot_slots: int = 0,
             shared: bool = False, init: bool = True) -> EngramLM:
    """The one model builder (training, the runtime and exports call it): an Engram-Nine LM for
    a NineHasher (its hot slots and sharing) or when ``hot_slots`` / ``shared`` ask for one, else
    ``EngramLM``; ``tables``: outside stores (``engram.tables.registry``). ``init=False``: for a
    saved state to fill (EngramLM's ``init``), on meta, nothing drawn."""
    if isinstance(hasher, NineHasher):
        hot_slots, shared = hasher.index.num_slots, hasher.shared
    if hot_slots or shared:
        return build_nine_lm(config, hot_slots, shared, tables=tables or None, init=init)
    return EngramLM(config, tables or None, init=init)


def build_nine_lm(config: ModelConfig, hot_slots: int, shared: bool = True,
                  tables: dict[int, HotColdStore] | None = None, *,
                  init: bool = True) -> EngramLM:
    """EngramLM whose Engram layers read a ``HotColdStore`` (one per layer, or one shared).

    ``hot_slots`` = G * N_hot rows of width K * d_head; 0 gives the plain hashed tables.
    ``tables``: ``{layer: HotColdStore}`` over outside stores (a served run's table files; one
    object for every layer when shared) instead of in-memory tables. ``init=False``: on meta,
    for a saved state to fill (EngramLM's ``init``).
    """
    ec = config.engram
    if ec is None:
        raise ValueError("a Nine model needs an Engram config (config.engram)")
    sizes = prime_table_sizes(ec)
    layers = list(ec.layer_ids)
    # The stores' rows are their constructors' draws from the global generator, before EngramLM
    # draws its init_seed: a training build keeps that order (recorded runs depend on it).
    on = nullcontext() if init else torch.device("meta")
    with on:
        if tables is not None:
            stores = _check_stores(tables, layers, sizes, hot_slots, shared)
        elif shared:
            first = sum(p for order in sizes[layers[0]] for p in order)
            one = _store(config, first, hot_slots)
            stores = {lid: one for lid in layers}
        else:
            stores = {lid: _store(config, sum(p for o in sizes[lid] for p in o), hot_slots)
                      for lid in layers}
    lm = EngramLM(config, tables={lid: None for lid in layers}, init=init)
    v41 = ec.profile == "v4.1"
    use_conv = (not v41) if config.engram_conv is None else config.engram_conv
    with on:
        for lid in layers:
            # Same module build_engram makes, but fed global ids (the hot slots ride behind them).
            lm.blocks[lid].engram = Engram(
                stores[lid], None, ec.d_mem, config.d_model, config.hc_mult,
                gate=config.engram_gate, norm_eps=config.engram_norm_eps,
                kernel_size=ec.kernel_size if use_conv else 0, dilation=ec.max_ngram_size,
                fused=v41, conv_init="zero")
    if init:
        lm.init_weights()  # the swapped modules get the model's init; stores keep their own
    return lm


def _check_stores(tables: dict, layers: list[int], sizes: list, hot_slots: int,
                  shared: bool) -> dict[int, HotColdStore]:
    if sorted(tables) != sorted(layers):
        raise ValueError(f"tables for layers {sorted(tables)}, the model's Engram layers are "
                         f"{layers}")
    for lid in layers:
        t, owner = tables[lid], layers[0] if shared else lid
        rows = sum(p for o in sizes[owner] for p in o)
        if not isinstance(t, HotColdStore) or (t.num_rows, t.hot_slots) != (rows, hot_slots):
            raise ValueError(f"layer {lid} needs a HotColdStore of {rows} cold rows and "
                             f"{hot_slots} hot slots, got {type(t).__name__} of "
                             f"{getattr(t, 'num_rows', '?')} + {getattr(t, 'hot_slots', '?')}")
        if shared and t is not tables[layers[0]]:
            raise ValueError("a shared table set needs one store object for every layer")
    return dict(tables)


def _store(config: ModelConfig, cold_rows: int, hot_slots: int) -> HotColdStore:
    ec = config.engram
    return HotColdStore(cold_rows, ec.head_dim, ec.max_ngram_size - 1, ec.n_head_per_ngram,
                        hot_slots, sparse=config.sparse_tables, init_std=config.table_init_std)


def stores_of(lm: nn.Module) -> list[HotColdStore]:
    """Distinct hot+cold stores of a model (a shared one once)."""
    seen: dict[int, HotColdStore] = {}
    for m in lm.modules():
        if isinstance(m, HotColdStore):
            seen.setdefault(id(m), m)
    return list(seen.values())


def nine_param_counts(lm: EngramLM) -> dict[str, int]:
    """Parameters counted once each (a shared table set once): total, table, hot, cold, dense."""
    stores = stores_of(lm)
    total = sum(p.numel() for p in lm.parameters())  # parameters() yields shared ones once
    hot = sum(s.hot.weight.numel() for s in stores if s.hot is not None)
    cold = sum(s.cold.weight.numel() for s in stores)
    return {"total": total, "table": hot + cold, "hot": hot, "cold": cold,
            "dense": total - hot - cold}
