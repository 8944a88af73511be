"""Tables in host memory: the memory tier (``HostTable``, rows kept as the table file stores
them) and pinned host memory copied to the device on demand (``PinnedTable``). Each
implements the ``engram.tables.store.TableStore`` protocol and is tested row for row against
``engram.tables.store.MemoryTable`` (tests/tables/test_tiers.py, test_fp8.py).

Shape legend: r rows, e row width, n rows asked for, ... any leading shape of row ids,
nb fp8 scale blocks per row.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8 import StoredRows
from .tiers import FileTable, check_rows


class HostTable:
    """A table in this process's memory, its rows kept as the table file stores them (fp8 values
    and block scales, int8 / int4 blocks, bf16, ...): an FP8 + E8M0 table takes 264 bytes a row of
    head dim 256 (int8 272, int4 144), not the 1,024 of fp32, and every lookup gathers and
    dequantises in one pass (fp8.StoredRows).

    ``source``: a ``FileTable`` (its stored rows are copied; with ``dtype`` they are read
    as ``dtype`` instead), rows [r, e], a module with a ``weight`` [r, e], or any TableStore (its
    lookups' rows, in their dtype or ``dtype``). ``pin``: page-locked memory (CUDA only).
    """

    def __init__(self, source: Any, *, dtype: torch.dtype | None = None,
                 chunk_rows: int = 1 << 16, pin: bool = False):
        scales, blocks = None, None
        if isinstance(source, FileTable) and dtype is None:  # as stored: fp8 keeps its scales
            num_rows, dim = source.num_rows, source.dim
            read = source.stored  # (a, b) -> (values, scales or None)
            dtype, self.out_dtype = source._data.dtype, source.out_dtype
            width, blocks = source._data.width, source._data.blocks  # int8 / int4: row bytes
            if source._scales is not None:
                scales = (source._scales.width, source._scales.dtype)
        else:
            if isinstance(source, torch.Tensor):
                num_rows, dim = source.shape
                rows = lambda a, b: source[a:b]  # noqa: E731
            elif hasattr(source, "weight") and isinstance(source.weight, torch.Tensor):
                w = source.weight.detach()
                num_rows, dim = w.shape
                rows = lambda a, b: w[a:b]  # noqa: E731
            else:  # any TableStore: copied in chunks, so a file never needs a second full copy
                num_rows, dim = source.num_rows, source.dim
                rows = lambda a, b: source.lookup(torch.arange(a, b))  # noqa: E731
            read = lambda a, b: (rows(a, b), None)  # noqa: E731
            dtype = dtype or rows(0, 1).dtype
            self.out_dtype, width = dtype, dim
        self.num_rows, self.dim = int(num_rows), int(dim)
        # [r, e], or [r, rb]: int8 / int4 blocks
        self.host = torch.empty(self.num_rows, width, dtype=dtype, pin_memory=pin)
        self.host_scales = (None if scales is None else  # [r, nb] fp32 or E8M0 bytes
                            torch.empty(self.num_rows, scales[0], dtype=scales[1],
                                        pin_memory=pin))
        with torch.no_grad():
            for a in range(0, self.num_rows, chunk_rows):
                b = min(self.num_rows, a + chunk_rows)
                values, sc = read(a, b)
                self.host[a:b] = values.to(dtype)
                if sc is not None:
                    self.host_scales[a:b] = sc
        self.rows = StoredRows(self.host, self.host_scales, blocks)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        flat = check_rows(rows, self.num_rows, bounds=False)  # the read checks them
        out = self.rows.gather(flat, self.out_dtype)  # [n, e]
        return out if rows.dim() == 1 else out.view(*rows.shape, self.dim)  # [..., e]

    def prefetch(self, rows: torch.Tensor) -> None:
        pass

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (values and scales)."""
        held = [self.host] if self.host_scales is None else [self.host, self.host_scales]
        return sum(t.numel() * t.element_size() for t in held)

    def __repr__(self) -> str:
        return (f"HostTable(rows={self.num_rows}, dim={self.dim}, dtype={self.host.dtype}, "
                f"scales={None if self.host_scales is None else self.host_scales.dtype})")


class PinnedTable(HostTable):
    """The whole table in page-locked host memory; looked-up rows are copied to ``device``.

    Pinned memory lets the host-to-device copy run as DMA, asynchronously on the current stream
    (paper section 2.5: a 100B-parameter table in host DRAM costs under 3% of throughput). Without
    CUDA the table is ordinary host memory and rows stay on the CPU. Rows are held as a
    ``HostTable`` holds them (a table file's as stored) and read to fp32 on the host.
    """

    def __init__(self, source: Any, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, chunk_rows: int = 1 << 16):
        cuda = torch.cuda.is_available()
        self.device = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
        self.pinned = cuda
        super().__init__(source, dtype=dtype, chunk_rows=chunk_rows, pin=cuda)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return super().lookup(rows)
        flat = check_rows(rows, self.num_rows)
        # Gather into a pinned staging buffer, then one async DMA on the current stream; the
        # caching host allocator keeps the buffer alive until the copy has run.
        staging = torch.empty(flat.numel(), self.dim, dtype=self.out_dtype, pin_memory=True)
        self.rows.gather(flat, out=staging)
        return staging.to(self.device, non_blocking=True).view(*rows.shape, self.dim)

    def __repr__(self) -> str:
        return (f"PinnedTable(rows={self.num_rows}, dim={self.dim}, pinned={self.pinned}, "
                f"device={self.device})")
