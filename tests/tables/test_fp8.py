"""fp8 rows with E8M0 scales (DeepSeek-V4.1's table format): codes and values written out by hand,
lossless re-quantisation, pre-quantised rows stored byte for byte, and every tier (memory, file
whole and windowed, pinned, shared, pool, behind a cache) serving them bit for bit. The fused read
(fp8.gather_rows) gives dequantize_fp8's bits for every byte, every E8M0 code and extreme fp32
scales, and bf16's for every bf16 pattern, on every registered tier, bare and behind cache and
prefetch."""

import re

import numpy as np
import pytest
import torch
from tier_params import tier_fronts

from engram import EngramConfig, MemoryTable, NgramHasher
from engram.tables.cache import CachedTable
from engram.tables.fp8 import (
    dequantize_fp8,
    e8m0_to_float,
    float_to_e8m0,
    gather_rows,
    quantize_fp8_e8m0,
    row_bytes,
    table_memory,
)
from engram.tables.pool import PoolRegion, write_pool
from engram.tables.prefetch import PrefetchTable
from engram.tables.registry import REGISTRY, TIERS, open_parts_on
from engram.tables.tablefile import read_header, table_path, verify, write_table
from engram.tables.tiers import FileTable, SharedPool
from engram.tables.host import HostTable, PinnedTable

CFG = EngramConfig(engram_vocab_size=211, max_ngram_size=3, n_embed_per_ngram=128,
                   n_head_per_ngram=2, layer_ids=[1], pad_id=0, profile="v4.1")
LOOKUP = np.arange(300) % 250
pytestmark = pytest.mark.usefixtures("one_thread")


