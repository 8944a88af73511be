"""Engram table files: one layer's rows on disk, self-describing, checksummed, published atomically.

Row ids depend on token ids alone (paper section 2.5), so a table can live outside the accelerator,
on NVMe or in a pool shared by processes; this is the file every such tier maps. Layout
(little-endian):

    [0, 32)              preamble: magic b"ENGRAMTB", u32 format version, u32 header length,
                         u32 crc32 of the header, u32 reserved, u64 total file size
    [32, 32 + len)       header: UTF-8 JSON (shape, dtype, Engram config, hash profile, layer id,
                         per-chunk crc32s)
    [data_offset, ...)   rows [r, e] in the stored dtype (fp32, bf16, fp16 or fp8 e4m3), or
                         int8 / int4 rows [r, rb] of GGUF Q8_0 / Q4_0 blocks, each an fp16 scale
                         and its values (tables/blocks.py)
    [scale_offset, ...)  fp8 only: per-block scales [r, e / block], fp32 or (``scale_format``
                         "e8m0") one byte each: a power of two's exponent, DeepSeek-V4.1's format

Offsets are page-aligned so a mapped row never shares a page with the header. Every chunk of
``chunk_rows`` rows has a crc32 over its rows (then its scales), so a flipped byte is found and
named. A new version is written aside, fsynced and renamed over the old name: a reader that opens
the path gets the old file or the new one whole, and a reader that already mapped the old one keeps
it.

Format versions: 1, every dtype but int8 and int4; 2 added them. A file is written at the oldest
version that holds it (an fp8 file stays readable by an engram that reads 1), and a reader refuses
a version newer than its own in one line.

Shape legend: r rows, e row width (head dim), nb scale blocks per row (e / block), rb bytes of an
int8 / int4 row.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..files import disk_errors, open_beside
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import PARTS, Hasher, differences
from ..retrieval.primes import rows_per_layer
from . import blocks
from .fp8 import (  # noqa: F401  (quantize_fp8, dequantize_fp8 and FP8_MAX were defined here)
    FP8_MAX,
    SCALE_FORMATS,
    check_quantized,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_e8m0,
)

MAGIC = b"ENGRAMTB"
FORMAT_VERSION = 2  # the newest this engram reads and writes (the module's docstring: versions)
_PREAMBLE = struct.Struct("<8sIIIIQ")  # magic, version, header len, header crc, reserved, file size
PAGE = 4096
# Stored dtype name -> (torch dtype of the stored units, bytes per unit): a value each, or for
# int8 and int4 (lossy, tables/blocks.py) the bytes of a row's blocks.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2), "fp16": (torch.float16, 2),
    "fp8": (torch.float8_e4m3fn, 1), "int8": (torch.uint8, 1), "int4": (torch.uint8, 1),
}
BLOCK_SCALES = "fp16"  # the scale_format an int8 / int4 header names: fp16, inside each block
# File name suffix of each part of a table set (engram.retrieval.hashing.PARTS): hashed rows of
# one head each, or Engram-Nine's hot rows [S, K * e].
SUFFIX = {"cold": "", "hot": ".hot"}
# Config fields that do not change which row an n-gram reads (or what it holds).
_IGNORED_CONFIG = ("tokenizer_name_or_path",)


class TableFileError(UserError):
    """A table file is truncated, corrupted, foreign, or does not fit the model."""


@dataclass
class TableHeader:
    layer_id: int
    num_rows: int
    dim: int
    dtype: str  # a DTYPES key
    scale_block: int | None  # fp8, int8, int4: values per scale; else None
    data_offset: int
    scale_offset: int | None
    file_size: int
    chunk_rows: int
    chunks: list[str]  # crc32 per chunk of rows, 8 hex digits
    engram_config: dict[str, Any]
    hash_profile: dict[str, Any] | None
    tag: str = ""  # free-form version label of this publish (e.g. a training step)
    format: str = "engram-table"
    # fp8: a SCALE_FORMATS key (files before it existed: fp32); int8, int4: BLOCK_SCALES
    scale_format: str = "fp32"

    @property
    def blocks(self) -> tuple[str, int] | None:
        """int8 / int4: (dtype, values per block), how its rows' bytes read; else None."""
        return (self.dtype, self.scale_block) if self.dtype in blocks.KINDS else None

    @property
    def data_width(self) -> int:
        """Stored units a row (DTYPES): its values, or an int8 / int4 row's bytes."""
        b = self.blocks
        return self.dim if b is None else blocks.row_bytes(self.dtype, self.dim, b[1])

    @property
    def row_bytes(self) -> int:
        return self.data_width * DTYPES[self.dtype][1]

    @property
    def scale_width(self) -> int:
        """Scales a row in the scale region (fp8's); int8 / int4 keep theirs in the row."""
        fp8 = self.dtype == "fp8" and self.scale_block is not None
        return self.dim // self.scale_block if fp8 else 0

    @property
    def scale_row_bytes(self) -> int:
        return self.scale_width and self.scale_width * SCALE_FORMATS[self.scale_format][1]

    @property
    def version(self) -> int:
        """The oldest format version that holds this file (the module's docstring)."""
        return 2 if self.dtype in blocks.KINDS else 1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def _row_bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


