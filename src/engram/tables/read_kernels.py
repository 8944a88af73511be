"""The numba kernels behind tables/fp8.py's ``StoredRows``: a table read that gathers the asked
rows and widens them to fp32 in one pass (fp8 E4M3 values times their block scales; bf16; int8
and int4 GGUF blocks, tables/blocks.py), so a
tier reads the 264 bytes of an FP8 + E8M0 row and writes its 1,024 fp32 bytes with no separate
fp8 -> fp32 conversion (torch's costs ~3 ns a value on CPU). Compiled on first call, cached on
disk next to this file (engram/compute/jit.py). Each kernel also checks the row ids (returning where the
first bad one is), so a tier's read of a decode step's rows pays for no separate numpy pass.

Every value is bit for bit what torch computes (``q.float() * scale``, tables/fp8.py
``dequantize_fp8``): an E4M3 value is exact in fp16 and fp32, so its product with the scale,
rounded once, is the whole dequantisation; bf16 -> fp32 is its bits moved up 16 places; an int8
or int4 value times its fp16 block scale is exact in fp32.

Shape legend: r rows in the table, e row width, nb = e / block scale blocks per row, n rows read,
rb bytes of an int8 / int4 row (its blocks).
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..compute.jit import kernel

LANES = 32  # values per vector step: one 32-byte load, two 16-lane fp32 stores (AVX-512)
AHEAD = 8  # rows ahead whose bytes are prefetched (a random row's cache misses overlap the work)
TWO_8 = np.float32(2.0 ** 8)  # fp16's exponent bias (15) minus E4M3's (7)
TWO_120 = 2.0 ** 120  # fp32's exponent bias (127) minus E4M3's (7)
X86 = platform.machine().lower() in ("x86_64", "amd64")
I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


@intrinsic
def e4m3_times(typingctx, byte, s):
    """An E4M3 byte (uint8) times s = scale x 2^8. The byte's sign, exponent and mantissa bits put
    where fp16 keeps them read as its value x 2^-8, exactly (E4M3 subnormals as fp16 ones), which
    the CPU widens to fp32 (vcvtph2ps, which reads fp16 subnormals whatever MXCSR says), so the
    one rounded product is value x scale's. 0x7F / 0xFF (NaN) give torch's NaN, sign | 0x7FF00000.
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


def _vector(ty, value):
    return ir.Constant(ir.VectorType(ty, LANES), [value] * LANES)


def _e4m3_lanes(folded: bool):
    @intrinsic
    def lanes(typingctx, data, r, col, out, i, s):
        def codegen(context, builder, sig, args):
            ptrs = []
            for k, at in ((0, (1, 2)), (3, (4, 2))):
                aryty = sig.args[k]
                ary = context.make_array(aryty)(context, builder, args[k])
                ptrs.append(cgutils.get_item_pointer(context, builder, aryty, ary,
                                                     [args[at[0]], args[at[1]]], wraparound=False))
            vi8, vi32, vf32 = (ir.VectorType(t, LANES) for t in (I8, I32, F32))
            b = builder.load(builder.bitcast(ptrs[0], vi8.as_pointer()), align=1)
            w = builder.and_(builder.shl(builder.sext(b, vi32), _vector(I32, 20)),
                             _vector(I32, 0x87F00000 - (1 << 32)))
            v = builder.bitcast(w, vf32)  # the value x 2^-120
            if not folded:
                v = builder.fmul(v, _vector(F32, TWO_120))
            one = builder.insert_element(ir.Constant(vf32, ir.Undefined), args[5],
                                         ir.Constant(I32, 0))
            s = builder.shuffle_vector(one, ir.Constant(vf32, ir.Undefined), _vector(I32, 0))
            builder.store(builder.fmul(v, s), builder.bitcast(ptrs[1], vf32.as_pointer()),
                          align=4)
            nan = builder.icmp_unsigned("==", builder.and_(b, _vector(I8, 0x7F)),
                                        _vector(I8, 0x7F))
            return builder.bitcast(nan, ir.IntType(LANES))
        return (types.uint32(data, types.intp, types.intp, out, types.intp, types.float32),
                codegen)
    return lanes


