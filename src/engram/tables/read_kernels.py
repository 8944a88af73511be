"""The numba kernels behind tables/fp8.py's ``StoredRows``: a table read that gathers the asked
rows and widens them to fp32 in one pass (fp8 E4M3 values times their block scales; bf16), so a
tier reads the 264 bytes of an FP8 + E8M0 row and writes its 1,024 fp32 bytes with no separate
fp8 -> fp32 conversion (torch's costs ~3 ns a value on CPU). Compiled on first call, cached on
disk next to this file (engram/jit.py).

Every value is bit for bit what torch computes (``q.float() * scale``, tables/fp8.py
``dequantize_fp8``): an E4M3 value is exact in fp16 and fp32, so its product with the scale,
rounded once, is the whole dequantisation, and a multiply rounds the exact product whatever the
split of powers of two between its factors; bf16 -> fp32 is its bits moved up 16 places.

Shape legend: r rows in the table, e row width, nb = e / block scale blocks per row, n rows read.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel

LANES = 32  # values per inner loop: a constant trip count, so LLVM emits whole vectors only
AHEAD = 8  # rows ahead whose bytes are prefetched (a random row's cache misses overlap the work)
TWO_8 = np.float32(2.0 ** 8)  # fp16's exponent bias (15) minus E4M3's (7)
FOLD_MAX = np.float32(2.0 ** 120)  # |scale| below this: scale x 2^8 is finite, so exact
I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


@intrinsic
def e4m3_times(typingctx, byte, s):
    """An E4M3 byte (uint8) times s = scale x 2^8. The byte's sign, exponent and mantissa bits put
    where fp16 keeps them read as its value x 2^-8, exactly (E4M3 subnormals as fp16 ones), which
    the CPU widens to fp32 (vcvtph2ps), so the one rounded product is value x scale's. Integer
    work in 16-bit lanes and the NaN test on the byte (numba's own integer arithmetic would widen
    to 64 bits, a quarter of the vector). 0x7F / 0xFF (NaN) give torch's NaN, sign | 0x7FF00000.
    """
    def codegen(context, builder, sig, args):
        b = args[0]
        # sign to bit 15 (and 14, cleared), exponent and mantissa to bits 13..7
        h = builder.and_(builder.shl(builder.sext(b, I16), ir.Constant(I16, 7)),
                         ir.Constant(I16, 0xBF80 - (1 << 16)))
        v = builder.fpext(builder.bitcast(h, ir.HalfType()), F32)  # value x 2^-8, exact
        # a NaN byte read so far as +-1.875 x 2^-8 (0x3BF00000): OR-ing in the exponent makes it
        # torch's NaN, and NaN times a (non-NaN) scale is that NaN again
        nan = builder.bitcast(builder.or_(builder.bitcast(v, I32), ir.Constant(I32, 0x7FF00000)),
                              F32)
        is_nan = builder.icmp_unsigned("==", builder.and_(b, ir.Constant(I8, 0x7F)),
                                       ir.Constant(I8, 0x7F))
        return builder.fmul(builder.select(is_nan, nan, v), args[1])
    return types.float32(types.uint8, types.float32), codegen


@intrinsic
def bf16(typingctx, bits):
    """bf16 bits (uint16) -> fp32: the same bits, 16 places up (exact, NaNs and all)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], I32), ir.Constant(I32, 16)), F32)
    return types.float32(types.uint16), codegen


@intrinsic
def prefetch(typingctx, row, k):
    """Ask for the cache line holding row[k] (1-d array) ahead of its use (llvm.prefetch)."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(I32, 0), ir.Constant(I32, 3),
                          ir.Constant(I32, 1)])  # read, keep in all levels, data
        return context.get_dummy_value()
    return types.none(row, k), codegen


@kernel()
def gather_fp8(data, scales, scale_lut, ids, out):
    """out[i] = row ids[i] of data [r, e] (E4M3 bytes as uint8) times its block scales: scales
    [r, nb] fp32, or E8M0 codes (uint8) read through scale_lut [256] (fp32 2^(code - 127)).
    Blocks of a multiple of LANES values (gather_fp8_any takes any)."""
    n, e, nb = ids.shape[0], data.shape[1], scales.shape[1]
    block = e // nb
    for i in range(n):
        if i + AHEAD < n:  # the row's first line (the CPU fetches the rest) and its scales:
            prefetch(data[ids[i + AHEAD]], 0)  # ~20% faster reads of random rows; each line
            prefetch(scales[ids[i + AHEAD]], 0)  # asked for is slower (measured, Zen 4)
        src, sc, dst = data[ids[i]], scales[ids[i]], out[i]  # 1-d views: the loops vectorise
        huge, a = False, 0
        for j in range(nb):
            s = sc[j] if scale_lut is None else scale_lut[sc[j]]
            huge |= not abs(s) < FOLD_MAX  # (so is NaN) rare: the row is redone below
            s2 = s * TWO_8
            for _ in range(block // LANES):  # no branch in here: it is most of the time
                x, y = src[a:a + LANES], dst[a:a + LANES]
                for c in range(LANES):
                    y[c] = e4m3_times(x[c], s2)
                a += LANES
        if huge:  # inline: a call to another kernel here slows the loop above by half
            for j in range(nb):
                s = sc[j] if scale_lut is None else scale_lut[sc[j]]
                for c in range(j * block, (j + 1) * block):
                    dst[c] = e4m3_times(src[c], TWO_8) * s  # exact value, then the product


@kernel()
def gather_fp8_any(data, scales, scale_lut, ids, out):
    """gather_fp8 for blocks of any width: each value exactly, then its product with the scale
    (any scale: above 2^120, infinite or NaN too)."""
    nb = scales.shape[1]
    block = data.shape[1] // nb
    for i in range(ids.shape[0]):
        src, sc, dst = data[ids[i]], scales[ids[i]], out[i]
        for j in range(nb):
            s = sc[j] if scale_lut is None else scale_lut[sc[j]]
            x, y = src[j * block:(j + 1) * block], dst[j * block:(j + 1) * block]
            for c in range(block):
                y[c] = e4m3_times(x[c], TWO_8) * s


@kernel()
def gather_bf16(data, ids, out):
    """out[i] = row ids[i] of data [r, e] (bf16 bits as uint16) in fp32."""
    for i in range(ids.shape[0]):  # no prefetch: the CPU's own is faster here (measured)
        src, dst = data[ids[i]], out[i]
        for c in range(src.shape[0]):
            dst[c] = bf16(src[c])
