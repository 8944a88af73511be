"""Table tiers beyond memory: a memory-mapped table file and a shared pool (host memory and pinned
memory: tables/host.py).

Each implements the ``engram.tables.store.TableStore`` protocol and is tested row for row against
``engram.tables.store.MemoryTable``. Paper section 2.5 and spec section 4: row ids are known before
the forward pass, so the table need not sit next to the compute; it can be a file on NVMe served
through the page cache (``FileTable``), host memory copied to the device on demand
(``PinnedTable``), or one read-only mapping shared by every server process
(``SharedPool``). Put ``engram.tables.cache.CachedTable`` and
``engram.tables.prefetch.PrefetchTable`` in front of any of them.

Shape legend: r rows, e row width, n rows asked for, ... any leading shape of row ids,
nb fp8 scale blocks per row.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher
from .fp8 import StoredRows, check_range
from .tablefile import (
    DTYPES,
    SCALE_FORMATS,
    TableFileError,
    TableHeader,
    check_compatible,
    read_header,
    table_path,
    verify,
)

ADVICE = {"random": mmap.MADV_RANDOM, "normal": mmap.MADV_NORMAL, "willneed": mmap.MADV_WILLNEED}


def check_rows(rows: torch.Tensor, num_rows: int, bounds: bool = True) -> torch.Tensor:
    """Flat int64 CPU row ids [n], with a clear error for ids the table does not have
    (``bounds=False``: left to the read, fp8.StoredRows.gather, which checks them as it reads:
    at a decode step the separate numpy pass cost ~5 us of a ~50 us read)."""
    flat = rows
    if rows.dtype != torch.long or rows.dim() != 1 or rows.device.type != "cpu":
        if rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise TypeError(f"row ids must be an integer tensor, got {rows.dtype}")
        flat = rows.reshape(-1).to("cpu", torch.long)
    if bounds:
        check_range(flat.numpy(), num_rows)
    return flat


class _Region:
    """Rows [r, w] of one dtype at a file offset, mapped read-only, whole or in windows; ``blocks``:
    how an int8 / int4 row's bytes read (TableHeader.blocks).

    Windows keep the address space bounded (a process under a RAM budget can still serve a table
    larger than the budget); ``window_rows=None`` maps the whole region once.
    """

    def __init__(self, fd: int, offset: int, rows: int, width: int, dtype: torch.dtype,
                 itemsize: int, window_rows: int | None, max_windows: int, advice: str,
                 blocks: tuple[str, int] | None = None):
        # Its own descriptor: a lookup still holding this region after a refresh() maps windows of
        # the version it started with, never of whatever file reuses the old descriptor number.
        self.fd = os.dup(fd)
        self.offset, self.rows, self.width = offset, rows, width
        self.dtype, self.row_bytes, self.blocks = dtype, width * itemsize, blocks
        self.window_rows = rows if window_rows is None else max(1, min(rows, window_rows))
        self.max_windows, self.advice = max(1, max_windows), ADVICE[advice]
        self.windows: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.lock = threading.Lock()

    def _map(self, w: int) -> torch.Tensor:
        a = w * self.window_rows
        n = min(self.rows, a + self.window_rows) - a
        start = self.offset + a * self.row_bytes
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(self.fd, start - base + n * self.row_bytes, access=mmap.ACCESS_READ,
                       offset=base)  # MAP_SHARED, PROT_READ: page-cache pages, never copied
        mm.madvise(self.advice)  # random: no readahead of neighbours a hashed row never needs
        arr = np.frombuffer(mm, dtype=np.uint8, count=n * self.row_bytes, offset=start - base)
        with warnings.catch_warnings():  # read-only memory: nothing here ever writes to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        return t.view(self.dtype).view(n, self.width)  # [rows in window, w]

    def window(self, w: int) -> torch.Tensor:
        with self.lock:
            t = self.windows.get(w)
            if t is None:
                t = self.windows[w] = self._map(w)
                while len(self.windows) > self.max_windows:
                    self.windows.popitem(last=False)  # dropping the last reference unmaps it
            else:
                self.windows.move_to_end(w)
            return t

    def gather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = row flat[i]; flat [n] int64 in range, out [n, w] of this dtype."""
        if self.window_rows >= self.rows:
            torch.index_select(self.window(0), 0, flat, out=out)
            return
        wid = flat // self.window_rows
        for w in torch.unique(wid).tolist():
            sel = (wid == w).nonzero().squeeze(1)
            out[sel] = self.window(w).index_select(0, flat[sel] - w * self.window_rows)

    def close(self) -> None:
        """Unmap every window (the next gather maps again)."""
        with self.lock:
            self.windows.clear()

    def __del__(self):
        try:
            os.close(self.fd)
        except (AttributeError, OSError):
            pass