# out[i, col:col + LANES] = E4M3 bytes data[r, col:col + LANES] (uint8) times s, exactly where
# the CPU reads fp32 subnormals (``subnormals_read``); returns the lanes' NaN bytes as a bit mask
# (their values are wrong: the caller redoes the row). No bounds checks: the caller's.
#
# Explicit vectors (one 32-byte load, fp32 stores) rather than a numba loop: numba's slices kept
# wraparound and aliasing checks in every step of the row (2x slower). The byte's sign goes to
# bit 31, its exponent and mantissa to bits 26..20: the fp32 of those bits is the value x 2^-120,
# exactly (E4M3 subnormals as fp32 ones), so x 2^120 is the value, exactly, and x s the one
# rounding torch's product makes; any s (infinities, NaN, subnormals) as torch's. Measured
# faster than the fp16 route (vcvtph2ps) on Zen 4: 22 against 25 ns a 256-value row in L2.
e4m3_lanes = _e4m3_lanes(folded=False)
# The same with s = scale x 2^120 (exact below 2^8: E8M0 codes < FOLD_CODE; rows with a larger
# code are read value by value): one product a value instead of two, the one rounding the same
# (19 against 22 ns a row in L2, Zen 4; benchmarks/v41.py KERNEL_CHOICE).
e4m3_lanes_folded = _e4m3_lanes(folded=True)
FOLD_CODE = 135  # E8M0 2^(135 - 127) x 2^120 is past fp32's range


@intrinsic
def subnormals_read(typingctx):
    """True where fp32 subnormal operands are read as they are: x86 with MXCSR's DAZ bit clear
    (torch.set_flush_denormal(True) sets it; e4m3_lanes would then read E4M3 subnormals as 0).
    False elsewhere (other CPUs' flush modes are not read here): rows are then read value by
    value through fp16, which no flush mode touches."""
    def codegen(context, builder, sig, args):
        if not X86:
            return ir.Constant(ir.IntType(1), 0)
        slot = cgutils.alloca_once(builder, I32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer()]),
            "llvm.x86.sse.stmxcsr")
        builder.call(fn, [builder.bitcast(slot, I8.as_pointer())])
        daz = builder.and_(builder.load(slot), ir.Constant(I32, 0x40))
        return builder.icmp_unsigned("==", daz, ir.Constant(I32, 0))
    return types.boolean(), codegen


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
def exact_row(data, scales, scale_lut, k, out, i):
    """out[i] = row k of data times its block scales, value by value: each value exactly (through
    fp16), then its product with the scale; any block width, any flush mode, NaN bytes."""
    nb = scales.shape[1]
    block = data.shape[1] // nb
    src, sc, dst = data[k], scales[k], out[i]
    for j in range(nb):
        s = sc[j] if scale_lut is None else scale_lut[0, sc[j]]
        x, y = src[j * block:(j + 1) * block], dst[j * block:(j + 1) * block]
        for c in range(block):
            y[c] = e4m3_times(x[c], TWO_8) * s


@kernel()
def gather_fp8(data, scales, scale_lut, ids, out):
    """out[i] = row ids[i] of data [r, e] (E4M3 bytes as uint8) times its block scales: scales
    [r, nb] fp32, or E8M0 codes (uint8) read through scale_lut [2, 256] (fp32 2^(code - 127),
    and that x 2^120: fp8.E8M0_TABLE). Returns n, or the position of the first id outside
    [0, r) (rows before it are read)."""
    n, r, e, nb = ids.shape[0], data.shape[0], data.shape[1], scales.shape[1]
    block = e // nb
    # LANES-wide steps per block; 0: every row value by value (blocks of other widths, or the
    # CPU flushes subnormal operands), as the rare rows with a NaN byte are anyway
    per = block // LANES if block % LANES == 0 and subnormals_read() else 0
    for i in range(n):
        k = ids[i]
        if k < 0 or k >= r:
            return i
        if i + AHEAD < n:  # the row's first line (the CPU fetches the rest) and its scales:
            prefetch(data[ids[i + AHEAD]], 0)  # ~20% faster reads of random rows; each line
            prefetch(scales[ids[i + AHEAD]], 0)  # asked for is slower (measured, Zen 4)
        sc = scales[k]
        slow, a = np.uint32(per == 0), 0  # slow: or the row's NaN bytes
        for j in range(nb):  # (a second copy of this loop for per == 1 made both 15% slower)
            if scale_lut is None:  # (settled when compiled: fp32 scales)
                s = sc[j]
                for _ in range(per):
                    slow |= e4m3_lanes(data, k, a, out, i, s)
                    a += LANES
            else:  # E8M0: the code's scale x 2^120, where exact
                c = sc[j]
                slow |= np.uint32(c >= FOLD_CODE)
                s = scale_lut[1, c]
                for _ in range(per):
                    slow |= e4m3_lanes_folded(data, k, a, out, i, s)
                    a += LANES
        if slow:  # a call: inlined here, its loop slowed the row loop above by 6% (measured)
            exact_row(data, scales, scale_lut, k, out, i)
    return n


