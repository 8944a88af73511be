"""int8 and int4 rows in GGUF's Q8_0 / Q4_0 blocks (tables/blocks.py): bytes read as llama.cpp lays
the blocks out (numpy's view of its block structs, decoded by hand), the fused read giving torch's
dequantisation bit for bit for every byte under edge scales (blocks of 32 and of other widths),
the round trip within the format's step and re-quantisation lossless, table files of both kinds
served by every registered tier bit for bit as the memory tier's dequantised rows (bare and behind
cache and prefetch; windowed and threaded files), the export, and a newer format version, bad
rows and bad widths refused in one line."""

import re

import numpy as np
import pytest
import torch
from tier_params import tier_fronts

from engram import EngramConfig, EngramLM, MemoryTable, NgramHasher
from engram.artifacts.table_files import export_tables
from engram.errors import UserError
from engram.commandline.schema import constant
from engram.tables.blocks import check_stored, dequantize_blocks, quantize_blocks, row_bytes
from engram.tables.cache import CachedTable
from engram.tables.fp8 import gather_rows
from engram.tables.host import HostTable
from engram.tables.pool import PoolError, PoolRegion, write_pool
from engram.tables.prefetch import PrefetchTable
from engram.tables.registry import REGISTRY, TIERS, open_parts_on
from engram.tables.tablefile import TableFileError, read_header, table_path, write_table
from engram.tables.tiers import FileTable, open_tables
from engram.training.train import TrainConfig

LOOKUP = np.arange(300) % 250
KINDS = ("int8", "int4")
pytestmark = pytest.mark.usefixtures("one_thread")

# fp16 scales at the edges: zeros, fp16's smallest subnormal, its smallest normal, its largest,
# negatives (Q4_0's scales are negative whenever a block's extreme is positive)
EDGE_FP16 = [0.0, -0.0, 2.0 ** -24, 3 * 2.0 ** -24, 2.0 ** -14, 1e-3, 0.37, 1.0, -1.0, -5.5,
             1000.0, 65504.0, -65504.0]