# -- parts of a table set ---------------------------------------------------------------------

def _check_part(part: str) -> None:
    if part not in PARTS:
        raise ValueError(f"a table set's part is one of {PARTS}, got {part!r}")


# -- writing ---------------------------------------------------------------------------------------

def table_path(directory: str | Path, layer_id: int, part: str = "cold") -> Path:
    """``layer{id}.table``; Engram-Nine's hot rows beside it in ``layer{id}.hot.table``."""
    _check_part(part)
    return Path(directory) / f"layer{int(layer_id)}{SUFFIX[part]}.table"


def table_paths(directory: str | Path, hasher: Hasher) -> list[Path]:
    """Every table file of a run: one per part of each table set."""
    return [table_path(directory, lid, part) for lid in hasher.owners for part in hasher.parts]


RowSource = torch.Tensor | Callable[[int, int], torch.Tensor]


def write_table(path: str | Path, rows: RowSource, *, num_rows: int | None = None,
                dim: int | None = None, layer_id: int, config: EngramConfig,
                profile: dict[str, Any] | None = None, dtype: str = "fp32",
                scale_block: int = 32, chunk_rows: int | None = None, tag: str = "",
                progress: bool = False, scale_format: str = "fp32",
                kept: list[Path] | None = None) -> TableHeader:
    """Publish a table file atomically: write aside, fsync, rename over ``path``, fsync the folder.

    ``rows`` is a tensor [r, e] or a function ``(start, stop) -> rows [stop-start, e]`` (so a table
    larger than memory can be written piece by piece; then pass num_rows and dim). With fp8 the
    function may also return rows already quantised, ``(fp8 values, scales in scale_format)``:
    they are stored byte for byte (a DeepSeek-V4.1 table is imported without re-quantising);
    with int8 / int4, the rows' blocks as uint8 [stop-start, rb] (a GGUF Q8_0 / Q4_0 tensor's).
    ``scale_format``: "fp32" scales, or "e8m0" power-of-two exponent bytes (fp8 only).
    ``scale_block``: values per scale of fp8, int8 and int4 rows (a width it does not divide
    gets one scale a row).
    ``kept``: given, a file already at ``path`` that holds exactly these rows (the same header,
    every chunk's crc32 that of the rows given, its own checksums verified) is kept, not written
    again, and its path appended: the rerun of an interrupted export writes only what is missing.
    """
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if scale_format not in SCALE_FORMATS:
        raise UserError(f"scale_format must be one of {sorted(SCALE_FORMATS)}, got "
                         f"{scale_format!r}")
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 2:
            raise ValueError(f"rows must be [num_rows, dim], got {tuple(rows.shape)}")
        tensor = rows.detach()
        num_rows, dim = tensor.shape
        rows = lambda a, b: tensor[a:b].cpu()  # noqa: E731  (a device table, slice by slice)
    if num_rows is None or dim is None or num_rows <= 0 or dim <= 0:
        raise ValueError("a row function needs positive num_rows and dim")
    block = None
    if dtype == "fp8" or dtype in blocks.KINDS:
        block = scale_block if dim % scale_block == 0 else dim
    if dtype in blocks.KINDS:
        blocks.check_block(dtype, dim, block)
    split = dtype == "fp8"  # scales in a region of their own
    fmt = scale_format if split else BLOCK_SCALES if block else "fp32"
    header = TableHeader(
        layer_id=int(layer_id), num_rows=int(num_rows), dim=int(dim), dtype=dtype,
        scale_block=block, data_offset=0, scale_offset=None, file_size=0, chunk_rows=1,
        chunks=[], engram_config=config.to_dict(), hash_profile=profile, tag=str(tag),
        scale_format=fmt)
    rb = header.row_bytes
    chunk_rows = header.chunk_rows = chunk_rows or max(1, (4 << 20) // rb)  # ~4 MiB a checksum
    n_chunks = -(-num_rows // chunk_rows)
    header.chunks = ["0" * 8] * n_chunks
    # The crc values are fixed-width hex, so the header's length depends only on the offsets' digit
    # counts: settle them first, then write the rows, then the header in front of them.
    data_bytes = num_rows * rb
    hlen = -1
    while hlen != len(header.to_json()):
        hlen = len(header.to_json())
        header.data_offset = _align(_PREAMBLE.size + hlen)
        header.scale_offset = _align(header.data_offset + data_bytes) if split else None
        header.file_size = (header.scale_offset + num_rows * header.scale_row_bytes if split
                            else header.data_offset + data_bytes)

    def chunk(c: int) -> tuple[int, bytes, bytes]:
        """(first row, row bytes, scale bytes) of chunk ``c`` as stored."""
        a, b = c * chunk_rows, min(num_rows, (c + 1) * chunk_rows)
        x = rows(a, b)
        if isinstance(x, tuple) and dtype == "fp8":
            q, sc = check_quantized(*x, b - a, dim, block, header.scale_format, f"rows {a}:{b}")
            return a, _row_bytes(q), _row_bytes(sc)
        if dtype in blocks.KINDS and x.dtype == torch.uint8:  # as stored
            return a, _row_bytes(blocks.check_stored(x, dtype, b - a, dim, block,
                                                     f"rows {a}:{b}")), b""
        if tuple(x.shape) != (b - a, dim):
            raise ValueError(f"row source gave {tuple(x.shape)} for rows {a}:{b}, expected "
                             f"{(b - a, dim)}")
        if dtype == "fp8":
            q, s = (quantize_fp8_e8m0(x, block) if header.scale_format == "e8m0"
                    else quantize_fp8(x, block))
            return a, _row_bytes(q), _row_bytes(s)
        if dtype in blocks.KINDS:
            return a, _row_bytes(blocks.quantize_blocks(x, dtype, block, f"rows {a}:{b}")), b""
        return a, _row_bytes(x.to(DTYPES[dtype][0])), b""

    path = Path(path)
    if kept is not None:
        old = _holding(path, header, chunk)
        if old is not None:
            kept.append(path)
            return old
    with disk_errors(path, header.file_size):  # a full disk: one line, the old file kept
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = open_beside(path)
        try:
            with os.fdopen(fd, "wb") as f:
                from tqdm.auto import tqdm

                for c in tqdm(range(n_chunks), disable=not progress, desc=path.name, leave=False):
                    a, data, scales = chunk(c)
                    f.seek(header.data_offset + a * rb)
                    f.write(data)
                    crc = zlib.crc32(data)
                    if split:
                        f.seek(header.scale_offset + a * header.scale_row_bytes)
                        f.write(scales)
                        crc = zlib.crc32(scales, crc)
                    header.chunks[c] = f"{crc:08x}"
                body = header.to_json()
                assert len(body) == hlen, "header length moved"
                f.truncate(header.file_size)
                f.seek(0)
                f.write(_PREAMBLE.pack(MAGIC, header.version, hlen, zlib.crc32(body), 0,
                                       header.file_size))
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file or this one, never a mix
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(path.parent)  # the rename itself survives a crash
    return header


def _holding(path: Path, header: TableHeader, chunk: Callable[[int], tuple[int, bytes, bytes]]
             ) -> TableHeader | None:
    """The header of the file at ``path`` when it holds what ``header`` (its crc32s not yet
    filled) and ``chunk`` would write, checked chunk by chunk (the first that differs ends it,
    so a stale file costs one chunk), then its own checksums verified; else None."""
    try:
        old = read_header(path)
    except (OSError, TableFileError):
        return None  # absent, torn or foreign: written again
    mine = asdict(header)
    if {k: v for k, v in asdict(old).items() if k != "chunks"} != \
            {k: v for k, v in mine.items() if k != "chunks"} or len(old.chunks) != len(mine["chunks"]):
        return None
    for c, want in enumerate(old.chunks):
        _, data, scales = chunk(c)
        if f"{zlib.crc32(scales, zlib.crc32(data)):08x}" != want:
            return None
    try:
        verify(path, old)
    except (OSError, TableFileError):
        return None
    return old


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse to fsync a folder; the rename is still atomic
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------

def read_header(source: str | Path | int, name: str | None = None) -> TableHeader:
    """Parse and check the preamble and header of a path or an open file descriptor.

    Pass the descriptor you will map, so header and rows come from the same version of the file.
    """
    if isinstance(source, int):
        fd, own, name = source, False, name or f"fd {source}"
    else:
        name = str(source)
        try:
            fd, own = os.open(source, os.O_RDONLY), True
        except FileNotFoundError:
            raise FileNotFoundError(f"no table file at {source} (export one with "
                                    "engram.artifacts.table_files.export_tables)") from None
    try:
        size = os.fstat(fd).st_size
        pre = os.pread(fd, _PREAMBLE.size, 0)
        if len(pre) < _PREAMBLE.size:
            raise TableFileError(f"{name}: truncated ({size} bytes, not even a preamble)")
        magic, version, hlen, hcrc, _, file_size = _PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise TableFileError(f"{name}: not an Engram table file (magic {magic!r})")
        if version > FORMAT_VERSION:
            raise TableFileError(f"{name}: table format version {version}, written by a newer "
                                 f"engram; this one reads versions 1 to {FORMAT_VERSION} "
                                 "(upgrade engram to read it)")
        if version < 1:
            raise TableFileError(f"{name}: table format version {version} does not exist")
        if size < file_size:
            raise TableFileError(f"{name}: truncated: {size} of {file_size} bytes")
        if size > file_size:
            raise TableFileError(f"{name}: {size - file_size} unexpected bytes past the end")
        body = os.pread(fd, hlen, _PREAMBLE.size)
        if len(body) != hlen or zlib.crc32(body) != hcrc:
            raise TableFileError(f"{name}: header checksum mismatch (corrupted header)")
        try:
            d = json.loads(body)
            header = TableHeader(**d)
        except (ValueError, TypeError) as e:
            raise TableFileError(f"{name}: unreadable header: {e}") from e
        if (header.file_size != file_size or header.dtype not in DTYPES
                or header.version > version
                or header.scale_format not in ((BLOCK_SCALES,) if header.blocks else SCALE_FORMATS)
                or (header.blocks and not header.scale_block)):
            raise TableFileError(f"{name}: inconsistent header")
        return header
    finally:
        if own:
            os.close(fd)


def verify(source: str | Path | int, header: TableHeader | None = None, *,
           name: str | None = None, progress: bool = False) -> TableHeader:
    """Check every chunk's crc32; raises TableFileError naming the first bad chunk's rows."""
    if isinstance(source, int):
        fd, own = source, False
        name = name or f"fd {source}"
    else:
        name = str(source)
        header = header or read_header(source)
        fd, own = os.open(source, os.O_RDONLY), True
    try:
        header = header or read_header(fd, name)
        rb, sb = header.row_bytes, header.scale_row_bytes
        from tqdm.auto import tqdm

        for c in tqdm(range(len(header.chunks)), disable=not progress, desc="verify", leave=False):
            a = c * header.chunk_rows
            n = min(header.num_rows, a + header.chunk_rows) - a
            crc = zlib.crc32(os.pread(fd, n * rb, header.data_offset + a * rb))
            if sb:
                crc = zlib.crc32(os.pread(fd, n * sb, header.scale_offset + a * sb), crc)
            if f"{crc:08x}" != header.chunks[c]:
                raise TableFileError(f"{name}: checksum mismatch in chunk {c} (rows {a}:{a + n}); "
                                     "the file is corrupted, re-export it")
        return header
    finally:
        if own:
            os.close(fd)


def check_config(file_config: dict[str, Any], config: EngramConfig, name: str) -> None:
    """Refuse a file written for another Engram config, naming the fields that differ."""
    ours = {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG}
    theirs = {k: v for k, v in file_config.items() if k not in _IGNORED_CONFIG}
    if ours != theirs:
        raise TableFileError(f"{name} was exported for another Engram config "
                             f"({differences(theirs, ours)})")


def check_compatible(header: TableHeader, config: EngramConfig, layer_id: int,
                     hasher: Hasher | None = None, part: str = "cold",
                     name: str = "table file") -> None:
    """Refuse a file that would feed the model rows under other ids (or of another shape).

    ``part``: which table of ``hasher``'s set the file must hold (``Hasher.parts``); without a
    hasher only a plain cold table's shape and config are checked.
    """
    if header.layer_id != layer_id:
        raise TableFileError(f"{name} holds layer {header.layer_id}, expected layer {layer_id}")
    check_config(header.engram_config, config, name)
    _check_part(part)
    want = ((rows_per_layer(config)[layer_id], config.head_dim) if hasher is None
            else hasher.table_shape(layer_id, part))
    if (header.num_rows, header.dim) != want:
        raise TableFileError(f"{name} is {header.num_rows} x {header.dim}, the {part} table of "
                             f"layer {layer_id} needs {want[0]} x {want[1]}")
    why = None if hasher is None else hasher.profile_mismatch(header.hash_profile, layer_id, part)
    if why:
        raise TableFileError(f"{name} {why}")