@kernel()
def gather_bf16(data, ids, out):
    """out[i] = row ids[i] of data [r, e] (bf16 bits as uint16) in fp32. Returns n, or the
    position of the first id outside [0, r)."""
    n, r = ids.shape[0], data.shape[0]
    for i in range(n):  # no prefetch: the CPU's own is faster here (measured)
        k = ids[i]
        if k < 0 or k >= r:
            return i
        src, dst = data[k], out[i]
        for c in range(src.shape[0]):
            dst[c] = bf16(src[c])
    return n


# -- int8 / int4 GGUF blocks (tables/blocks.py) ----------------------------------------------

@intrinsic
def half_at(typingctx, data, k, a):
    """The fp16 at bytes data[k, a], data[k, a + 1] (little-endian, any alignment) in fp32: exact,
    fp16's subnormals being fp32 normals, whatever MXCSR says (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]],
                                       wraparound=False)
        h = builder.load(builder.bitcast(ptr, I16.as_pointer()), align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), F32)
    return types.float32(data, types.intp, types.intp), codegen


def _block_lanes(int4: bool):
    @intrinsic
    def lanes(typingctx, data, k, a, out, i, col, d):
        def codegen(context, builder, sig, args):
            ptrs = []
            for at, idx in ((0, (1, 2)), (3, (4, 5))):
                aryty = sig.args[at]
                ary = context.make_array(aryty)(context, builder, args[at])
                ptrs.append(cgutils.get_item_pointer(context, builder, aryty, ary,
                                                     [args[idx[0]], args[idx[1]]],
                                                     wraparound=False))
            vf32 = ir.VectorType(F32, LANES)
            if int4:  # 16 bytes: low nibbles are values 0..15, high nibbles 16..31, each q - 8
                half = LANES // 2
                b = builder.load(builder.bitcast(ptrs[0], ir.VectorType(I8, half).as_pointer()),
                                 align=1)
                lo = builder.and_(b, ir.Constant(ir.VectorType(I8, half), [0x0F] * half))
                hi = builder.lshr(b, ir.Constant(ir.VectorType(I8, half), [4] * half))
                q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, LANES),
                                                               list(range(LANES))))
                q = builder.sub(q, _vector(I8, 8))  # -8..7
            else:
                q = builder.load(builder.bitcast(ptrs[0], ir.VectorType(I8, LANES).as_pointer()),
                                 align=1)
            v = builder.sitofp(q, vf32)  # exact
            one = builder.insert_element(ir.Constant(vf32, ir.Undefined), args[6],
                                         ir.Constant(I32, 0))
            s = builder.shuffle_vector(one, ir.Constant(vf32, ir.Undefined), _vector(I32, 0))
            builder.store(builder.fmul(v, s), builder.bitcast(ptrs[1], vf32.as_pointer()),
                          align=4)
            return context.get_dummy_value()
        return (types.none(data, types.intp, types.intp, out, types.intp, types.intp,
                           types.float32), codegen)
    return lanes


# out[i, col:col + 32] = the 32 values of the block whose values start at data[k, a] (int8
# bytes, or int4 nibbles in Q4_0's order) times d: one load, the integers widened to fp32 (exact)
# and one product each (exact too). No bounds checks: the caller's.
q8_lanes = _block_lanes(int4=False)
q4_lanes = _block_lanes(int4=True)


@kernel()
def gather_blocks(data, int4, block, ids, out):
    """out[i] = row ids[i] of data [r, rb] (int8 or, ``int4``, int4 GGUF blocks of ``block``
    values, as uint8) in fp32. Returns n, or the position of the first id outside [0, r) (rows
    before it are read). Blocks of 32 (GGUF's) go 32 values a step; others value by value."""
    n, r, e = ids.shape[0], data.shape[0], out.shape[1]
    nb = e // block
    step = 2 + (block // 2 if int4 else block)  # bytes a block
    half = block // 2
    vec = block == LANES
    for i in range(n):
        k = ids[i]
        if k < 0 or k >= r:
            return i
        if i + AHEAD < n:  # the row's first line; the CPU fetches the rest of a row's bytes
            prefetch(data[ids[i + AHEAD]], 0)
        for j in range(nb):
            a, col = j * step, j * block
            d = half_at(data, k, a)
            if vec and int4:
                q4_lanes(data, k, a + 2, out, i, col, d)
            elif vec:
                q8_lanes(data, k, a + 2, out, i, col, d)
            elif int4:
                for c in range(half):
                    b = np.int32(data[k, a + 2 + c])
                    out[i, col + c] = np.float32((b & 15) - 8) * d
                    out[i, col + half + c] = np.float32((b >> 4) - 8) * d
            else:
                for c in range(block):
                    b = np.int32(data[k, a + 2 + c])
                    out[i, col + c] = np.float32(b - 256 if b >= 128 else b) * d
    return n
