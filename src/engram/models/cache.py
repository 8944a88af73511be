"""The one decode state: ``DecodeGroup``, rows decoded together from one position, holding their
n-gram history (``HashStream``) and a cache: ``DecodeCache`` for our LM (each layer's keys and
values), ``InjectedCache`` for a transformers model with Engram injected (transformers' KV cache);
both keep each Engram layer's conv context and the position reached. Our Generator, transformers'
``EngramCache`` (serving/hf_model.py) and an injected model's own ``generate`` (models/hf.py) all
decode through it. A paged engine keeps the same history per KV slot instead (serving/slots.py): it
has no per-request object to hang it on.

Shape legend: b batch, g rows of a group, h attention heads, e head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..module import EngramState
from ..retrieval.hashing import HashStream
from .layers import CacheAttention


@dataclass
class DecodeCache:
    """Everything a cached forward needs to continue a batch of sequences at position ``pos``."""

    keys: list[torch.Tensor]  # per layer [b, h, max_len, e]
    values: list[torch.Tensor]  # per layer [b, h, max_len, e]
    engram: dict[int, EngramState] = field(default_factory=dict)  # per Engram layer: conv context
    pos: int = 0  # positions already processed (the next token's position)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def attention(self, layer: int) -> CacheAttention:
        """Layer ``layer``'s attention for the next forward: continues at ``pos``."""
        return CacheAttention(self.keys[layer], self.values[layer], self.pos)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search, batch compaction)."""
        self.keys = [k.index_select(0, index.to(k.device)) for k in self.keys]
        self.values = [v.index_select(0, index.to(v.device)) for v in self.values]
        for state in self.engram.values():
            state.reorder(index)

    def cat(self, other: DecodeCache) -> DecodeCache:
        """This cache's rows, then ``other``'s (both at the same position)."""
        return DecodeCache(
            keys=[torch.cat([x, y]) for x, y in zip(self.keys, other.keys)],
            values=[torch.cat([x, y]) for x, y in zip(self.values, other.values)],
            engram={i: EngramState(None if s.conv is None
                                   else torch.cat([s.conv, other.engram[i].conv]))
                    for i, s in self.engram.items()},
            pos=self.pos)


@dataclass
class InjectedCache:
    """The decode state of rows of a transformers model with Engram injected: transformers' KV
    cache, our position and each Engram layer's conv context. ``kv`` is None where transformers'
    own ``generate`` holds the KV cache (models/hf.py keys this state to it and reorders it)."""

    kv: Any  # transformers.DynamicCache, or None (held by transformers)
    engram: dict[int, EngramState] = field(default_factory=dict)
    pos: int = 0
    rows: int = 0

    @property
    def batch_size(self) -> int:
        return self.rows

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (batch compaction, beam search)."""
        if self.pos and self.kv is not None:
            self.kv.reorder_cache(index.to(self.kv.layers[0].keys.device))
        for s in self.engram.values():
            s.reorder(index)
        self.rows = int(index.numel())

    def cat(self, other: InjectedCache) -> InjectedCache:
        """This cache's rows, then ``other``'s (same position)."""
        from transformers import DynamicCache

        kv = DynamicCache([(torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values]))
                           for a, b in zip(self.kv.layers, other.kv.layers)])
        convs = {i: EngramState(None if s.conv is None
                                else torch.cat([s.conv, other.engram[i].conv]))
                 for i, s in self.engram.items()}
        return InjectedCache(kv, convs, self.pos, self.rows + other.rows)


@dataclass
class DecodeGroup:
    """Rows decoded together from one position: their cache (KV, conv context, position) and
    n-gram history, and the tokens waiting to be fed (the Generator's)."""

    rows: Any  # the caller's row indices (a list, or a tensor [g])
    cache: DecodeCache | InjectedCache
    stream: HashStream | None  # None without Engram
    pending: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [g]

    def keep(self, index: torch.Tensor) -> None:
        """Row i continues old row ``index[i]`` (dropped rows, beam reordering)."""
        self.cache.reorder(index)
        if self.stream is not None:
            self.stream.reorder(index)
