"""A split's tokens read from its shard files, with memory flat in corpus size and run length.

Training reads windows: each window is one positioned read (``os.pread``) from its shard's ``.npy``
file, so the process holds only the batch it makes. (Windows read through a memory map would stay
mapped: the pages touched, and the kernel's read-around beside them, count as this process's
resident memory and grow over a run toward the corpus's size.) A whole split as one array, for
whole-corpus analyses, is the memory map of its file (``TokenStream.array``).

Shape legend: n tokens of a split, b windows, t window length.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


class NpyFile:
    """A 1-D ``.npy`` file read in pieces, by position: no map, no file held open."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(self.path, "rb") as f:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
            if version not in header:
                raise ValueError(f".npy version {version} (this reads 1.0 and 2.0)")
            shape, fortran, dtype = header[version](f)
            self.offset = f.tell()  # where the data starts
        if len(shape) != 1 or fortran or dtype.hasobject:
            raise ValueError(f"{path} holds {dtype} {shape}, not a 1-D array of numbers")
        self.dtype, self.n = dtype, int(shape[0])

    def __len__(self) -> int:
        return self.n

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """starts [r] (each window inside the file) -> tokens [r, length]."""
        out = np.empty((len(starts), length), dtype=self.dtype)  # [r, t]
        size = length * self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i, s in enumerate(starts):
                got = os.preadv(fd, [memoryview(out[i]).cast("B")],
                                self.offset + int(s) * self.dtype.itemsize)
                if got != size:
                    raise OSError(f"{self.path}: short read at token {int(s)} (file cut?)")
        finally:
            os.close(fd)
        return out

    def array(self) -> np.ndarray:
        """The whole file as an array [n], memory-mapped copy-on-write: the file never changes,
        and callers (torch.as_tensor) get the writable array they expect."""
        return np.asarray(np.load(self.path, mmap_mode="c", allow_pickle=False))


class InMemory:
    """An array already in memory, read like an ``NpyFile`` (tests, small streams)."""

    def __init__(self, a: np.ndarray):
        self.a, self.dtype = a, a.dtype

    def __len__(self) -> int:
        return len(self.a)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        return self.a[np.asarray(starts)[:, None] + np.arange(length)]  # [r, t]

    def array(self) -> np.ndarray:
        return self.a


class TokenStream:
    """One split's tokens: its shards back to back, never joined. A window may cross a shard
    boundary; what it costs does not depend on the corpus's size."""

    def __init__(self, parts: list[Any]):
        parts = [p if isinstance(p, (NpyFile, InMemory)) else InMemory(np.asarray(p)) for p in parts]
        self.parts = [p for p in parts if len(p)]  # empty shards hold nothing to read
        self.dtype = np.result_type(*[p.dtype for p in self.parts]) if self.parts else np.int32
        self.sizes = np.asarray([len(p) for p in self.parts], dtype=np.int64)  # [shards]
        self.ends = np.cumsum(self.sizes)  # [shards]
        self.begins = self.ends - self.sizes  # [shards]
        self._whole: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) as one array [hi - lo]."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"tokens [{lo}, {hi}) lie outside the stream of {len(self)}")
        pieces = []
        k = int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            end = min(hi, int(self.ends[k]))
            pieces.append(self.parts[k].gather(np.array([lo - self.begins[k]]), end - lo)[0])
            lo, k = end, k + 1
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """starts [b] -> tokens [b, length]: row i is tokens [starts[i], starts[i] + length)."""
        starts = np.asarray(starts, dtype=np.int64)  # [b]
        out = np.empty((len(starts), length), dtype=self.dtype)  # [b, t]
        if not len(starts):
            return out
        if starts.min() < 0 or starts.max() + length > len(self):
            raise IndexError(f"windows of {length} from {starts.min()}..{starts.max()} lie outside "
                             f"the stream of {len(self)}")
        k = np.searchsorted(self.ends, starts, side="right")  # [b] the shard each window starts in
        offset = starts - self.begins[k]  # [b] where in that shard
        inside = offset + length <= self.sizes[k]  # [b]
        for part in np.unique(k[inside]):  # one pass per shard touched
            rows = np.flatnonzero(inside & (k == part))
            out[rows] = self.parts[part].gather(offset[rows], length)
        for r in np.flatnonzero(~inside):  # a window across a shard boundary
            out[r] = self.read(int(starts[r]), int(starts[r]) + length)
        return out

    def array(self) -> np.ndarray:
        """The whole split as one array [n]: the memory map itself for one shard, else joined in
        memory (whole-corpus analyses only; training reads windows)."""
        if self._whole is None:
            arrays = [p.array() for p in self.parts]
            self._whole = (arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays
                           else np.empty(0, np.int32))
        return self._whole

    def __getstate__(self) -> dict:  # sent to another process: paths, not a joined copy
        return {**self.__dict__, "_whole": None}
