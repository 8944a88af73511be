"""int8 and int4 rows in GGUF's Q8_0 / Q4_0 blocks: the numerics of a table file's int8 and int4
dtypes (tables/tablefile.py), lossy as fp8 is (tables/fp8.py).

A row of e values is e / block blocks, each an fp16 scale d and then its values, byte for byte as
llama.cpp's ``block_q8_0`` and ``block_q4_0`` (ggml-common.h) at block 32, the default (a width
that 32 does not divide is one block a row): an int8 table file's rows are a GGUF Q8_0 tensor
[r, e] as they lie, and a row of width 32 is one block, 34 bytes in int8 and 18 in int4 (fp32 128;
272 and 144 at width 256, fp32 1,024). The scale sits beside its values, so a random row costs
one read of neighbouring bytes (one page of a cold file, rarely two), not two apart.

    int8 (Q8_0)  d, then q[0..block) as int8                               value = q * d
    int4 (Q4_0)  d, then block / 2 bytes, byte j holding q[j] in its low
                 nibble and q[j + block / 2] in its high one, q in 0..15    value = (q - 8) * d

Dequantising is exact in fp32 (an integer of at most 8 bits times an fp16 scale has at most 19
significant bits, and no product leaves fp32's normal range), so torch's ``dequantize_blocks``
and the fused read (tables/read_kernels.py) give the same bits in any order of operations.

Scales (measured: benchmarks/int_tables.py ``scale_choice``, blocks of 32 Gaussian, Student-t(4)
and Laplace values, squared error over the values' variance): int8 takes the absolute maximum,
d = amax / 127 (2.87e-5 on Gaussian values; the MSE-best clip of each block gains under 0.1%).
int4 takes Q4_0's, d = m / -8 for m the block's value of largest magnitude, which maps m to -8
exactly and so spends the sixteenth level (7.38e-3, against 9.42e-3 for a symmetric amax / 7).
The MSE-best clip per block would give 6.54e-3 (11% less), but clips a block's outliers by up
to several steps where this keeps every value within one, and searches dozens of scales a
block; whether it lowers the loss is the quality gate's to measure (issue 47), so it is not taken yet. d is
rounded to fp16 away from zero, so every value comes back within half a step (|d| / 2) in int8
and within one (|d|) in int4, where the value opposite the block's extreme may clip from +8 to
+7 as in Q4_0.

Shape legend: n rows, e row width, nb = e / block blocks per row, bb bytes per block,
rb = nb * bb bytes per row.
"""

from __future__ import annotations

import torch

from ..errors import UserError

KINDS = ("int8", "int4")  # the table file dtypes stored as blocks
FP16_MAX = 65504.0
EXTREME = {"int8": 127.0, "int4": -8.0}  # q the block's extreme value is mapped to (d = m / this)


def block_bytes(kind: str, block: int) -> int:
    """Bytes of one block: its fp16 scale and its values (a byte each, or a nibble)."""
    return 2 + (block if kind == "int8" else block // 2)


def row_bytes(kind: str, dim: int, block: int) -> int:
    """Bytes of one stored row of ``dim`` values in blocks of ``block``."""
    return dim // block * block_bytes(kind, block)


def check_block(kind: str, dim: int, block: int) -> None:
    """One line for a block the format cannot hold."""
    if kind not in KINDS:
        raise UserError(f"a block format is one of {KINDS}, got {kind!r}")
    if block <= 0 or dim % block:
        raise UserError(f"{kind} rows of width {dim} cannot be cut in blocks of {block}")
    if kind == "int4" and block % 2:
        raise UserError(f"int4 holds two values a byte: its blocks of {block} values (rows of "
                        f"width {dim}) must be even")


def quantize_blocks(x: torch.Tensor, kind: str, block: int, where: str = "rows") -> torch.Tensor:
    """x [n, e] -> the rows as stored, uint8 [n, rb]; values that are not finite, or too large
    for an fp16 scale, are refused in one line naming ``where``."""
    n, e = x.shape
    check_block(kind, e, block)
    xb = x.detach().float().view(n, e // block, block)  # [n, nb, block]
    if not bool(torch.isfinite(xb).all()):
        raise UserError(f"{where}: NaN or infinite values; {kind} rows hold finite values only")
    if kind == "int8":
        m = xb.abs().amax(-1)  # [n, nb]
    else:  # the signed value of largest magnitude (the first, on ties)
        m = xb.gather(-1, xb.abs().argmax(-1, keepdim=True)).squeeze(-1)  # [n, nb]
    d = m / EXTREME[kind]  # [n, nb]
    # fp16, rounded away from zero: |x| / |d| <= |EXTREME| in every block, so no value is clipped
    # past the format's own clip (to nearest, a scale among fp16's subnormals can lose a third)
    d16 = d.to(torch.float16)  # [n, nb]
    up = d16.float().abs() < d.abs()
    d16 = torch.where(up, (d16.view(torch.int16) + 1).view(torch.float16), d16)  # one ulp out
    if not bool(torch.isfinite(d16).all()):
        big = float(xb.abs().max())
        raise UserError(f"{where}: a value of magnitude {big:.6g} is past {kind}'s range with "
                        f"fp16 scales (|x| <= {FP16_MAX * abs(EXTREME[kind]):.6g})")
    df = d16.float().unsqueeze(-1)  # [n, nb, 1]
    q = torch.where(df != 0, xb / df, torch.zeros_like(xb)).round()  # [n, nb, block]
    if kind == "int8":
        payload = q.clamp(-127, 127).to(torch.int8).view(torch.uint8)  # [n, nb, block]
    else:
        u = (q.clamp(-8, 7) + 8).to(torch.uint8)  # [n, nb, block], 0..15
        half = block // 2
        payload = u[..., :half] | (u[..., half:] << 4)  # [n, nb, block / 2]
    scales = d16.contiguous().view(torch.uint8).view(n, e // block, 2)  # little-endian fp16
    return torch.cat([scales, payload], -1).reshape(n, row_bytes(kind, e, block))  # [n, rb]


def dequantize_blocks(raw: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """Rows as stored, uint8 [n, rb] -> fp32 [n, e]."""
    n, bb = raw.shape[0], block_bytes(kind, block)
    nb = raw.shape[1] // bb
    r = raw.reshape(n, nb, bb)  # [n, nb, bb]
    d = r[..., :2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    p = r[..., 2:]  # [n, nb, bb - 2]
    if kind == "int8":
        q = p.contiguous().view(torch.int8).float()  # [n, nb, block]
    else:
        q = torch.cat([p & 15, p >> 4], -1).float() - 8  # [n, nb, block]
    return (q * d).view(n, nb * block)


def check_stored(raw: torch.Tensor, kind: str, n: int, dim: int, block: int,
                 where: str) -> torch.Tensor:
    """Rows given already quantised, uint8 [n, rb] (e.g. a GGUF Q8_0 tensor's bytes): returned as
    they are after checking their shape and that every scale is finite."""
    rb = row_bytes(kind, dim, block)
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (n, rb):
        raise ValueError(f"{where}: {kind} rows given as stored must be uint8 {(n, rb)}, got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    d = raw.reshape(n, dim // block, -1)[..., :2].contiguous().view(torch.float16)
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{where}: a block's fp16 scale is NaN or infinite")
    return raw
