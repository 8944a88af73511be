"""Engram-Nine's two-tier memory: a collision-free hot table beside the hashed (cold) table.

arXiv 2601.16531, figure 1: an n-gram order served by the hot tier reads one row of width
K * d_head (its own row: the MPHF gave it a private slot); otherwise it reads its K hashed heads
from the cold table and concatenates them, as in plain Engram. The ids arrive from the data
pipeline (``engram.retrieval.hot.NineHasher``) as ``[..., H + G]``: H global cold rows, then one hot
slot per order (-1 = cold). Each table is gathered only where it serves, so a row that was not
read gets no gradient (RowAdam then leaves it, and its moments, alone).

The store keeps the ``TableStore`` contract of one head per row: ``lookup`` returns
``[..., H, e]``, a hot row split back into K heads, so the Engram module cannot tell the tiers apart.

Served from table files, a table set is its parts (engram.retrieval.hashing.Hasher.parts) on any
tier: ``assemble`` and ``parts_of`` go between the two views for every hasher, and the hot
index travels beside the tables (``write_index_files``), so callers never ask which hasher
they hold.

Shape legend: u positions (all leading dims), G orders, K heads per order, H = G * K, e head dim,
S hot slots.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import publish
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher, NgramHasher
from ..retrieval.hot import HotIndex, NineHasher
from .store import MemoryTable, TableStore
from .tablefile import TableFileError, check_config


class HotColdStore(nn.Module):
    """Cold table [R, e] + hot table [S, K * e] (S = 0: exactly the plain hashed table).

    ``cold`` / ``hot``: outside stores to serve from instead (table files on any tier, behind a
    cache and prefetch: ``engram.serving.loader``); they must be R x e and S x ``K*e``.
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
        """ids [..., H + G] -> (cold rows [``u*G``, K], hot slots ``[u*G]``, hits [h], misses [m]), or the
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


# -- a table set as parts -------------------------------------------------------------------------

def assemble(parts: dict[tuple[str, int], TableStore], config: EngramConfig,
             hasher: Hasher) -> dict[int, TableStore]:
    """``{layer: store}`` from each table set's parts ``{(part, owner layer): store}``: the cold
    part itself for a plain hasher; one ``HotColdStore`` per set over its cold and hot parts
    for a NineHasher (the same object for every layer of a shared set)."""
    sets = {lid: t for (part, lid), t in parts.items() if part == "cold"}
    if isinstance(hasher, NineHasher):
        sets = {lid: HotColdStore(t.num_rows, config.head_dim, config.max_ngram_size - 1,
                                  config.n_head_per_ngram, hasher.index.num_slots, cold=t,
                                  hot=parts.get(("hot", lid)))
                for lid, t in sets.items()}
    return {lid: sets[hasher.owner(lid)] for lid in config.layer_ids}


def parts_of(store: TableStore, hasher: Hasher) -> dict[str, TableStore]:
    """A table set's stores by part (the inverse of ``assemble``): a HotColdStore's cold and
    hot tables, any other store as its set's cold part; refuses a store the hasher cannot read."""
    if isinstance(store, HotColdStore) != isinstance(hasher, NineHasher):
        raise ValueError(f"a {type(store).__name__} cannot be read through a "
                         f"{type(hasher).__name__}: a Nine model's tables need its NineHasher "
                         "(its hot index), a plain model's a plain NgramHasher")
    if not isinstance(store, HotColdStore):
        return {"cold": store}
    return {"cold": store.cold, **({} if store.hot is None else {"hot": store.hot})}


# -- the hot index beside the table files ---------------------------------------------------------

def index_paths(directory: str | Path, hasher: Hasher) -> list[Path]:
    """Each table set's hot index file (``hot_path``); none for a plain hasher."""
    if not isinstance(hasher, NineHasher):
        return []
    return [hot_path(directory, lid) for lid in hasher.owners]


def write_index_files(directory: str | Path, hasher: Hasher, config: EngramConfig,
                      tag: str = "") -> list[Path]:
    """Publish the hot index beside each table set's files (none for a plain hasher), so a
    server that has only the files (an ``engram export-hf`` directory) hashes like training."""
    return [write_hot_tier(p, hasher.index, None, config, tag=tag)
            for p in index_paths(directory, hasher)]


def read_index_files(directory: str | Path, config: EngramConfig, hasher: NgramHasher,
                     nine: dict[str, Any] | None) -> Hasher:
    """The hasher an export's files serve: ``hasher`` itself, or with ``nine`` (config.json's
    ``engram_nine``: hot slots and sharing, engram.retrieval.hot.nine_config) a NineHasher over
    the hot index the files carry; refused when the table sets disagree or the slot count is not
    config.json's."""
    if not nine:
        return hasher
    index = _index_of(directory, config, config.layer_ids[:1] if nine["shared"]
                      else config.layer_ids)
    if index.num_slots != nine["hot_slots"]:
        raise TableFileError(f"{directory}: the hot index has {index.num_slots} slots, "
                             f"config.json says {nine['hot_slots']}")
    return NineHasher(hasher, index, shared=nine["shared"])


def check_index_files(directory: str | Path, config: EngramConfig, hasher: Hasher) -> None:
    """Refuse index files beside the tables that are not ``hasher``'s hot index (tables of another
    run, or an interrupted export); nothing to check for a plain hasher."""
    if isinstance(hasher, NineHasher):
        _index_of(directory, config, hasher.owners, expect=hasher.index)


def _index_of(directory: str | Path, config: EngramConfig, owners: list[int],
              expect: HotIndex | None = None) -> HotIndex:
    """The one hot index every table set's file holds (and ``expect``, when given)."""
    index = None
    for lid in owners:
        path = hot_path(directory, lid)
        got, _ = read_hot_tier(path, config)
        want = expect if expect is not None else index
        if want is not None and got.digest() != want.digest():
            raise TableFileError(
                f"{path} holds another hot index ({got.num_slots} slots, digest {got.digest()}) "
                f"than {'the checkpoint' if expect is not None else 'the first table set'} "
                f"({want.num_slots} slots, digest {want.digest()}): tables of another run or an "
                f"interrupted export; delete {directory} (or choose another table_dir) to "
                "re-export")
        index = index or got
    return index


# -- the hot tier on disk ----------------------------------------------------------------------------
HOT_FORMAT, HOT_VERSION = "engram-hot-tier", 1


def hot_path(directory: str | Path, layer_id: int) -> Path:
    """Beside the layer's cold table file (``layer{id}.table``)."""
    return Path(directory) / f"layer{int(layer_id)}.hot.safetensors"


def write_hot_tier(path: str | Path, index: HotIndex, rows: torch.Tensor | None,
                   config: EngramConfig, tag: str = "") -> Path:
    """Publish the hot tier (keys, MPHF, fingerprints and hot rows [S, ``K*e``]) atomically.

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
