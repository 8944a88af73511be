"""fp8 rows with per-block scales: the numerics of a table file's fp8 dtype (tables/tablefile.py).

One scale per block of values (DeepSeek-V3's fine-grained fp8 scaling) keeps a row with one large
entry from flushing its small ones to zero. Scales are stored as fp32, or as DeepSeek-V4.1 stores
its Engram tables: E8M0, one byte per scale holding a power of two's exponent (OCP MX, bias 127),
so that an imported V4.1 table keeps its exact bytes and every tier dequantises it alike.

Every tier reads its rows through ``StoredRows``: gather and dequantise in one pass
(tables/read_kernels.py) with the values torch's ``dequantize_fp8`` gives, bit for bit (and
int8 / int4 blocks', tables/blocks.py, ``dequantize_blocks``).

Shape legend: n rows, e row width, nb = e / block scale blocks per row, r rows of a table.
"""

from __future__ import annotations

import numpy as np
import torch

from .blocks import block_bytes, dequantize_blocks
from .blocks import row_bytes as block_row_bytes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# fp8 scale format -> (torch dtype of the stored scales, bytes per scale). "e8m0": the unsigned
# exponent byte of a power of two (OCP MX E8M0, bias 127), as DeepSeek-V4.1's tables store it.
SCALE_FORMATS: dict[str, tuple[torch.dtype, int]] = {"fp32": (torch.float32, 4),
                                                      "e8m0": (torch.uint8, 1)}
E8M0_NAN = 255  # the one E8M0 code that is no power of two


def quantize_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, e] -> (fp8 values [n, e], fp32 scales [n, e/block]); x ~= values * scale per block."""
    n, e = x.shape
    xb = x.float().view(n, e // block, block)  # [n, nb, block]
    scale = xb.abs().amax(-1) / FP8_MAX  # [n, nb]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block keeps 0
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, e), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 values [n, e] and scales [n, nb] (fp32, or E8M0 bytes as uint8) -> fp32 [n, e]."""
    n, e = q.shape
    if scale.dtype == torch.uint8:
        scale = e8m0_to_float(scale)
    return (q.float().view(n, scale.shape[1], -1) * scale.unsqueeze(-1)).view(n, e)