def _gguf(kind, block):
    """numpy's dtype of one block as llama.cpp's block_q8_0 / block_q4_0 (ggml-common.h) lays it
    out at block 32: an fp16 scale, then the values (int8 each, or two 4-bit ones a byte)."""
    return np.dtype([("d", "<f2"), ("qs", "i1" if kind == "int8" else "u1",
                                     (block if kind == "int8" else block // 2,))])


def _by_hand(raw, kind, block):
    """Rows as stored [n, rb] -> float32 [n, e], decoded as llama.cpp's dequantize_row_q8_0 /
    _q4_0 do (byte j: value j in its low nibble, value j + block/2 in its high one, both - 8)."""
    b = np.ascontiguousarray(raw.numpy()).view(_gguf(kind, block))  # [n, nb] blocks
    d = b["d"].astype(np.float64)[..., None]  # [n, nb, 1]
    if kind == "int8":
        q = b["qs"].astype(np.float64)
    else:
        qs = b["qs"].astype(np.int64)
        q = np.concatenate([(qs & 0x0F) - 8, (qs >> 4) - 8], -1).astype(np.float64)
    return torch.from_numpy((q * d).reshape(raw.shape[0], -1).astype(np.float32))  # exact


def _edge_rows(kind, n, dim, block, scales=EDGE_FP16):
    """Stored rows [n, rb] holding every byte value in turn, under the edge scales in turn."""
    rb, nb = row_bytes(kind, dim, block), dim // block
    raw = (torch.arange(n * rb) * 7 % 256).to(torch.uint8).view(n, nb, rb // nb)
    d = torch.tensor(scales, dtype=torch.float16)[torch.arange(n * nb) % len(scales)]
    raw[..., :2] = d.view(n, nb).contiguous().view(torch.uint8).view(n, nb, 2)
    return raw.view(n, rb)


def _bits(x):
    return x.view(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim,block", [(32, 32), (256, 32), (16, 16), (48, 48), (64, 64)])
def test_blocks_read_as_gguf_lays_them_out_bit_for_bit(kind, dim, block):
    """torch's dequantisation and the fused read (32 values a step at block 32, value by value
    otherwise) both equal the by-hand decode, for every byte value under every edge scale."""
    raw = _edge_rows(kind, 257, dim, block)
    assert raw.shape[1] == dim // block * _gguf(kind, block).itemsize
    want = _by_hand(raw, kind, block)
    assert torch.equal(_bits(dequantize_blocks(raw, kind, block)), _bits(want))
    ids = torch.cat([torch.arange(257), torch.randint(0, 257, (300,),
                                                    generator=torch.Generator().manual_seed(0))])
    assert torch.equal(_bits(gather_rows(raw, None, ids, blocks=(kind, block))), _bits(want[ids]))
    assert torch.equal(_bits(gather_rows(raw, None, None, blocks=(kind, block))), _bits(want))
    out = torch.full((7, dim), 9.0)
    assert gather_rows(raw, None, ids[:7], out=out, blocks=(kind, block)) is out
    assert torch.equal(_bits(out), _bits(want[ids[:7]]))
    bf = gather_rows(raw, None, ids, torch.bfloat16, blocks=(kind, block))  # torch's path, cast
    assert torch.equal(bf.view(torch.int16), want[ids].bfloat16().view(torch.int16))
    assert gather_rows(raw, None, ids[:0], blocks=(kind, block)).shape == (0, dim)
    for bad, got in (([3, 257, 2], "[2, 257]"), ([0, -1], "[-1, 0]")):
        with pytest.raises(IndexError, match=re.escape(f"row ids must be in [0, 257), got {got}")):
            gather_rows(raw, None, torch.tensor(bad), blocks=(kind, block))


@pytest.mark.parametrize("kind", KINDS)
def test_infinite_scales_read_as_torch_reads_them(kind):
    """Scales no writer stores (a file's are checked finite), read alike all the same: inf x 0 is
    NaN in both, every other value the same bits."""
    raw = _edge_rows(kind, 64, 64, 32, [float("inf"), -float("inf"), 2.0, -0.0])
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(1))
    got = gather_rows(raw, None, ids, blocks=(kind, 32))
    want = dequantize_blocks(raw[ids], kind, 32)
    assert bool(got.isinf().any()) and bool(got.isnan().any())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(_bits(got)[~got.isnan()], _bits(want)[~want.isnan()])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [32, 16])
def test_round_trip_within_a_step_and_requantising_is_lossless(kind, block):
    """Every value comes back within half its block's step in int8 and one step in int4 (Q4_0:
    the value opposite the block's extreme may clip from +8 to +7), at magnitudes from far
    below fp16's normal scales up to the largest an fp16 scale holds; the block's extreme is
    exact to fp16's precision; quantising the dequantised rows gives the same bytes (fp16-normal
    scales: a re-export or a GGUF import keeps the rows)."""
    g = torch.Generator().manual_seed(2)
    mags = torch.logspace(-10, 5, 300)[:, None] * (1 if kind == "int8" else 0.06)
    x = torch.randn(300, 64, generator=g) * mags
    x[5] = 0.0  # a zero row
    x[7, 3] = 1e3 * mags[7, 0]  # a block with one outlier
    raw = quantize_blocks(x, kind, block)
    y = _by_hand(raw, kind, block)
    nb = 64 // block
    d = raw.view(300, nb, -1)[..., :2].contiguous().view(torch.float16).float().abs()  # [r, nb, 1]
    err = (y - x).abs().view(300, nb, block)
    assert bool((err <= d * (0.5 if kind == "int8" else 1.0) * (1 + 2 ** -20)).all())
    assert bool((err[5] == 0).all())
    normal = (d >= 2.0 ** -14).view(300, nb).all(-1)  # [r]
    again = quantize_blocks(y, kind, block)
    assert torch.equal(again[normal], raw[normal])
    assert bool(normal[200:].all()) and int(normal.sum()) > 100


@pytest.mark.parametrize("kind", KINDS)
def test_bad_rows_and_widths_are_refused_in_one_line(kind, tmp_path):
    kw = dict(layer_id=0, config=EngramConfig(engram_vocab_size=101, max_ngram_size=2,
                                              n_embed_per_ngram=32, n_head_per_ngram=1,
                                              layer_ids=[0]), dtype=kind)
    x = torch.randn(40, 64)
    for bad, msg in ((float("nan"), "rows 0:40: NaN or infinite values"),
                     (float("inf"), "rows 0:40: NaN or infinite values"),
                     (1e9, f"rows 0:40: a value of magnitude 1e\\+09 is past {kind}'s range")):
        y = x.clone()
        y[9, 3] = bad
        with pytest.raises(UserError, match=msg) as e:
            write_table(tmp_path / "t.table", y, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="must be even") if kind == "int4" else _nothing():
        write_table(tmp_path / "odd.table", torch.randn(10, 15), **kw)
    raw = quantize_blocks(x, kind, 32)
    with pytest.raises(ValueError, match=f"rows 0:40: {kind} rows given as stored must be uint8"):
        write_table(tmp_path / "t.table", lambda a, b: raw[a:b, :-1], num_rows=40, dim=64, **kw)
    inf = raw.clone()
    inf[2, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # fp16 +inf
    with pytest.raises(ValueError, match="rows 0:40: a block's fp16 scale is NaN or infinite"):
        write_table(tmp_path / "t.table", lambda a, b: inf[a:b], num_rows=40, dim=64, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["odd.table"] if kind == "int8" else [])
    with pytest.raises(ValueError, match="must be uint8"):
        check_stored(raw.float(), kind, 40, 64, 32, "rows")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_command_line_offers_both_kinds():
    """engram export-tables / generate --table_dtype read their choices from tablefile.DTYPES."""
    assert {"int8", "int4"} <= set(constant("engram.tables.tablefile:DTYPES"))


# -- table files on every tier -------------------------------------------------------------------

def _cfg(dim):
    return EngramConfig(engram_vocab_size=211, max_ngram_size=3, n_embed_per_ngram=2 * dim,
                        n_head_per_ngram=2, layer_ids=[1], pad_id=0)


@pytest.fixture(scope="module", params=[(k, d) for k in KINDS for d in (64, 48)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def table(request, tmp_path_factory):
    """A layer's table file of rows given as stored, every byte value under edge scales (width
    64: GGUF's blocks of 32; 48: one block a row, read value by value) -> (folder, config,
    hasher, the memory tier's dequantised rows [r, e], bytes a row)."""
    kind, dim = request.param
    cfg = _cfg(dim)
    hasher = NgramHasher(cfg, LOOKUP)
    n, block = hasher.num_rows(1), 32 if dim % 32 == 0 else dim
    raw = _edge_rows(kind, n, dim, block)
    folder = tmp_path_factory.mktemp(f"{kind}-{dim}")
    h = write_table(table_path(folder, 1), lambda a, b: raw[a:b], num_rows=n, dim=dim,
                    layer_id=1, config=cfg, profile=hasher.profile(1), dtype=kind,
                    chunk_rows=97)
    assert (h.dtype, h.scale_block, h.scale_format, h.scale_offset) == (kind, block, "fp16", None)
    assert h.row_bytes == raw.shape[1] and h.file_size == h.data_offset + n * raw.shape[1]
    data = np.fromfile(table_path(folder, 1), np.uint8)[h.data_offset:]
    assert np.array_equal(data, raw.numpy().ravel())  # the rows' bytes as given: GGUF's tensor
    return folder, cfg, hasher, dequantize_blocks(raw, kind, block), raw.shape[1]


# tiers whose stores read table files' rows as stored (tables.store.StoredReads)
HELD_AS_STORED = ("file", "shared", "pool")


@pytest.mark.parametrize("tier,front", tier_fronts())
def test_every_tier_serves_the_memory_tiers_rows_bit_for_bit(tier, front, table):
    folder, cfg, hasher, want, rb = table
    if REGISTRY[tier].missing():
        pytest.skip(f"tier {tier} cannot open on this machine: {REGISTRY[tier].missing()}")
    n = want.shape[0]
    oracle = MemoryTable(*want.shape)  # the memory tier's dequantised rows
    with torch.no_grad():
        oracle.weight.copy_(want)
    opened = open_parts_on(tier, folder, cfg, hasher)
    try:
        store = opened.parts[("cold", 1)]
        if tier == "memory":  # kept as stored: the rows' bytes, gathered + dequantised per read
            assert isinstance(store, HostTable) and store.nbytes == n * rb
        if front != "bare":
            cache = CachedTable(store, 60, hot_rows=torch.arange(0, n, 31))
            if tier in HELD_AS_STORED:  # the cache holds the file's bytes, not fp32 (issue 47)
                assert cache.values.dtype == torch.uint8 and cache.nbytes == 60 * rb, tier
            store = PrefetchTable(cache)
        g = torch.Generator().manual_seed(3)
        for rows in (torch.arange(n), torch.randint(0, n, (5, 13, 2), generator=g),
                     torch.arange(0, n, 31), torch.randint(0, n, (40,), generator=g)):
            store.prefetch(rows)
            got = store.lookup(rows).cpu()
            assert torch.equal(_bits(got), _bits(oracle.lookup(rows).detach())), (tier, front)
        for bad in ([5, n], [3, -1]):  # one line (a sharded tier names the rank)
            with pytest.raises(IndexError, match=re.escape(f"[0, {n})")):
                store.lookup(torch.tensor(bad))
    finally:
        opened.close()


def test_file_variants_serve_the_rows_bit_for_bit(table):
    folder, _, _, want, _ = table
    path = table_path(folder, 1)
    rows = torch.randint(0, want.shape[0], (3000,), generator=torch.Generator().manual_seed(4))
    for t in (FileTable(path, window_bytes=4096, max_windows=2),
              FileTable(path, io_threads=3, min_split_rows=16)):
        assert torch.equal(_bits(t.lookup(rows)), _bits(want[rows]))
        t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_export_from_a_model_round_trips(kind, tmp_path):
    tc = TrainConfig(n_layer=2, d_model=32, n_head=2, table_size=60, n_embed_per_ngram=64,
                     n_head_per_ngram=2, engram_layers=(0,))
    torch.manual_seed(0)
    model = EngramLM(tc.model_config(vocab_size=50))
    h = NgramHasher(tc.engram_config(), LOOKUP)
    export_tables(model, tmp_path, hasher=h, dtype=kind)
    w = model.engrams()[0].table.weight.detach()
    t = open_tables(tmp_path, tc.engram_config(), h)[0]
    assert (t.header.dtype, t.header.row_bytes) == (kind, {"int8": 34, "int4": 18}[kind])
    assert torch.equal(t.lookup(torch.arange(t.num_rows)),
                       dequantize_blocks(quantize_blocks(w, kind, 32), kind, 32))
    kept = []  # a rerun keeps the file holding these rows
    export_tables(model, tmp_path, hasher=h, dtype=kind, kept=kept)
    assert kept


def _set_version(path, offset, version):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(int(version).to_bytes(4, "little"))


def test_versions_an_older_reader_is_refused_in_one_line(table, tmp_path):
    """Files are written at the oldest version that holds them (int8 / int4: 2, the rest 1), so
    an older engram keeps reading fp32 to fp8 files and refuses int ones; this one refuses a
    newer version, and a pool holding int rows, in one line."""
    folder, cfg, hasher, want, _ = table
    path = table_path(folder, 1)
    assert np.fromfile(path, "<u4", count=3)[2] == 2  # magic (8 bytes), then the version
    fp32 = write_table(tmp_path / "f.table", want, layer_id=1, config=cfg)
    assert fp32.version == 1 and np.fromfile(tmp_path / "f.table", "<u4", count=3)[2] == 1
    newer = tmp_path / "newer.table"
    newer.write_bytes(path.read_bytes())
    _set_version(newer, 8, 3)
    with pytest.raises(TableFileError, match=re.escape(
            f"{newer}: table format version 3, written by a newer engram; this one reads "
            "versions 1 to 2 (upgrade engram to read it)")) as e:
        FileTable(newer)
    assert "\n" not in str(e.value)
    _set_version(newer, 8, 1)  # int rows under version 1: a header no version-1 file has
    with pytest.raises(TableFileError, match="inconsistent header"):
        read_header(newer)
    write_pool(tmp_path / "pool", {1: path})
    assert np.fromfile(tmp_path / "pool", "<u4", count=3)[2] == 2
    _set_version(tmp_path / "pool", 8, 3)
    with pytest.raises(PoolError, match="pool version 3, this engram reads 1 to 2"):
        PoolRegion(tmp_path / "pool")
