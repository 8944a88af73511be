"""The files of a run trained from a file tier: each Engram table's rows and its row optimiser's
state, read and written by row ids (positional I/O, no mapping), and an undo journal that
keeps them consistent with the run's checkpoints.

Row ids depend on token ids alone (paper section 2.5), so a step's rows are read before it runs and
written back after; only those rows are in memory (training/tier_tables.py). The folder:

    tier.json                 what is here: format, run id, the run's out_dir, per layer r x e,
                              the table optimiser and its per-row state layout (written last)
    layer{L}.rows             rows [r, e] float32
    layer{L}.{key}            the optimiser's state per row (RowAdam: moments [r, 2, e], steps [r])
    journal                   the undo journal since checkpoint c (below)

Consistency without copying the tables at each checkpoint (SQLite's rollback journal): before a
row is first overwritten after checkpoint c, its old bytes (row and state) are appended to the
journal, checksummed, and the journal is fsynced before the table write. A checkpoint fsyncs the
tables, writes the dense checkpoint (train.FileCheckpoints), then empties the journal and marks it
as of the new step. On resume the journal is played back (idempotent; a torn last entry is
dropped: its table write had not begun), so the tables equal checkpoint c's exactly.

Shape legend: r rows of a table, e row width, k rows of one journal entry.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..files import disk_errors, publish_text

FORMAT = "engram-train-tier"
META, JOURNAL = "tier.json", "journal"
_HEAD = struct.Struct("<8sq16s")  # magic, the checkpoint step it undoes to, run id
_ENTRY = struct.Struct("<IIQI")  # layer, rows k, payload bytes, crc32 of the payload
_MAGIC = b"ENGRAMJ1"
_DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32}


class TierError(UserError):
    """A tier folder that is not this run's, is damaged, or cannot be written."""


def rank_folder(rank: int, world: int) -> str:
    """A torchrun rank's tier folder, under the run's (training/tier_shards.py)."""
    return f"rank-{rank:05d}-of-{world:05d}"


