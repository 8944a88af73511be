"""fp8 rows with E8M0 scales (DeepSeek-V4.1's table format): codes and values written out by hand,
lossless re-quantisation, pre-quantised rows stored byte for byte, and every tier (memory, file
whole and windowed, pinned, shared, pool, behind a cache) serving them bit for bit."""

import numpy as np
import pytest
import torch

from engram import EngramConfig, MemoryTable, NgramHasher
from engram.tables.cache import CachedTable
from engram.tables.fp8 import (
    dequantize_fp8,
    e8m0_to_float,
    float_to_e8m0,
    quantize_fp8_e8m0,
    row_bytes,
    table_memory,
)
from engram.tables.pool import PoolRegion, write_pool
from engram.tables.tablefile import read_header, table_path, verify, write_table
from engram.tables.tiers import FileTable, PinnedTable, SharedPool

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
                          "bf16": 13 * 512, "fp32": 13 * 1024}