class FileTable:
    """A table file mapped read-only: the NVMe tier, served through the OS page cache.

    Opens the file once and reads header and rows through that one descriptor, so a publish that
    renames a new version over the path during the open yields the old version or the new one
    whole. ``refresh()`` switches to a newer published version. Rows come back as ``out_dtype``
    (fp8, int8 and int4 rows are dequantised with their block scales).

    Its arguments:

    - ``verify``: check every chunk's crc32 on open (reads the whole file once).
    - ``expect``: ``(config, layer_id, hasher or None[, part])`` the file must match
      (``tablefile.check_compatible``; part "hot" for an Engram-Nine hot rows file).
    - ``window_bytes``: map windows of this many bytes, at most ``max_windows`` at a time (None: the
      whole file at once); bounds the address space, e.g. under RLIMIT_AS.
    - ``io_threads``: split large gathers over this many threads, so the page faults of a cold
      file are in flight together (queue depth) instead of one after another.
    """

    def __init__(self, path: str | Path, *, out_dtype: torch.dtype = torch.float32,
                 verify: bool = True,
                 expect: tuple[EngramConfig, int, Hasher | None] | tuple | None = None,
                 window_bytes: int | None = None, max_windows: int = 4, io_threads: int = 1,
                 advice: str = "random", min_split_rows: int = 4096):
        self.path = Path(path)
        self.out_dtype, self.expect, self.advice = out_dtype, expect, advice
        self.window_bytes, self.max_windows = window_bytes, max_windows
        self.min_split_rows = min_split_rows
        self.verify_on_open = verify
        self.io_threads = max(1, int(io_threads))
        self._pool = ThreadPoolExecutor(self.io_threads) if self.io_threads > 1 else None
        self._lock = threading.Lock()
        self._fd = -1
        self._open()

    # -- opening ---------------------------------------------------------------------------------
    def _open(self) -> None:
        self._commit(*self._load())

    def _load(self) -> tuple[int, TableHeader, tuple[_Region, _Region | None]]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"no table file at {self.path} (export one with "
                                    "engram.artifacts.table_files.export_tables)") from None
        try:
            header = read_header(fd, str(self.path))
            if self.expect is not None:
                check_compatible(header, *self.expect, name=str(self.path))
            if self.verify_on_open:
                verify(fd, header, name=str(self.path))
            return fd, header, self._regions(fd, header)
        except BaseException:
            os.close(fd)
            raise

    def _commit(self, fd: int, header: TableHeader, regions: tuple) -> None:
        old = self._fd
        with self._lock:
            self.header, self._fd, self._ino = header, fd, os.fstat(fd).st_ino
            self._data, self._scales = regions
            self._rows = None  # StoredRows of the whole mapping, made on the first read
            self.num_rows, self.dim = header.num_rows, header.dim
        if old >= 0:
            os.close(old)

    def _regions(self, fd: int, h: TableHeader) -> tuple[_Region, _Region | None]:
        dtype, esize = DTYPES[h.dtype]
        wrows = None if self.window_bytes is None else max(1, self.window_bytes // h.row_bytes)
        data = _Region(fd, h.data_offset, h.num_rows, h.data_width, dtype, esize, wrows,
                       self.max_windows, self.advice, h.blocks)
        scales = None
        if h.scale_width:  # windows over the same rows, so one window id covers both
            scales = _Region(fd, h.scale_offset, h.num_rows, h.scale_width,
                             *SCALE_FORMATS[h.scale_format], wrows, self.max_windows, self.advice)
        return data, scales

    def refresh(self) -> bool:
        """Switch to the file now at ``path`` if a new version was published; True if switched."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            return False
        if ino == self._ino:
            return False
        fd, header, regions = self._load()
        if (header.num_rows, header.dim) != (self.num_rows, self.dim):
            os.close(fd)
            raise TableFileError(f"{self.path}: the new version is {header.num_rows} x "
                                 f"{header.dim}, the old one {self.num_rows} x {self.dim}")
        self._commit(fd, header, regions)
        return True

    def evict(self) -> None:
        """A cold start (for benchmarks): unmap, and ask the kernel to drop the file's cached pages
        (POSIX_FADV_DONTNEED). Pages another table or process still maps stay resident; the next
        lookup maps the file again."""
        with self._lock:
            self._rows = None  # it holds the mapping too
            for r in (self._data, self._scales):
                if r is not None:
                    r.close()
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Unmap and close (lookups return copies, so no tensor keeps the mapping alive)."""
        with self._lock:
            self._rows = None
            for r in (self._data, self._scales):
                if r is not None:
                    r.close()
            self._data = self._scales = None  # their descriptors close with them
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __del__(self):
        try:
            if self._fd >= 0:
                os.close(self._fd)
        except (AttributeError, OSError):
            pass

    # -- the store protocol ----------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.header.dtype

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        with self._lock:
            data, scales = self._data, self._scales
        if data is None:
            raise RuntimeError(f"{self.path} was closed")
        # one read of the whole mapping checks its ids itself; windows and split reads need them
        # checked first (their reads see slices)
        one = data.window_rows >= data.rows
        flat = check_rows(rows, self.num_rows,
                          bounds=not one or (self._pool is not None
                                               and rows.numel() >= self.min_split_rows))  # [n]
        out = torch.empty(flat.numel(), self.dim, dtype=self.out_dtype)  # [n, e]
        if one:  # one mapping: gathered and dequantised in one pass
            whole = self._whole(data, scales)
            self._split(lambda f, o: whole.gather(f, out=o), flat, out)
        else:  # windows: the stored rows copied out window by window, then widened
            StoredRows(*self._stored(data, scales, flat), data.blocks).gather(None, out=out)
        return out if rows.dim() == 1 else out.view(*rows.shape, self.dim)

    def _whole(self, data: _Region, scales: _Region | None) -> StoredRows:
        """The whole mapping's rows, made once per mapping (evict and close drop it)."""
        d = data.window(0)
        with self._lock:
            rows = self._rows
            if rows is None or rows.data is not d:
                rows = self._rows = StoredRows(d, None if scales is None else scales.window(0),
                                               data.blocks)
        return rows

    def stored(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows a..b as the file stores them: values [b-a, e] in the stored dtype (int8 / int4:
        their blocks' bytes [b-a, rb]), and fp8's block scales [b-a, nb] (fp32 or E8M0 bytes;
        None for other dtypes), copied out."""
        with self._lock:
            data, scales = self._data, self._scales
        if data is None:
            raise RuntimeError(f"{self.path} was closed")
        return self._stored(data, scales, torch.arange(a, b))

    def stored_format(self) -> tuple[torch.dtype, int, tuple[str, int] | None] | None:
        """tables.store.StoredReads: how a cache in front of this file may hold its rows."""
        with self._lock:
            data, scales = self._data, self._scales
        if data is None or scales is not None or data.dtype == self.out_dtype:
            return None
        return data.dtype, data.width, data.blocks

    def gather_stored(self, rows: torch.Tensor) -> torch.Tensor:
        """tables.store.StoredReads: rows [n] as the file stores them [n, w], copied out."""
        with self._lock:
            data, scales = self._data, self._scales
        if data is None:
            raise RuntimeError(f"{self.path} was closed")
        return self._stored(data, scales, check_rows(rows, self.num_rows))[0]

    def _stored(self, data: _Region, scales: _Region | None,
                flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raw = torch.empty(flat.numel(), data.width, dtype=data.dtype)  # [n, e] or [n, rb]
        self._split(data.gather, flat, raw)
        sc = None
        if scales is not None:  # [n, nb] fp32 or E8M0 bytes
            sc = torch.empty(flat.numel(), scales.width, dtype=scales.dtype)
            self._split(scales.gather, flat, sc)
        return raw, sc

    def _split(self, read: Any, flat: torch.Tensor, out: torch.Tensor) -> None:
        """read(flat, out), over io_threads threads for a large read (each on its own slice)."""
        n = flat.numel()
        if self._pool is None or n < self.min_split_rows:
            read(flat, out)
            return
        step = -(-n // self.io_threads)
        jobs = [self._pool.submit(read, flat[a:a + step], out[a:a + step])
                for a in range(0, n, step)]
        for j in jobs:
            j.result()

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # PrefetchTable gathers in the background; the mapping itself needs no warm-up

    def __repr__(self) -> str:
        return (f"FileTable({str(self.path)!r}, rows={self.num_rows}, dim={self.dim}, "
                f"dtype={self.dtype}, tag={self.header.tag!r})")


def open_tables(directory: str | Path, config: EngramConfig, hasher: Hasher | None = None,
                part: str = "cold", **kwargs: Any) -> dict[int, FileTable]:
    """``{owner layer: FileTable}``: the ``part`` file of every table set (``hasher.owners``;
    every Engram layer of ``config`` without a hasher) in an exported folder, each checked against
    the hasher's stamp; empty when the sets have no such part (an empty Nine hot tier)."""
    owners = config.layer_ids if hasher is None else hasher.owners
    parts = ("cold",) if hasher is None else hasher.parts
    out = {}
    for lid in owners if part in parts else []:
        path = table_path(directory, lid, part)
        if not path.exists():
            raise FileNotFoundError(f"no {part} table file for Engram layer {lid} at {path} "
                                    "(export with engram.artifacts.table_files.export_tables)")
        out[lid] = FileTable(path, expect=(config, lid, hasher, part), **kwargs)
    return out


def open_parts(directory: str | Path, config: EngramConfig, hasher: Hasher | None = None,
               **kwargs: Any) -> dict[tuple[str, int], FileTable]:
    """``{(part, owner layer): FileTable}``: every table file of a run (open_tables per part)."""
    parts = ("cold",) if hasher is None else hasher.parts
    return {(part, lid): t for part in parts
            for lid, t in open_tables(directory, config, hasher, part, **kwargs).items()}


class SharedPool:
    """One read-only mapping of each table file, shared by every process that opens it.

    Spec section 5 (pooled memory): the paper maps a CXL device; on one host the same pattern is a
    MAP_SHARED read-only mapping, whose pages live once in the page cache (or in tmpfs, e.g.
    /dev/shm, for a RAM-only pool) however many server processes map them. A second process adds
    page-table entries, not a copy: its private memory does not grow with the table.
    """

    def __init__(self, directory: str | Path, config: EngramConfig,
                 hasher: Hasher | None = None, *, verify: bool = False, **kwargs: Any):
        self.directory = Path(directory)
        # {(part, owner layer): table}: every part of every table set, mapped the same way
        self.parts = open_parts(directory, config, hasher, verify=verify, **kwargs)
        self.tables = {lid: t for (part, lid), t in self.parts.items() if part == "cold"}

    def store(self, layer_id: int) -> FileTable:
        return self.tables[layer_id]

    def warm(self) -> None:
        """Ask the kernel to read every table into the page cache (asynchronously)."""
        for t in self.parts.values():
            os.posix_fadvise(t._fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for t in self.parts.values():
            t.close()

    @property
    def nbytes(self) -> int:
        return sum(t.header.file_size for t in self.parts.values())


def memory_status() -> dict[str, int]:
    """This process's memory in bytes: VmRSS, RssAnon, RssFile, RssShmem (/proc/self/status) and
    Pss, Private_*, Shared_* (/proc/self/smaps_rollup); Linux only."""
    out: dict[str, int] = {}
    for fname in ("/proc/self/status", "/proc/self/smaps_rollup"):
        try:
            with open(fname) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[2] == "kB":
                        out[parts[0].rstrip(":")] = int(parts[1]) * 1024
        except OSError:
            pass
    return out
