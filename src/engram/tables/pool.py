"""A table pool on a DAX device or any mappable path: written once by one process, read by many.

The CXL paper (arXiv 2603.10087, section 4.3) puts every Engram table into one pooled memory
region (CXL.mem behind a switch, exposed as a device-DAX character device ``/dev/daxX.Y``) that
rank 0 fills once and every other rank and server maps read-only: the tables are never written
while serving, so no cross-host coherence is needed. Here the region is any path that can be
mapped: a DAX device, a file on a CXL-backed tmpfs or ``/dev/shm``, or a plain file (the stand-in
the tests use). Device DAX only allows ``mmap`` (no read/write calls) at its alignment, so every
access goes through mappings of whole 2 MiB units.

Layout: [0, 2 MiB) a header (magic, version, sequence number, size, directory length and crc32)
and a JSON directory (per table file, keyed like its name: "3" for layer 3's table, "3.hot" for
an Engram-Nine hot part: the file's header, where its rows and fp8 scales sit, their crc32); then
each table's rows, then its scales, each at a 2 MiB boundary.

The sequence number is a seqlock: odd while rank 0 writes, even once the pool is complete. A
reader refuses (or waits for) an odd number, and every lookup reads it before and after copying
its rows: a lookup that overlapped a rewrite raises ``PoolChanged`` instead of returning
torn rows. (Stores to a shared mapping become visible in program order on x86 (TSO); on weaker
memory models a writer would need fences around the sequence number.)

Shape legend: r rows, e row width, n rows asked for, nb fp8 scale blocks per row.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher
from . import tablefile
from .fp8 import StoredRows
from .tablefile import (
    DTYPES,
    SCALE_FORMATS,
    SUFFIX,
    TableFileError,
    TableHeader,
    check_compatible,
)
from .tiers import check_rows

ALIGN = 2 << 20  # device DAX maps in units of its alignment, 2 MiB by default
MAGIC = b"ENGRAMPL"
VERSION = 2  # the newest read here; a pool is written at its tables' newest table file version
_HEAD = struct.Struct("<8sIIQQQII")  # magic, version, reserved, seq, size, reserved, dir len, crc
_SEQ = 16  # byte offset of the u64 sequence number (8-byte aligned: one atomic store)


class PoolError(TableFileError):
    """The region holds no pool, a foreign one, or one too small or damaged to read."""


class PoolNotReady(PoolError):
    """The pool is being written (or was never finished): its rows are not to be read yet."""


class PoolChanged(PoolError):
    """A rewrite began while a lookup was copying rows; reopen the pool and ask again."""


def region_size(path: str | Path) -> int:
    """Bytes a path offers: a file's size, or a DAX character device's size from sysfs."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        sysfs = Path(f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/size")
        try:
            return int(sysfs.read_text().strip())
        except (OSError, ValueError):
            raise PoolError(f"{path}: a character device whose size {sysfs} cannot be read "
                            "(is it a device-DAX device?)") from None
    return st.st_size


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def _map(fd: int, length: int, write: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    return mmap.mmap(fd, length, mmap.MAP_SHARED, prot)


def _view(mm: mmap.mmap, dtype: torch.dtype, offset: int, rows: int, width: int) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    arr = np.frombuffer(mm, dtype=np.uint8, count=rows * width * itemsize, offset=offset)
    with warnings.catch_warnings():  # a read-only mapping: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr).view(dtype).view(rows, width)  # [r, w]


# -- writing (rank 0) ------------------------------------------------------------------------------

Source = str | Path | torch.Tensor  # a table file, or fp32 rows [r, e]
Key = int | tuple[str, int]  # a layer's (cold) table, or (part, owner layer) of a table set


def _key(key: Key) -> tuple[str, int]:
    return key if isinstance(key, tuple) else ("cold", int(key))


def _name(part: str, layer_id: int) -> str:
    """The directory key of a table: its file name's stem ("3", "3.hot")."""
    return f"{int(layer_id)}{SUFFIX[part]}"


def _parse(name: str) -> tuple[str, int]:
    lid, _, part = name.partition(".")
    return part or "cold", int(lid)


def _source(src: Source, layer_id: int, config: EngramConfig | None,
            profile: dict | None) -> tuple[dict, Callable[[str, int, int], bytes]]:
    """(table header as a dict, read(part, start, n) -> bytes of 'data' or 'scales')."""
    if isinstance(src, torch.Tensor):
        if src.dim() != 2:
            raise ValueError(f"rows must be [num_rows, dim], got {tuple(src.shape)}")
        raw = src.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy()
        head = TableHeader(layer_id=layer_id, num_rows=src.shape[0], dim=src.shape[1],
                           dtype="fp32", scale_block=None, data_offset=0, scale_offset=None,
                           file_size=raw.nbytes, chunk_rows=src.shape[0], chunks=[],
                           engram_config=config.to_dict() if config else {},
                           hash_profile=profile)
        return asdict(head), lambda part, a, n: raw.reshape(-1)[a:a + n].tobytes()
    path = Path(src)
    head = tablefile.read_header(path)
    if head.layer_id != layer_id:
        raise TableFileError(f"{path} holds layer {head.layer_id}, not {layer_id}")

    def read(part: str, a: int, n: int) -> bytes:
        base = head.data_offset if part == "data" else head.scale_offset
        with open(path, "rb") as f:
            f.seek(base + a)
            return f.read(n)
    return asdict(head), read


def write_pool(path: str | Path, sources: dict[Key, Source], *, config: EngramConfig | None = None,
               hasher: Hasher | None = None, chunk_bytes: int = 8 << 20,
               on_chunk: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Fill the region at ``path`` with every table (rank 0 only); -> the directory.

    ``sources`` maps a layer (its cold table) or ``(part, owner layer)`` to a table file or rows.

    Marks the pool as being written first (odd sequence number, flushed), copies the rows, flushes
    them, writes the directory and only then the even sequence number: a reader never sees a
    complete-looking pool with rows missing. A regular file is created or resized; a device must
    be large enough. ``on_chunk(bytes done, bytes in all)`` is called after each copied chunk.
    """
    path = Path(path)
    entries, readers, off, version = {}, {}, ALIGN, 1
    sources = {_key(k): src for k, src in sources.items()}
    for part, lid in sorted(sources):
        prof = hasher.profile(lid, part) if hasher is not None else None
        head, read = _source(sources[(part, lid)], lid, config, prof)
        th = TableHeader(**head)
        e = {"header": head, "data_offset": off, "data_bytes": th.num_rows * th.row_bytes,
             "scale_offset": None, "scale_bytes": th.num_rows * th.scale_row_bytes}
        version = max(version, th.version)
        off = _up(off + e["data_bytes"], ALIGN)
        if e["scale_bytes"]:
            e["scale_offset"], off = off, _up(off + e["scale_bytes"], ALIGN)
        entries[_name(part, lid)], readers[_name(part, lid)] = e, read
    total = off
    is_dev = path.exists() and stat.S_ISCHR(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDWR | (0 if is_dev else os.O_CREAT), 0o644)
    try:
        if is_dev:
            if region_size(path) < total:
                raise PoolError(f"{path}: {region_size(path)} bytes, the tables need {total}")
        elif os.fstat(fd).st_size != total:
            os.ftruncate(fd, total)
        mm = _map(fd, total, write=True)
        seq = np.frombuffer(mm, dtype=np.uint64, count=1, offset=_SEQ)
        try:
            magic = bytes(mm[:8])
            old = int(seq[0]) if magic == MAGIC else 0
            writing = old + 1 if old % 2 == 0 else old + 2  # odd: being written
            mm[:_HEAD.size] = _HEAD.pack(MAGIC, version, 0, writing, total, 0, 0, 0)
            mm.flush(0, ALIGN)  # readers see "being written" before any row changes
            done, n_bytes = 0, sum(e["data_bytes"] + e["scale_bytes"] for e in entries.values())
            for key, e in entries.items():
                crc = 0
                for part in ("data", "scales"):
                    size = e["data_bytes" if part == "data" else "scale_bytes"]
                    base = e["data_offset" if part == "data" else "scale_offset"]
                    for a in range(0, size, chunk_bytes):
                        buf = readers[key](part, a, min(chunk_bytes, size - a))
                        mm[base + a:base + a + len(buf)] = buf
                        crc = zlib.crc32(buf, crc)
                        done += len(buf)
                        if on_chunk is not None:
                            on_chunk(done, n_bytes)
                e["crc32"] = f"{crc:08x}"
            mm.flush()  # rows durable/visible before the pool says it is complete
            body = json.dumps({"align": ALIGN, "layers": entries}, sort_keys=True).encode()
            if _HEAD.size + len(body) > ALIGN:
                raise PoolError(f"{path}: directory of {len(body)} bytes does not fit the header")
            mm[_HEAD.size:_HEAD.size + len(body)] = body
            mm[:_HEAD.size] = _HEAD.pack(MAGIC, version, 0, writing, total, 0, len(body),
                                         zlib.crc32(body))
            mm.flush(0, ALIGN)
            seq[0] = writing + 1  # even: complete; one aligned 8-byte store
            mm.flush(0, ALIGN)
        finally:
            del seq  # the view pins the mapping
            mm.close()
    finally:
        os.close(fd)
    return {"path": str(path), "size": total, "generation": (writing + 1) // 2,
            "layers": {k: {kk: v for kk, v in e.items() if kk != "header"}
                       for k, e in entries.items()}}


# -- reading (every rank) --------------------------------------------------------------------------

class PoolRegion:
    """A pool mapped read-only; ``store(layer)`` gives each layer's ``PoolTable``, ``parts``
    every table by (part, owner layer).

    Refuses a pool being written; with ``wait_s`` it waits up to that long for rank 0 to finish
    (the region may not even exist yet). ``verify`` checks every table's crc32 on open; ``expect``
    = (config, hasher or None) refuses tables exported for another config or hashing.
    """

    def __init__(self, path: str | Path, *, wait_s: float = 0.0, verify: bool = True,
                 expect: tuple[EngramConfig, Hasher | None] | None = None,
                 out_dtype: torch.dtype = torch.float32):
        self.path = Path(path)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._open()
                break
            except (PoolNotReady, FileNotFoundError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        self.parts: dict[tuple[str, int], PoolTable] = {}
        for key, e in self.directory["layers"].items():
            head, (part, lid) = TableHeader(**e["header"]), _parse(key)
            if expect is not None:
                check_compatible(head, expect[0], lid, expect[1], part,
                                 name=f"{self.path} layer {key}")
            if verify:
                self._verify(key, e)
            self.parts[(part, lid)] = PoolTable(self, head, e, out_dtype)
        self.tables = {lid: t for (part, lid), t in self.parts.items() if part == "cold"}
        self.check(self.seq)  # a rewrite during the open is refused too

    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = region_size(self.path)
            if size < ALIGN:
                raise (PoolNotReady if size == 0 else PoolError)(
                    f"{self.path}: {size} bytes, not a pool (yet)")
            head = _map(fd, ALIGN, write=False)
            magic, version, _, seq, total, _, dlen, dcrc = _HEAD.unpack(head[:_HEAD.size])
            if magic != MAGIC:
                head.close()
                raise (PoolNotReady if magic == bytes(8) else PoolError)(
                    f"{self.path}: not an Engram pool (magic {magic!r})")
            if not 1 <= version <= VERSION:
                head.close()
                raise PoolError(f"{self.path}: pool version {version}, this engram reads 1 to "
                                f"{VERSION} (a newer engram wrote it: upgrade, or rewrite the "
                                "pool)")
            if seq % 2:
                head.close()
                raise PoolNotReady(f"{self.path}: rank 0 is still writing this pool "
                                   f"(generation {(seq + 1) // 2}); refusing half-written tables")
            body = bytes(head[_HEAD.size:_HEAD.size + dlen])
            if struct.unpack_from("<Q", head, _SEQ)[0] != seq:
                head.close()
                raise PoolNotReady(f"{self.path}: a rewrite began while opening")
            if zlib.crc32(body) != dcrc or total > size:
                head.close()
                raise PoolError(f"{self.path}: damaged pool header (directory crc or size)")
            self.directory, self.size = json.loads(body), total
            self._head = head
            self._seq = np.frombuffer(head, dtype=np.uint64, count=1, offset=_SEQ)
            self.seq = seq
            self._mm = _map(fd, total, write=False)
        finally:
            os.close(fd)  # the mappings keep the region

    def check(self, seq: int) -> None:
        """Raise unless the pool is still the complete version ``seq`` this reader opened."""
        now = int(self._seq[0])
        if now != seq:
            raise PoolChanged(f"{self.path}: rewritten while reading (sequence {seq} -> {now}); "
                              "reopen the pool")

    def _verify(self, key: str, e: dict) -> None:
        crc = zlib.crc32(self._mm[e["data_offset"]:e["data_offset"] + e["data_bytes"]])
        if e["scale_bytes"]:
            crc = zlib.crc32(self._mm[e["scale_offset"]:e["scale_offset"] + e["scale_bytes"]], crc)
        if f"{crc:08x}" != e["crc32"]:
            raise PoolError(f"{self.path}: layer {key} fails its checksum; rewrite the pool")

    def store(self, layer_id: int) -> PoolTable:
        return self.tables[layer_id]

    @property
    def nbytes(self) -> int:
        return self.size

    def close(self) -> None:
        self.parts.clear()
        self.tables.clear()


class PoolTable:
    """One layer's rows inside a ``PoolRegion`` (a TableStore); rows come back as copies."""

    def __init__(self, region: PoolRegion, header: TableHeader, entry: dict,
                 out_dtype: torch.dtype):
        self.region, self.header, self.out_dtype = region, header, out_dtype
        self.num_rows, self.dim = header.num_rows, header.dim
        dtype = DTYPES[header.dtype][0]
        self.data = _view(region._mm, dtype, entry["data_offset"], self.num_rows,
                          header.data_width)  # [r, e], or int8 / int4 blocks' bytes [r, rb]
        self.scales = (None if not entry["scale_bytes"] else
                       _view(region._mm, SCALE_FORMATS[header.scale_format][0],
                             entry["scale_offset"], self.num_rows, header.scale_width))
        self.rows = StoredRows(self.data, self.scales, header.blocks)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        flat = check_rows(rows, self.num_rows, bounds=False)  # [n]; the read checks them
        seq = self.region.seq
        self.region.check(seq)
        out = self.rows.gather(flat, self.out_dtype)  # [n, e], gathered + dequantised at once
        self.region.check(seq)  # seqlock: no row of this copy may come from a rewrite
        return out if rows.dim() == 1 else out.view(*rows.shape, self.dim)

    def stored_format(self) -> tuple[torch.dtype, int, tuple[str, int] | None] | None:
        """tables.store.StoredReads: how a cache in front of the pool may hold its rows."""
        if self.scales is not None or self.data.dtype == self.out_dtype:
            return None
        return self.data.dtype, self.data.shape[1], self.header.blocks

    def gather_stored(self, rows: torch.Tensor) -> torch.Tensor:
        """tables.store.StoredReads: rows [n] as the pool stores them [n, w], copied out."""
        flat = check_rows(rows, self.num_rows)
        seq = self.region.seq
        self.region.check(seq)
        out = self.data.index_select(0, flat)
        self.region.check(seq)  # seqlock, as lookup
        return out

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # a mapping needs no warm-up; PrefetchTable reads it in the background

    def __repr__(self) -> str:
        return (f"PoolTable({str(self.region.path)!r}, layer={self.header.layer_id}, "
                f"rows={self.num_rows}, dim={self.dim}, dtype={self.header.dtype})")


def load_pool(path: str | Path, table_dir: str | Path, config: EngramConfig,
              hasher: Hasher | None = None, *, rank: int = 0, wait_s: float = 600.0,
              verify: bool = False) -> PoolRegion:
    """The paper's SGLang start-up: rank 0 loads the exported tables (every part of every table
    set of ``hasher``; each Engram layer's table without one) into the pool, unless it already
    holds these versions; every rank then maps it read-only."""
    owners = config.layer_ids if hasher is None else hasher.owners
    parts = ("cold",) if hasher is None else hasher.parts
    files = {(part, lid): tablefile.table_path(table_dir, lid, part)
             for lid in owners for part in parts}
    if rank == 0:
        try:
            current = PoolRegion(path, verify=False)
            tags = {k: e["header"]["tag"] for k, e in current.directory["layers"].items()}
            stale = tags != {_name(*k): tablefile.read_header(p).tag for k, p in files.items()}
            current.close()
        except (PoolError, FileNotFoundError):
            stale = True
        if stale:
            write_pool(path, files)
    return PoolRegion(path, wait_s=wait_s, verify=verify, expect=(config, hasher))