class StoredRows:
    """A table's rows as stored, data [r, e] (fp32, bf16, fp16, or fp8 with block scales [r, nb],
    fp32 or E8M0 bytes), or with ``blocks`` = (kind, block) int8 / int4 GGUF blocks as bytes
    [r, rb] (tables/blocks.py), read by ``gather``. Made once per table (or mapping): a
    decode step's read is tens of microseconds, so what can be settled once (which path, the
    arrays the kernel takes) is not settled again per read."""

    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None = None,
                 blocks: tuple[str, int] | None = None):
        self.data, self.scales, self.blocks = data, scales, blocks
        self.dim = data.shape[1]
        self.kernel = None  # the fused read, when it takes these rows
        if blocks is not None:
            kind, block = blocks
            self.dim = data.shape[1] // block_bytes(kind, block) * block
            if (data.dtype == torch.uint8 and data.device.type == "cpu" and scales is None
                    and data.stride(1) == 1 and _kernels() is not None):
                self.kernel = _kernels().gather_blocks
                self.args = (data.numpy(), kind == "int4", block)
        elif (data.dtype in (torch.float8_e4m3fn, torch.bfloat16) and data.device.type == "cpu"
                and (scales is None) == (data.dtype == torch.bfloat16) and data.stride(1) == 1
                and (scales is None or scales.stride(1) == 1)):
            kernels = _kernels()  # numba is imported by fp8, bf16 and block reads only
            if kernels is not None and scales is None:
                self.kernel = kernels.gather_bf16
                self.args = (data.view(torch.int16).numpy().view(np.uint16),)
            elif kernels is not None:
                self.kernel = kernels.gather_fp8
                lut = E8M0_TABLE if scales.dtype == torch.uint8 else None
                self.args = (data.view(torch.uint8).numpy(), scales.numpy(), lut)

    def gather(self, ids: torch.Tensor | None, out_dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` [n] (int64 on the CPU, in range; None: every row in order) as
        ``out_dtype`` [n, e] (into ``out`` when given): the values of ``dequantize_fp8(data[ids],
        scales[ids])`` (fp8), ``blocks.dequantize_blocks(data[ids], *blocks)`` (int8, int4) or
        ``data[ids]`` (others) cast to out_dtype, bit for bit; ids outside the rows raise
        ``check_range``'s IndexError (tiers leave the check to this read). fp8, bf16, int8
        and int4 rows on the CPU are read to fp32 in one pass by a compiled kernel,
        which checks the ids as it goes and holds no lock of Python's (a large read can be split
        over threads)."""
        data, scales = self.data, self.scales
        n = data.shape[0] if ids is None else ids.shape[0]
        if out is None:
            out = torch.empty(n, self.dim, dtype=out_dtype, device=data.device)
        if self.kernel is None or out.dtype != torch.float32 or not out.is_contiguous():
            if ids is not None and ids.device.type == "cpu":
                check_range(ids.numpy(), data.shape[0])
            if scales is None and ids is not None and data.dtype == out.dtype and not self.blocks:
                return torch.index_select(data, 0, ids, out=out)
            raw = data if ids is None else data.index_select(0, ids)
            if self.blocks is not None:
                raw = dequantize_blocks(raw, *self.blocks)
            elif scales is not None:
                raw = dequantize_fp8(raw, scales if ids is None else scales.index_select(0, ids))
            return out.copy_(raw)
        at = np.arange(n) if ids is None else ids.numpy()
        if self.kernel(*self.args, at, out.numpy()) < n:
            check_range(at, data.shape[0])
        return out


def check_range(ids: np.ndarray, num_rows: int) -> None:
    """Row ids [n] (int64) all in [0, num_rows), or an IndexError saying which range came."""
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_rows:
            raise IndexError(f"row ids must be in [0, {num_rows}), got [{lo}, {hi}]")


def gather_rows(data: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor | None,
                out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                blocks: tuple[str, int] | None = None) -> torch.Tensor:
    """``StoredRows(data, scales, blocks).gather(ids, out_dtype, out)``: one read of rows as
    stored."""
    return StoredRows(data, scales, blocks).gather(ids, out_dtype, out)


def _kernels():
    """tables/read_kernels.py, imported on first use (importing numba costs ~0.5 s); None where
    numba is missing (the torch path then reads the same values)."""
    global _KERNELS
    if _KERNELS is False:
        try:
            from . import read_kernels as _KERNELS
        except ImportError:
            _KERNELS = None
    return _KERNELS


_KERNELS = False  # not imported yet


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> fp32 2^(code - 127), decoded as vLLM's V4.1 lookup kernel does: the
    byte becomes the fp32 exponent field, so code 0 reads 0.0 (not 2^-127) and 255 infinity."""
    return (code.to(torch.int32) << 23).view(torch.float32)


def float_to_e8m0(scale: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """fp32 powers of two [...] -> their E8M0 bytes (uint8), exactly; anything else is an error
    (a scale that is no power of two cannot be stored in one exponent byte without changing rows).
    """
    bits = scale.detach().float().contiguous().view(torch.int32)
    exp, rest = (bits >> 23) & 0xFF, bits & ~(0xFF << 23)  # rest: sign and mantissa
    bad = (rest != 0) | (exp == 0) | (exp == E8M0_NAN)
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        raise ValueError(f"{name}: value {float(scale.flatten()[i])!r} at flat index {i} is not a "
                         "positive normal power of two, so it has no E8M0 code")
    return exp.to(torch.uint8)


def quantize_fp8_e8m0(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, e] -> (fp8 values [n, e], E8M0 scale bytes [n, e/block]): each block's scale is the
    smallest power of two with |x| / scale <= FP8_MAX (DeepSeek-V3/V4's ue8m0 scaling). Rows that
    are already fp8 values times such scales come back unchanged (the division is exact)."""
    n, e = x.shape
    xb = x.float().view(n, e // block, block)  # [n, nb, block]
    amax = xb.abs().amax(-1)  # [n, nb]
    mant, exp = torch.frexp(amax / FP8_MAX)  # amax / max = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # an exact power of two needs no rounding up
    exp = torch.where(amax > FP8_MAX * torch.ldexp(torch.ones_like(amax), exp), exp + 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-126, 127)  # all-zero block: 1
    scale = torch.ldexp(torch.ones_like(amax), exp)  # [n, nb]
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, e), (exp + 127).to(torch.uint8)


def check_quantized(q: torch.Tensor, sc: torch.Tensor, n: int, dim: int, block: int,
                    scale_format: str, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows given already quantised, fp8 values [n, e] and scales [n, e/block] in
    ``scale_format``: returned as they are after checking shapes, dtypes and (E8M0) codes."""
    want_sc = SCALE_FORMATS[scale_format][0]
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (n, dim):
        raise ValueError(f"{where}: fp8 values must be float8_e4m3fn {(n, dim)}, got {q.dtype} "
                         f"{tuple(q.shape)}")
    if sc.dtype != want_sc or tuple(sc.shape) != (n, dim // block):
        raise ValueError(f"{where}: {scale_format} scales must be {want_sc} {(n, dim // block)}, "
                         f"got {sc.dtype} {tuple(sc.shape)}")
    if scale_format == "e8m0" and bool((sc == E8M0_NAN).any()):
        raise ValueError(f"{where}: E8M0 scale byte {E8M0_NAN} (NaN) is not a power of two")
    return q, sc


# -- sizes -----------------------------------------------------------------------------------------

ROW_FORMATS = ("fp8+e8m0", "fp8+fp32", "bf16", "fp32")  # how a row of e values can be stored
BLOCK_FORMATS = ("int8", "int4")  # GGUF Q8_0 / Q4_0 blocks (tables/blocks.py): an fp16 scale each


def row_bytes(dim: int, fmt: str, block: int = 32) -> int:
    """Bytes of one stored row of ``dim`` values (fp8 rows carry one scale per ``block``; int8
    and int4 rows are blocks of ``block`` values, one block a row when ``block`` does not divide
    ``dim``, as table files store them: 34 and 18 bytes at width 32)."""
    scales = dim // block
    sizes = {"fp8+e8m0": dim + scales, "fp8+fp32": dim + 4 * scales, "bf16": 2 * dim,
             "fp32": 4 * dim}
    if fmt in BLOCK_FORMATS:
        return block_row_bytes(fmt, dim, block if dim % block == 0 else dim)
    if fmt not in sizes:
        raise ValueError(f"row format must be one of {ROW_FORMATS + BLOCK_FORMATS}, got {fmt!r}")
    return sizes[fmt]


def table_memory(rows: dict[int, int], dim: int, block: int = 32,
                 formats: tuple[str, ...] = ROW_FORMATS + BLOCK_FORMATS) -> dict:
    """Rows and bytes per layer in each of ``formats`` (any of ``ROW_FORMATS`` and
    ``BLOCK_FORMATS``; by default all, so every format a table file can hold is sized), and
    their totals; "fp8+e8m0" is vLLM's DeepSeek-V4.1 arithmetic,
    ``num_embeddings * (head_dim + head_dim // 32)`` per layer."""
    layers = {lid: {"rows": r, **{f: r * row_bytes(dim, f, block) for f in formats}}
              for lid, r in rows.items()}
    total = {k: sum(x[k] for x in layers.values()) for k in ("rows", *formats)}
    return {"head_dim": dim, "scale_block": block, "layers": layers, "total": total,
            "row_bytes": {f: row_bytes(dim, f, block) for f in formats}}


# The fused read's scale table [2, 256]: every E8M0 code's fp32 value, as e8m0_to_float reads it,
# and that x 2^120 (infinite from code 135), the scale its vector steps fold 2^120 into.
_E8M0_FLOATS = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
E8M0_TABLE = torch.stack([_E8M0_FLOATS, _E8M0_FLOATS * 2.0 ** 120]).numpy()
