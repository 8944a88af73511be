"""The decode state of a batch of sequences (``EngramLM.forward`` with a cache): each layer's
keys and values, each Engram layer's conv context, and the position reached.

Shape legend: b batch, h attention heads, e head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..module import EngramState
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
