"""Engram-Nine's two-tier memory: a collision-free hot table beside the hashed (cold) table.

arXiv 2601.16531, figure 1: an n-gram order served by the hot tier reads one row of width
K * d_head (its own row: the MPHF gave it a private slot); otherwise it reads its K hashed heads
from the cold table and concatenates them, as in plain Engram. The ids arrive from the data
pipeline (``engram.retrieval.hot.NineHasher``) as ``[..., H + G]``: H global cold rows, then one hot
slot per order (-1 = cold). Each table is gathered only where it serves, so a row that was not
read gets no gradient (RowAdam then leaves it, and its moments, alone).

The store keeps the :class:`TableStore` contract of one head per row: ``lookup`` returns
``[..., H, e]``, a hot row split back into K heads, so the Engram module cannot tell the tiers apart.

Shape legend: u positions (all leading dims), G orders, K heads per order, H = G * K, e head dim,
S hot slots.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from torch import nn

from ..files import publish
from ..retrieval.config import EngramConfig
from ..retrieval.hot import HotIndex
from .store import MemoryTable, TableStore
from .tablefile import TableFileError, check_config


class HotColdStore(nn.Module):
    """Cold table [R, e] + hot table [S, K * e] (S = 0: exactly the plain hashed table).

    ``cold`` / ``hot``: outside stores to serve from instead (table files on any tier, behind a
    cache and prefetch: ``engram.serving.loader``); they must be R x e and S x K*e.
    """

    def __init__(self, cold_rows: int, head_dim: int, orders: int, heads_per_order: int,
                 hot_slots: int = 0, sparse: bool = True, init_std: float = 1.0, *,
                 cold: TableStore | None = None, hot: TableStore | None = None):
        super().__init__()
        if hot_slots < 0:
            raise ValueError(f"hot_slots must be >= 0, got {hot_slots}")
        self.orders, self.k = int(orders), int(heads_per_order)
        self.num_heads = self.orders * self.k
        for name, store, want in (("cold", cold, (cold_rows, head_dim)),
                                  ("hot", hot, (hot_slots, self.k * head_dim))):
            if store is not None and (store.num_rows, store.dim) != want:
                raise ValueError(f"the {name} store is {store.num_rows} x {store.dim}, "
                                 f"expected {want[0]} x {want[1]}")
        if hot_slots and cold is not None and hot is None:
            raise ValueError(f"{hot_slots} hot slots but no hot store beside the outside cold one")
        self.cold = cold if cold is not None else MemoryTable(cold_rows, head_dim, sparse=sparse,
                                                              init_std=init_std)
        self.hot = hot if hot is not None or not hot_slots else MemoryTable(
            hot_slots, self.k * head_dim, sparse=sparse, init_std=init_std)
        self.num_rows, self.dim = self.cold.num_rows, self.cold.dim  # the TableStore view
        self.hot_slots = int(hot_slots)

    @property
    def num_params(self) -> int:
        return self.cold.weight.numel() + (self.hot.weight.numel() if self.hot is not None else 0)

    def _split(self, ids: torch.Tensor):
        """ids [..., H + G] -> (cold rows [u*G, K], hot slots [u*G], hits [h], misses [m]), or the
        cold rows alone (None for the rest) when nothing is hot."""
        h, g, k = self.num_heads, self.orders, self.k
        if ids.shape[-1] != h + g:
            raise ValueError(f"a hot+cold lookup needs {h} cold rows + {g} hot slots per position, "
                             f"got {ids.shape[-1]} ids (a NineHasher's output)")
        rows = ids[..., :h].reshape(-1, k)  # [u*G, K]
        slots = ids[..., h:].reshape(-1)  # [u*G]
        hit = slots >= 0
        if self.hot is None or not bool(hit.any()):
            if bool(hit.any()):
                raise ValueError("hot slots given but this store has no hot tier")
            return rows, None, None, None
        if int(slots.max()) >= self.hot_slots:
            raise ValueError(f"hot slot {int(slots.max())} out of range for {self.hot_slots} slots")
        return rows, slots, hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..., H + G] -> rows [..., H, e]."""
        h, k, e = self.num_heads, self.k, self.dim
        lead = ids.shape[:-1]
        rows, slots, hit_i, miss_i = self._split(ids)
        if slots is None:
            return self.cold.lookup(rows).view(*lead, h, e)
        cold = self.cold.lookup(rows[miss_i])  # [misses, K, e]
        hot = self.hot.lookup(slots[hit_i]).view(-1, k, e)  # [hits, K, e]
        order = torch.cat([miss_i, hit_i])
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        both = torch.cat([cold, hot])  # on the stores' device, which may not be the ids'
        return both.index_select(0, inv.to(both.device)).view(*lead, h, e)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Announce exactly the rows ``lookup(ids)`` will ask each tier for (a PrefetchTable in
        front of either joins its gather by equal rows)."""
        rows, slots, hit_i, miss_i = self._split(ids)
        if slots is None:
            self.cold.prefetch(rows)
            return
        self.cold.prefetch(rows[miss_i])
        self.hot.prefetch(slots[hit_i])

    def extra_repr(self) -> str:
        return (f"cold={self.cold.num_rows}x{self.dim}, hot={self.hot_slots}x{self.k * self.dim}, "
                f"orders={self.orders}, K={self.k}")


# -- the hot tier on disk ----------------------------------------------------------------------------
HOT_FORMAT, HOT_VERSION = "engram-hot-tier", 1


def hot_path(directory: str | Path, layer_id: int) -> Path:
    """Beside the layer's cold table file (``layer{id}.table``)."""
    return Path(directory) / f"layer{int(layer_id)}.hot.safetensors"


