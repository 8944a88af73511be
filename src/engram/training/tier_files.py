"""The files of a run trained from a file tier: each Engram table's rows and its row optimiser's
state, memory-mapped, and an undo journal that keeps them consistent with the run's checkpoints.

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
import uuid
import warnings
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


def _np(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


class TierFiles:
    """One run's tier folder: per layer ``arrays[lid][name]`` (name "rows" or a state key), each a
    torch tensor over a shared memory map of its file (writes land in the page cache: a killed
    process leaves them; :meth:`sync` makes them durable)."""

    def __init__(self, folder: Path, meta: dict[str, Any], writable: bool = True):
        self.folder, self.meta = Path(folder), meta
        self.arrays: dict[int, dict[str, torch.Tensor]] = {}
        self._maps: list[np.memmap] = []
        for lid, (r, e) in ((int(k), v) for k, v in meta["layers"].items()):
            self.arrays[lid] = {}
            for name, (tail, dtype) in self.layout(e).items():
                m = np.memmap(self.folder / f"layer{lid}.{name}", dtype=_np(_DTYPES[dtype]),
                              mode="r+" if writable else "r", shape=(r, *tail))
                self._maps.append(m)
                with warnings.catch_warnings():  # read-only maps (a server's) are only read
                    warnings.simplefilter("ignore", UserWarning)
                    self.arrays[lid][name] = torch.from_numpy(m)

    def layout(self, e: int) -> dict[str, tuple[list[int], str]]:
        """name -> (per-row shape, dtype name): the rows, then the optimiser's state."""
        return {"rows": ([e], "float32"), **{k: (list(t), d) for k, (t, d) in
                                               self.meta["state"].items()}}

    @property
    def run_id(self) -> str:
        return self.meta["run"]

    def row_bytes(self, lid: int) -> int:
        """Bytes of one row and its state."""
        return sum(int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
                   for t in self.arrays[lid].values())

    def sync(self) -> None:
        """Every table write so far on disk (before a checkpoint names this state)."""
        with disk_errors(self.folder):
            for m in self._maps:
                m.flush()  # msync

    @staticmethod
    def create(folder: Path, out_dir: Path, layers: dict[int, torch.Tensor],
               state: dict[str, tuple[list[int], str]], optimizer: str) -> TierFiles:
        """A fresh folder from the tables' initial rows ``layers`` {lid: [r, e]} and zero state;
        every file's blocks are allocated now, so a full disk is one line here, not a SIGBUS at a
        later write through the map."""
        meta = {"format": FORMAT, "run": uuid.uuid4().hex, "out_dir": str(out_dir.resolve()),
                "optimizer": optimizer, "state": state,
                "layers": {str(lid): list(t.shape) for lid, t in layers.items()}}
        (folder / META).unlink(missing_ok=True)  # files below are not a complete folder until
        for lid, table in layers.items():  # tier.json is published again
            r, e = table.shape
            for name, (tail, dtype) in {"rows": ([e], "float32"), **state}.items():
                path = folder / f"layer{lid}.{name}"
                nbytes = r * int(np.prod(tail, dtype=np.int64)) * _DTYPES[dtype].itemsize
                with disk_errors(path, nbytes):
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        os.posix_fallocate(fd, 0, max(nbytes, 1))
                        if name == "rows":
                            os.write(fd, table.detach().float().contiguous().numpy().tobytes())
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
    """:meth:`Journal.entries` of the journal at ``path``, read without opening it to write (a
    server's look at a run killed after its checkpoint)."""
    data = path.read_bytes()
    pos, n = _HEAD.size, len(data)
    while pos + _ENTRY.size <= n:
        lid, k, size, crc = _ENTRY.unpack_from(data, pos)
        body = data[pos + _ENTRY.size: pos + _ENTRY.size + size]
        if len(body) < size:
            return  # torn: killed while appending, before its table write
        if zlib.crc32(body) != crc or lid not in files.arrays:
            raise TierError(f"{path}: a damaged entry at byte {pos}; the tables cannot be "
                            "put back to the checkpoint (use another --out_dir)")
        pos += _ENTRY.size + size
        if k == 0:
            continue
        rows, out, off = torch.frombuffer(bytearray(body[:8 * k]), dtype=torch.int64), [], 8 * k
        for t in files.arrays[lid].values():
            nb = k * t[0].numel() * t.element_size()
            out.append(torch.frombuffer(bytearray(body[off:off + nb]), dtype=t.dtype)
                       .view(k, *t.shape[1:]))
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
    for lid, rows, old in journal.entries(files):
        for t, v in zip(files.arrays[lid].values(), old):
            t.index_copy_(0, rows, v)
        n += rows.numel()
    files.sync()
    return n


def served_rows(folder: Path, record: dict | None, step: int) -> dict[int, torch.Tensor]:
    """Each table's rows {lid: [r, e]} as checkpoint ``step`` (whose tier ``record`` names the
    folder's run) holds them, read without writing anything: a server opening a tier run. The
    files' rows, with the journal's old rows put back in memory when it undoes to ``step`` (the
    run was killed after that checkpoint; its next resume rolls the files back the same way)."""
    files = TierFiles.open(folder, writable=False)
    if record is None or record.get("run") != files.run_id:
        raise TierError(f"{folder} holds the tables of another run than the checkpoint of step "
                        f"{step}; the run's own tier folder is needed to open it")
    base = _read_head(folder / JOURNAL, files.run_id)
    if base > step:
        raise TierError(f"{folder}'s journal undoes to step {base}, the newest checkpoint is step "
                        f"{step}: its tables are not that checkpoint's")
    rows = {lid: a["rows"].clone() for lid, a in files.arrays.items()}  # [r, e] in memory
    if base == step:
        for lid, ids, old in journal_entries(folder / JOURNAL, files):
            rows[lid].index_copy_(0, ids, old[0])  # old[0]: the row; the rest is optimiser state
    return rows