def _np(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


class TierFiles:
    """One run's tier folder, read and written by row ids with positional reads and writes
    (os.preadv / os.pwritev on its files' descriptors), never mapped: only the rows asked for are
    ever in this process's memory, and the tables take no address space (a process capped by
    RLIMIT_AS trains tables larger than its cap). Writes land in the page cache (a killed process
    leaves them); ``sync`` makes them durable. Not thread-safe for one layer's file at once
    (the tier's one worker thread and the training thread take turns: tier_tables.py)."""

    def __init__(self, folder: Path, meta: dict[str, Any], writable: bool = True):
        self.folder, self.meta = Path(folder), meta
        self.shapes: dict[int, tuple[int, int]] = {}
        self._fds: dict[int, dict[str, tuple[int, tuple[int, ...], np.dtype]]] = {}
        for lid, (r, e) in ((int(k), v) for k, v in meta["layers"].items()):
            self.shapes[lid], self._fds[lid] = (r, e), {}
            for name, (tail, dtype) in self.layout(e).items():
                fd = os.open(self.folder / f"layer{lid}.{name}",
                             os.O_RDWR if writable else os.O_RDONLY)
                self._fds[lid][name] = (fd, tuple(tail), _np(_DTYPES[dtype]))

    def layout(self, e: int) -> dict[str, tuple[list[int], str]]:
        """name -> (per-row shape, dtype name): the rows, then the optimiser's state."""
        return {"rows": ([e], "float32"), **{k: (list(t), d) for k, (t, d) in
                                               self.meta["state"].items()}}

    @property
    def run_id(self) -> str:
        return self.meta["run"]

    def names(self, lid: int) -> list[str]:
        """The layer's arrays, in layout order ("rows" first)."""
        return list(self._fds[lid])

    def row_bytes(self, lid: int) -> int:
        """Bytes of one row and its state."""
        return sum(_nbytes(tail, dt) for _, tail, dt in self._fds[lid].values())

    def empty(self, lid: int, name: str, n: int) -> torch.Tensor:
        """A tensor for ``n`` rows of array ``name`` (uninitialised)."""
        _, tail, dt = self._fds[lid][name]
        return torch.from_numpy(np.empty((n, *tail), dtype=dt))

    def read(self, lid: int, ids: torch.Tensor, out: dict[str, torch.Tensor] | None = None,
             names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows ``ids`` [u] (sorted, distinct) of layer ``lid``'s arrays (``names``, default all):
        name -> [u, ...] (into ``out``'s contiguous tensors where given)."""
        out = dict(out or {})
        u = ids.numpy()
        for name in names or self.names(lid):
            fd, tail, dt = self._fds[lid][name]
            if name not in out:
                out[name] = self.empty(lid, name, u.size)
            _rows_io(fd, u, out[name].numpy().view(np.uint8).reshape(u.size, -1),
                     _nbytes(tail, dt), write=False)
        return out

    def write(self, lid: int, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """``values`` (name -> [u, ...]) to rows ``ids`` [u] (sorted, distinct) of layer ``lid``."""
        u = ids.numpy()
        with disk_errors(self.folder):
            for name, v in values.items():
                fd, tail, dt = self._fds[lid][name]
                a = v.detach().contiguous().numpy()
                if a.dtype != dt:
                    raise TypeError(f"{name}: {a.dtype}, the file holds {dt}")
                _rows_io(fd, u, a.view(np.uint8).reshape(u.size, -1), _nbytes(tail, dt),
                         write=True)

    def read_all(self, lid: int, name: str) -> torch.Tensor:
        """A whole array [r, ...] in memory (tests, a server's copy of the rows)."""
        fd, tail, dt = self._fds[lid][name]
        out = np.empty((self.shapes[lid][0], *tail), dtype=dt)
        _pread_all(fd, out.view(np.uint8).reshape(-1), 0)
        return torch.from_numpy(out)

    def max_of(self, lid: int, name: str, chunk: int = 1 << 20) -> int:
        """The largest value of an array (read a chunk at a time); 0 for an empty one."""
        fd, tail, dt = self._fds[lid][name]
        r, best = self.shapes[lid][0], 0
        buf = np.empty((min(chunk, max(r, 1)), *tail), dtype=dt)
        for a in range(0, r, chunk):
            part = buf[:min(chunk, r - a)]
            _pread_all(fd, part.view(np.uint8).reshape(-1), a * _nbytes(tail, dt))
            best = max(best, int(part.max()))
        return best

    def sync(self) -> None:
        """Every table write so far on disk (before a checkpoint names this state)."""
        with disk_errors(self.folder):
            for arrays in self._fds.values():
                for fd, _, _ in arrays.values():
                    os.fsync(fd)

    def close(self) -> None:
        fds, self._fds = getattr(self, "_fds", {}), {}
        for arrays in fds.values():
            for fd, _, _ in arrays.values():
                os.close(fd)

    __del__ = close

    @staticmethod
    def create(folder: Path, out_dir: Path, layers: dict[int, tuple[int, int]],
               rows: dict[int, Any], state: dict[str, tuple[list[int], str]],
               optimizer: str, shard: list[int] | None = None) -> TierFiles:
        """A fresh folder: layer ``lid``'s table [r, e] = ``layers[lid]`` with initial rows the
        chunks [k, e] of ``rows[lid]`` in row order (never the whole table at once) and zero
        state; every file's blocks are allocated now, so a full disk is one line here, not a
        failed write at a later step. ``shard``: [rank, world] of a torchrun rank's folder (its
        rows are that rank's shard of each table)."""
        meta = {"format": FORMAT, "run": uuid.uuid4().hex, "out_dir": str(out_dir.resolve()),
                "optimizer": optimizer, "state": state,
                "layers": {str(lid): [int(r), int(e)] for lid, (r, e) in layers.items()},
                **({"shard": shard} if shard is not None else {})}
        (folder / META).unlink(missing_ok=True)  # files below are not a complete folder until
        for lid, (r, e) in layers.items():  # tier.json is published again
            for name, (tail, dtype) in {"rows": ([e], "float32"), **state}.items():
                path = folder / f"layer{lid}.{name}"
                nbytes = r * int(np.prod(tail, dtype=np.int64)) * _DTYPES[dtype].itemsize
                with disk_errors(path, nbytes):
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        os.posix_fallocate(fd, 0, max(nbytes, 1))
                        if name == "rows":
                            at = 0
                            for chunk in rows[lid]:
                                a = chunk.detach().float().contiguous().numpy()
                                _pwrite_all(fd, a.view(np.uint8).reshape(-1), at)
                                at += a.nbytes
                            if at != nbytes:
                                raise ValueError(f"layer {lid}: {at} bytes of rows, not {nbytes}")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        Journal.create(folder / JOURNAL, 0, meta["run"])
        publish_text(folder / META, json.dumps(meta, indent=1))
        return TierFiles(folder, meta)

    @staticmethod
    def open(folder: Path, writable: bool = True) -> TierFiles:
        try:
            meta = json.loads((folder / META).read_text())
        except FileNotFoundError:
            raise TierError(f"{folder} holds no tier tables ({META} is missing): the run's "
                            "tables are elsewhere (--table_dir) or were never written") from None
        except (OSError, ValueError) as e:
            raise TierError(f"{folder / META} cannot be read: {e}") from None
        if meta.get("format") != FORMAT:
            raise TierError(f"{folder} is not a tier folder of engram train ({META} says "
                            f"{meta.get('format')!r})")
        for lid, (r, e) in meta["layers"].items():
            for name, (tail, dtype) in {"rows": ([e], "float32"), **meta["state"]}.items():
                path, want = folder / f"layer{lid}.{name}", r * int(np.prod(tail)) * \
                    _DTYPES[dtype].itemsize
                size = path.stat().st_size if path.exists() else -1
                if size != want:
                    raise TierError(f"{path} is {size} bytes, {META} says {want}: the folder "
                                    "is damaged or was changed by hand")
        return TierFiles(folder, meta, writable)


# Rows of one call are read (or written) a span at a time: sorted ids whose gaps are at most
# GAP_BYTES of file share one span, read whole into a scratch buffer, and a span is at most
# SPAN_BYTES (the scratch). A positional read or write from Python costs ~2-4 us, copying ~16 KB
# from the page cache about as much: at compare's table (15k of 160k rows a step, 3 files) a
# step's reads and writes took 87 + 173 ms one call a row, 21 + 36 ms with 4 KB gaps spanned,
# 4.8 + 8.1 ms with 16 KB (as fast as the memory map before them: 5 + 13 ms).
GAP_BYTES = 16384
SPAN_BYTES = 1 << 20
_scratch = threading.local()


def _nbytes(tail, dt: np.dtype) -> int:
    return int(np.prod(tail, dtype=np.int64)) * np.dtype(dt).itemsize


def _buffer(n: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(max(n, SPAN_BYTES), dtype=np.uint8)
    return buf[:n]


def _rows_io(fd: int, u: np.ndarray, data: np.ndarray, rb: int, write: bool) -> None:
    """Rows ``u`` [k] (sorted, distinct) of a file of ``rb``-byte rows to or from ``data`` [k, rb]
    (uint8): one positional read or write per run of adjacent rows, or per span of near ones."""
    k = u.size
    if k == 0:
        return
    gap = np.diff(u) - 1  # rows skipped between neighbours
    brk = np.flatnonzero((gap * rb > GAP_BYTES)
                         | ((u[1:] - u[0]) // max(SPAN_BYTES // rb, 1)
                            != (u[:-1] - u[0]) // max(SPAN_BYTES // rb, 1))) + 1
    bounds = np.concatenate(([0], brk, [k])).tolist()
    whole = (u[np.asarray(bounds[1:]) - 1] - u[np.asarray(bounds[:-1])]
             == np.diff(bounds) - 1).tolist()  # the span's rows are adjacent: no gaps
    for i, j, full in zip(bounds[:-1], bounds[1:], whole):
        off = int(u[i]) * rb
        if full:  # straight to or from the caller's rows
            (_pwrite_all if write else _pread_all)(fd, data[i:j].reshape(-1), off)
            continue
        n = int(u[j - 1] - u[i] + 1)
        span = _buffer(n * rb).reshape(n, rb)
        _pread_all(fd, span.reshape(-1), off)
        if write:  # the rows between are written back as they are
            span[u[i:j] - u[i]] = data[i:j]
            _pwrite_all(fd, span.reshape(-1), off)
        else:
            np.take(span, u[i:j] - u[i], axis=0, out=data[i:j])


def _pread_all(fd: int, buf: np.ndarray, off: int) -> None:
    view = memoryview(buf)
    while view:
        got = os.preadv(fd, [view], off)
        if got <= 0:
            raise TierError(f"a tier file ended before byte {off + len(view)}: the folder is "
                            "damaged")
        view, off = view[got:], off + got


def _pwrite_all(fd: int, buf: np.ndarray, off: int) -> None:
    view = memoryview(buf)
    while view:
        got = os.pwritev(fd, [view], off)
        view, off = view[got:], off + got


class Journal:
    """The undo journal: a header naming the checkpoint step it undoes to, then entries (layer,
    rows [k] int64, then each array's old values [k, ...] in ``TierFiles.layout`` order)."""

    def __init__(self, path: Path, base: int, run: str):
        self.path, self.base, self.run = path, base, run
        self._f = open(path, "ab", buffering=0)

    @staticmethod
    def create(path: Path, base: int, run: str) -> None:
        with disk_errors(path), open(path, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, base, bytes.fromhex(run)))
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def open(path: Path, run: str) -> Journal:
        head = _read_head(path, run)
        return Journal(path, head, run)

    def append(self, entries: list[tuple[int, torch.Tensor, list[torch.Tensor]]]) -> None:
        """Old values before they are overwritten: durable before this returns."""
        if not entries:
            return
        with disk_errors(self.path):
            for lid, rows, old in entries:
                parts = [t.contiguous().numpy() for t in (rows, *old)]  # written as they are
                crc = 0
                for a in parts:
                    crc = zlib.crc32(a, crc)
                _write_all(self._f, _ENTRY.pack(lid, rows.numel(), sum(a.nbytes for a in parts),
                                                crc))
                for a in parts:
                    _write_all(self._f, a)
            self._f.flush()
            os.fsync(self._f.fileno())

    def reset(self, base: int) -> None:
        """Empty, undoing to checkpoint ``base`` (its tables are synced already)."""
        self._f.close()
        tmp = self.path.with_suffix(".new")
        Journal.create(tmp, base, self.run)
        os.replace(tmp, self.path)  # atomic: the old journal or the new one, never half of each
        self.base, self._f = base, open(self.path, "ab", buffering=0)

    def close(self) -> None:
        self._f.close()

    def entries(self, files: TierFiles):
        """Each complete entry as (layer, rows [k], old values); a torn last entry ends it."""
        return journal_entries(self.path, files)


def journal_entries(path: Path, files: TierFiles):
    """``Journal.entries`` of the journal at ``path``, read without opening it to write (a
    server's look at a run killed after its checkpoint)."""
    data = path.read_bytes()
    pos, n = _HEAD.size, len(data)
    while pos + _ENTRY.size <= n:
        lid, k, size, crc = _ENTRY.unpack_from(data, pos)
        body = data[pos + _ENTRY.size: pos + _ENTRY.size + size]
        if len(body) < size:
            return  # torn: killed while appending, before its table write
        if zlib.crc32(body) != crc or lid not in files.shapes:
            raise TierError(f"{path}: a damaged entry at byte {pos}; the tables cannot be "
                            "put back to the checkpoint (use another --out_dir)")
        pos += _ENTRY.size + size
        if k == 0:
            continue
        rows, out, off = torch.frombuffer(bytearray(body[:8 * k]), dtype=torch.int64), [], 8 * k
        for name in files.names(lid):
            t = files.empty(lid, name, k)
            nb = t.numel() * t.element_size()
            t.numpy().view(np.uint8).reshape(-1)[:] = np.frombuffer(body, np.uint8, nb, off)
            out.append(t)
            off += nb
        if off != size:
            raise TierError(f"{path}: an entry of another layout before byte {pos}")
        yield lid, rows, out


def _write_all(f, data) -> None:
    """All of ``data`` (a raw file may take less than asked at once)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def _read_head(path: Path, run: str) -> int:
    try:
        raw = path.read_bytes()[:_HEAD.size]
    except FileNotFoundError:
        raise TierError(f"{path} is missing: the tier folder is damaged") from None
    if len(raw) < _HEAD.size:
        raise TierError(f"{path} is truncated: the tier folder is damaged")
    magic, base, rid = _HEAD.unpack(raw)
    if magic != _MAGIC or rid.hex() != run:
        raise TierError(f"{path} is not this tier folder's journal")
    return base


def roll_back(files: TierFiles, journal: Journal) -> int:
    """Put every journaled row back (the tables become checkpoint ``journal.base``'s); returns the
    rows restored. Safe to repeat: a crash here is undone again on the next resume."""
    n = 0
    for lid, rows, old in journal.entries(files):  # rows of an entry: sorted, distinct
        files.write(lid, rows, dict(zip(files.names(lid), old)))
        n += rows.numel()
    files.sync()
    return n


def served_rows(folder: Path, record: dict | None, step: int) -> dict[int, torch.Tensor]:
    """Each table's rows {lid: [r, e]} as checkpoint ``step`` (whose tier ``record`` names the
    folder's run) holds them, read without writing anything: a server opening a tier run. The
    files' rows, with the journal's old rows put back in memory when it undoes to ``step`` (the
    run was killed after that checkpoint; its next resume rolls the files back the same way).
    A torchrun run's ``record`` names every rank's: their folders' shards, joined in rank order."""
    if record is not None and "ranks" in record:
        parts = [served_rows(folder / rank_folder(k, record["world"]), r, step)
                 for k, r in enumerate(record["ranks"])]
        return {lid: torch.cat([p[lid] for p in parts]) for lid in parts[0]}
    files = TierFiles.open(folder, writable=False)
    if record is None or record.get("run") != files.run_id:
        raise TierError(f"{folder} holds the tables of another run than the checkpoint of step "
                        f"{step}; the run's own tier folder is needed to open it")
    base = _read_head(folder / JOURNAL, files.run_id)
    if base > step:
        raise TierError(f"{folder}'s journal undoes to step {base}, the newest checkpoint is step "
                        f"{step}: its tables are not that checkpoint's")
    rows = {lid: files.read_all(lid, "rows") for lid in files.shapes}  # [r, e] in memory
    if base == step:
        for lid, ids, old in journal_entries(folder / JOURNAL, files):
            rows[lid].index_copy_(0, ids, old[0])  # old[0]: the row; the rest is optimiser state
    files.close()
    return rows