def _by_hand(q, codes):
    """fp8 value x 2^(code - 127), per block of 32 (float64, then exactly fp32)."""
    s = torch.pow(2.0, codes.double() - 127).repeat_interleave(32, 1)
    return (q.double() * s).float()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A v4.1 layer's table as a V4.1 checkpoint stores it: fp8 rows and E8M0 codes, written as
    given (rows come in pre-quantised chunks, as an import streams them)."""
    hasher = NgramHasher(CFG, LOOKUP)
    n, e = hasher.num_rows(1), CFG.head_dim
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(n, e, generator=g) * 40).to(torch.float8_e4m3fn)
    codes = torch.randint(100, 150, (n, e // 32), generator=g, dtype=torch.uint8)
    path = table_path(tmp_path_factory.mktemp("e8m0"), 1)
    h = write_table(path, lambda a, b: (q[a:b], codes[a:b]), num_rows=n, dim=e, layer_id=1,
                    config=CFG, profile=hasher.profile(1), dtype="fp8", scale_format="e8m0",
                    chunk_rows=97)
    return path, h, q, codes, hasher


def test_codes_and_values_by_hand():
    codes = torch.arange(1, 255, dtype=torch.uint8)
    assert torch.equal(e8m0_to_float(codes).double(), torch.pow(2.0, codes.double() - 127))
    assert torch.equal(float_to_e8m0(e8m0_to_float(codes)), codes)
    assert float(e8m0_to_float(torch.tensor([0], dtype=torch.uint8))) == 0.0  # as the engine reads
    for bad in (0.75, 0.0, -2.0, float("inf"), float("nan"), 2.0 ** -130):
        with pytest.raises(ValueError, match="not a positive normal power of two"):
            float_to_e8m0(torch.tensor([1.0, bad]), "s")


def test_requantising_fp8_times_powers_of_two_is_lossless():
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(500, 64, generator=g) * 100).to(torch.float8_e4m3fn)
    codes = torch.randint(90, 160, (500, 2), generator=g, dtype=torch.uint8)
    x = _by_hand(q, codes)
    q2, c2 = quantize_fp8_e8m0(x, 32)
    assert torch.equal(dequantize_fp8(q2, c2), x)  # bytes may differ, the values do not
    assert bool((c2 <= codes).all())  # the smallest power of two that fits
    y = torch.randn(300, 64, generator=g) * torch.logspace(-3, 3, 300)[:, None]
    q3, c3 = quantize_fp8_e8m0(y, 32)
    amax = y.view(300, 2, 32).abs().amax(-1)
    s = e8m0_to_float(c3)
    assert bool((amax <= 448 * s).all() and (amax > 224 * s).all())
    torch.testing.assert_close(dequantize_fp8(q3, c3), y, rtol=0.07, atol=0)


def test_stored_byte_for_byte_and_one_byte_per_scale(table):
    path, h, q, codes, _ = table
    assert (h.dtype, h.scale_format, h.scale_block) == ("fp8", "e8m0", 32)
    raw = np.fromfile(path, dtype=np.uint8)
    n, e = q.shape
    assert np.array_equal(raw[h.data_offset:h.data_offset + n * e], q.view(torch.uint8).numpy()
                          .ravel())
    assert np.array_equal(raw[h.scale_offset:h.scale_offset + n * e // 32],
                          codes.numpy().ravel())
    assert h.file_size == h.scale_offset + n * e // 32 == raw.size
    assert read_header(path).scale_format == "e8m0"
    raw[h.scale_offset + 7] ^= 1  # a flipped scale byte is found
    bad = path.with_name("bad.table")
    raw.tofile(bad)
    with pytest.raises(ValueError, match="checksum mismatch in chunk 0"):
        verify(bad)


def test_every_tier_serves_the_rows_bit_for_bit(table, tmp_path):
    path, h, q, codes, hasher = table
    want = _by_hand(q, codes)
    memory = MemoryTable(*q.shape)
    file = FileTable(path, expect=(CFG, 1, hasher))
    with torch.no_grad():
        memory.weight.copy_(file.lookup(torch.arange(q.shape[0])))
    write_pool(tmp_path / "pool", {1: path})
    tiers = {"memory": memory, "file": file,
             "file-windows": FileTable(path, window_bytes=4096, max_windows=2),
             "pinned": PinnedTable(file, device="cpu"),
             "shared": SharedPool(path.parent, CFG, hasher).store(1),
             "pool": PoolRegion(tmp_path / "pool", expect=(CFG, hasher)).store(1),
             "file+cache": CachedTable(FileTable(path), capacity=50)}
    rows = torch.randint(0, q.shape[0], (3, 11, 4), generator=torch.Generator().manual_seed(2))
    for name, t in tiers.items():
        assert torch.equal(t.lookup(rows), want[rows]), name
        assert torch.equal(t.lookup(rows), want[rows]), name  # a second read (the cache's hits)


def test_bad_pre_quantised_rows_are_refused(tmp_path):
    q = torch.zeros(10, 64, dtype=torch.float8_e4m3fn)
    codes = torch.full((10, 2), 127, dtype=torch.uint8)
    kw = dict(num_rows=10, dim=64, layer_id=1, config=CFG, dtype="fp8", scale_format="e8m0")
    path = tmp_path / "t.table"
    with pytest.raises(ValueError, match=r"rows 0:10: E8M0 scale byte 255 \(NaN\)"):
        write_table(path, lambda a, b: (q[a:b], codes[a:b].clone().fill_(255)), **kw)
    with pytest.raises(ValueError, match="e8m0 scales must be torch.uint8"):
        write_table(path, lambda a, b: (q[a:b], codes[a:b].float()), **kw)
    with pytest.raises(ValueError, match="scale_format must be one of"):
        write_table(path, q.float(), **{**kw, "scale_format": "e4m3"})
    assert list(tmp_path.iterdir()) == []


def test_row_bytes_and_table_memory():
    assert [row_bytes(256, f) for f in ("fp8+e8m0", "fp8+fp32", "bf16", "fp32")] == [
        264, 288, 512, 1024]
    t = table_memory({1: 10, 14: 3}, 256)
    assert t["total"] == {"rows": 13, "fp8+e8m0": 13 * 264, "fp8+fp32": 13 * 288,
                          "bf16": 13 * 512, "fp32": 13 * 1024, "int8": 13 * 272,
                          "int4": 13 * 144}  # every format by default (issue 47)
    # GGUF Q8_0 / Q4_0: an fp16 scale and 32 values (a byte each, or a nibble) per block
    assert [row_bytes(32, f) for f in ("int8", "int4")] == [34, 18]
    assert [row_bytes(256, f) for f in ("int8", "int4")] == [272, 144]
    assert [row_bytes(48, f) for f in ("int8", "int4")] == [50, 26]  # 32 does not divide 48
    t = table_memory({1: 10}, 32, formats=("fp32", "int8", "int4"))
    assert t["row_bytes"] == {"fp32": 128, "int8": 34, "int4": 18}
    assert t["total"] == {"rows": 10, "fp32": 1280, "int8": 340, "int4": 180}


def test_row_bytes_are_the_table_files_bytes(tmp_path):
    """row_bytes of int8 / int4 is what a table file stores a row in (its header's row_bytes)."""
    rows = torch.randn(7, 64)
    for kind in ("int8", "int4"):
        h = write_table(tmp_path / f"{kind}.table", rows, layer_id=1, config=CFG, dtype=kind)
        assert h.row_bytes == row_bytes(64, kind)


# -- the fused read: gather + dequantise in one pass ------------------------------------------------

def _bits(x):
    return x.view(torch.int32)


# fp32 scales at the edges: zeros, fp32 subnormals, the smallest normal, around 2^8 (where the
# kernel stops folding 2^120 into the scale), the largest, negatives, infinities and NaN.
EXTREME_FP32 = [0.0, -0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -100, 0.37, 1.0, -5.5, 255.99998,
                256.0, 1e30, 3.4028234e38, -3.4028234e38, float("inf"), -float("inf"),
                float("nan")]


def _nan_in_even_rows(q):
    """E4M3 bytes [r, e] (uint8) -> float8 rows [2r, e]: rows 2k and 2k+1 hold q[k]'s bytes,
    2k with a NaN pair first, 2k+1 with none (its NaN bytes made +-448), so the kernel's vector
    steps are checked on every byte in rows it does not redo value by value (it redoes a row
    holding a NaN byte)."""
    q = q.repeat_interleave(2, 0)
    q[::2, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    odd = q[1::2]
    odd[(odd & 0x7F) == 0x7F] ^= 1
    return q.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dim,block", [(256, 32), (256, 16), (64, 64), (40, 40), (96, 32)])
def test_fused_read_equals_dequantize_bit_for_bit(dim, block):
    """Every E4M3 byte (NaN 0x7F / 0xFF included) under every E8M0 code (0: zero, 1: products
    fp32 subnormals, 254, 255: infinity) and extreme fp32 scales; blocks of every shape the
    kernel splits differently. Bits, so NaNs and signed zeros count."""
    nb = dim // block
    q = _nan_in_even_rows((torch.arange(128 * dim) % 256).to(torch.uint8).view(128, dim))
    codes = ((torch.arange(256)[:, None] + 37 * torch.arange(nb)) % 256).to(torch.uint8)
    codes[0] = 255  # a whole row at infinity
    ids = torch.cat([torch.arange(256), torch.randint(0, 256, (300,),
                                                    generator=torch.Generator().manual_seed(0))])
    assert torch.equal(_bits(gather_rows(q, codes, ids)), _bits(dequantize_fp8(q[ids], codes[ids])))
    fp32 = torch.tensor(EXTREME_FP32)[torch.arange(256 * nb).view(256, nb) % len(EXTREME_FP32)]
    got, want = gather_rows(q, fp32, ids), dequantize_fp8(q[ids], fp32[ids])
    both_nan = got.isnan() & want.isnan()  # NaN x NaN: which operand's NaN comes out is the CPU's
    nan_scale = fp32[ids].repeat_interleave(block, 1).isnan() & q[ids].float().isnan()
    assert torch.equal(both_nan, got.isnan()) and torch.equal(both_nan, want.isnan())
    assert torch.equal(_bits(got)[~nan_scale], _bits(want)[~nan_scale])
    assert torch.equal(_bits(gather_rows(q, codes, None)), _bits(dequantize_fp8(q, codes)))
    out = torch.full((7, dim), 9.0)
    assert gather_rows(q, codes, ids[:7], out=out) is out
    assert torch.equal(_bits(out), _bits(dequantize_fp8(q[ids[:7]], codes[ids[:7]])))
    assert gather_rows(q, codes, ids[:0]).shape == (0, dim)


def test_fused_read_when_the_cpu_flushes_subnormals():
    """torch.set_flush_denormal(True) (x86's DAZ) makes fp32 subnormal operands read as 0: the
    kernel's vector steps would read E4M3 subnormals as 0, so it reads value by value then and
    gives torch's values in that mode too (a scale that is an fp32 subnormal reads as 0 in both)."""
    q = _nan_in_even_rows((torch.arange(128 * 64) % 256).to(torch.uint8).view(128, 64))
    codes = ((torch.arange(256)[:, None] + 37 * torch.arange(2)) % 255).to(torch.uint8)
    fp32 = torch.tensor(EXTREME_FP32[:-1])[torch.arange(512).view(256, 2) % 16]  # no NaN
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        for sc in (codes, fp32):
            want = dequantize_fp8(q[ids], sc[ids])
            assert torch.equal(_bits(gather_rows(q, sc, ids)), _bits(want))
        assert bool((dequantize_fp8(q[1:2], codes[1:2])[0, :8] == 0).all())  # the mode is on
    finally:
        torch.set_flush_denormal(False)
    assert not bool((dequantize_fp8(q[1:2], codes[1:2])[0, 1:8] == 0).any())


@pytest.mark.parametrize("stored", ["fp8+e8m0", "fp8+fp32", "bf16", "fp32"])
def test_fused_read_refuses_ids_outside_the_rows(stored):
    """The kernels check ids as they read (tiers leave it to them): one line naming the range,
    as the torch path gives it."""
    x = torch.randn(10, 64)
    q, codes = quantize_fp8_e8m0(x, 32)
    data, sc = {"fp8+e8m0": (q, codes), "fp8+fp32": (q, e8m0_to_float(codes)),
                "bf16": (x.bfloat16(), None), "fp32": (x, None)}[stored]
    for ids, got in (([3, 10, 2], "[2, 10]"), ([0, -1], "[-1, 0]"), ([-5], "[-5, -5]")):
        with pytest.raises(IndexError, match=re.escape(f"row ids must be in [0, 10), got {got}")):
            gather_rows(data, sc, torch.tensor(ids))
    assert torch.equal(gather_rows(data, sc, torch.tensor([9, 0])), gather_rows(data, sc, None)[[9, 0]])


def test_fused_bf16_read_and_other_dtypes():
    """Every bf16 bit pattern widens to the fp32 torch gives; fp32, fp16 and other output dtypes
    read as the plain gather and cast would."""
    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(256, 256)
    bf = bf.view(torch.bfloat16)
    ids = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_bits(gather_rows(bf, None, ids)), _bits(bf[ids].float()))
    assert torch.equal(_bits(gather_rows(bf, None, None)), _bits(bf.float()))
    x = torch.randn(50, 64)
    assert torch.equal(gather_rows(x, None, ids % 50), x[ids % 50])
    assert torch.equal(gather_rows(x.half(), None, ids % 50), x.half()[ids % 50].float())
    assert torch.equal(gather_rows(bf, None, ids, torch.bfloat16).view(torch.int16),
                       bf[ids].view(torch.int16))
    q, codes = quantize_fp8_e8m0(x, 32)
    assert torch.equal(gather_rows(q, codes, ids % 50, torch.bfloat16),
                       dequantize_fp8(q[ids % 50], codes[ids % 50]).bfloat16())


FORMATS = {"fp8+e8m0": ("fp8", "e8m0"), "fp8+fp32": ("fp8", "fp32"), "bf16": ("bf16", "fp32")}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def edge_table(request, tmp_path_factory):
    """A v4.1 layer's table file holding every byte value (NaN bytes too) under edge scales:
    E8M0 codes 0 (zero), 1 and 2 (fp32 subnormal products) up to 254, or the extreme fp32 scales
    (finite: a table file's scales are); bf16 rows hold every bf16 pattern. -> (folder, hasher,
    the rows every tier must give [r, e], by torch's dequantisation)."""
    dtype, fmt = FORMATS[request.param]
    hasher = NgramHasher(CFG, LOOKUP)
    n, e = hasher.num_rows(1), CFG.head_dim
    folder = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    kw = {"num_rows": n, "dim": e, "layer_id": 1, "config": CFG, "profile": hasher.profile(1),
          "dtype": dtype, "scale_format": fmt, "chunk_rows": 97}
    if dtype == "bf16":
        x = (torch.arange(n * e) * 7 % 65536 - 32768).to(torch.int16).view(n, e).view(torch.bfloat16)
        write_table(table_path(folder, 1), x, **kw)
        return folder, hasher, x.float()
    half = (n + 1) // 2
    q = _nan_in_even_rows((torch.arange(half * e) % 256).to(torch.uint8).view(half, e))[:n]
    if fmt == "e8m0":
        edge = torch.tensor([0, 1, 2, 3, 60, 100, 119, 127, 134, 135, 136, 200, 253, 254])
        sc = edge[torch.arange(n * e // 32) % edge.numel()].view(n, e // 32).to(torch.uint8)
    else:
        finite = torch.tensor([v for v in EXTREME_FP32 if np.isfinite(v)])
        sc = finite[torch.arange(n * e // 32) % finite.numel()].view(n, e // 32)
    write_table(table_path(folder, 1), lambda a, b: (q[a:b], sc[a:b]), **kw)
    return folder, hasher, dequantize_fp8(q, sc)


@pytest.mark.parametrize("tier,front", tier_fronts())
def test_every_tier_reads_edge_rows_bit_for_bit(tier, front, edge_table):
    folder, hasher, want = edge_table
    if REGISTRY[tier].missing():
        pytest.skip(f"tier {tier} cannot open on this machine: {REGISTRY[tier].missing()}")
    opened = open_parts_on(tier, folder, CFG, hasher)
    try:
        store = opened.parts[("cold", 1)]
        if tier == "memory":  # fp8 and bf16 rows stay as stored: gathered + dequantised per read
            assert isinstance(store, HostTable) and store.nbytes < want.numel() * 4 * 0.6
        if front != "bare":
            store = PrefetchTable(CachedTable(store, 60, hot_rows=torch.arange(0, 890, 31)))
        g = torch.Generator().manual_seed(3)
        for rows in (torch.arange(want.shape[0]), torch.randint(0, 890, (5, 13, 2), generator=g),
                     torch.arange(0, 890, 31), torch.randint(0, 890, (40,), generator=g)):
            store.prefetch(rows)
            assert torch.equal(_bits(store.lookup(rows)), _bits(want[rows])), (tier, front)
        for bad in ([5, 890], [3, -1]):  # one line (a sharded tier names the rank)
            with pytest.raises(IndexError, match=re.escape("[0, 890)")):
                store.lookup(torch.tensor(bad))
    finally:
        opened.close()


def test_file_variants_read_edge_rows_bit_for_bit(edge_table):
    folder, _, want = edge_table
    path = table_path(folder, 1)
    rows = torch.randint(0, 890, (3000,), generator=torch.Generator().manual_seed(4))
    for t in (FileTable(path, window_bytes=4096, max_windows=2),
              FileTable(path, io_threads=3, min_split_rows=16)):
        assert torch.equal(_bits(t.lookup(rows)), _bits(want[rows]))
        t.close()
    t = FileTable(path, out_dtype=torch.bfloat16)  # cast as torch casts (NaN payloads aside)
    got, cast = t.lookup(rows).float(), want[rows].bfloat16().float()
    assert torch.equal(got.isnan(), cast.isnan()) and torch.equal(got[~got.isnan()],
                                                                 cast[~cast.isnan()])
    t.close()