def write_hot_tier(path: str | Path, index: HotIndex, rows: torch.Tensor | None,
                   config: EngramConfig, tag: str = "") -> Path:
    """Publish the hot tier (keys, MPHF, fingerprints and hot rows [S, K*e]) atomically.

    One safetensors file; a crc32 per tensor in the metadata names a corrupted one on read.
    """
    from safetensors.torch import save_file

    n = index.num_slots
    if rows is not None and (rows.dim() != 2 or rows.shape[0] != n):
        raise ValueError(f"hot rows must be [{n}, K*e] for {n} hot slots, got {tuple(rows.shape)}")
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(index.state_dict(), "index", tensors)
    if rows is not None:
        tensors["rows"] = rows.detach().float().cpu().contiguous()
    meta = {"format": HOT_FORMAT, "version": HOT_VERSION, "index": skeleton, "tag": str(tag),
            "engram_config": config.to_dict(),
            "crc32": {k: f"{zlib.crc32(_bytes(t)):08x}" for k, t in tensors.items()}}
    # readers see the old file or this one, whole
    return publish(path, lambda tmp: save_file(tensors, tmp, metadata={"meta": json.dumps(meta)}))


def read_hot_tier(path: str | Path, config: EngramConfig | None = None
                  ) -> tuple[HotIndex, torch.Tensor | None]:
    """(index, rows or None); checks every tensor's crc32 and, if given, the Engram config."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no hot tier file at {path}")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
    except Exception as e:  # safetensors raises several types for a torn or foreign file
        raise TableFileError(f"{path}: not a readable hot tier file: {e}") from e
    if meta.get("format") != HOT_FORMAT or meta.get("version") != HOT_VERSION:
        raise TableFileError(f"{path}: not a hot tier file of version {HOT_VERSION}")
    for k, t in tensors.items():
        if f"{zlib.crc32(_bytes(t)):08x}" != meta["crc32"].get(k):
            raise TableFileError(f"{path}: checksum mismatch in {k!r}; the file is corrupted")
    if config is not None:
        check_config(meta["engram_config"], config, str(path))
    index = HotIndex.from_state_dict(_unflatten(meta["index"], tensors))
    return index, tensors.get("rows")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _flatten(obj, prefix: str, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {k: _flatten(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
    return obj


def _unflatten(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    return obj
