"""Table files: round trips per dtype, export from a model and a checkpoint, corruption, truncation,
mismatched configs and hash profiles, missing files, and atomic publish under concurrent readers."""

import dataclasses
import os
import threading

import numpy as np
import pytest
import torch

from engram import EngramConfig, EngramLM, MemoryTable, NgramHasher
from engram.artifacts.checkpoint import save_checkpoint
from engram.tables.tablefile import (
    TableFileError,
    check_compatible,
    read_header,
    table_path,
    verify,
    write_table,
)
from engram.tables.tiers import FileTable, open_tables
from engram.training.run_tables import export_tables
from engram.training.train import TrainConfig

CFG = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=64,
                   n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0)
LOOKUP = np.arange(300) % 250


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hasher():
    return NgramHasher(CFG, LOOKUP)


@pytest.fixture(scope="module")
def weight():
    w = torch.randn(CFG_ROWS, CFG.head_dim, generator=torch.Generator().manual_seed(0))
    w[3] *= 100  # a row with a large range, so fp8's per-block scales matter
    return w


CFG_ROWS = NgramHasher(CFG, LOOKUP).num_rows(0)


def _write(path, w, hasher, dtype="fp32", **kw):
    return write_table(path, w, layer_id=0, config=CFG, profile=hasher.profile(0),
                       dtype=dtype, **kw)


def _fp8_reference(w, block):
    """fp8 e4m3 with one scale per block of ``block`` values: amax / 448 (written out here)."""
    n, e = w.shape
    blocks = w.view(n, e // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale).to(torch.float8_e4m3fn).float()
    return (q * scale).view(n, e)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8"])
def test_round_trip_equals_memory_table(tmp_path, hasher, weight, dtype):
    path = tmp_path / "t.table"
    header = _write(path, weight, hasher, dtype, chunk_rows=50, scale_block=8)
    stored = {"fp32": weight, "bf16": weight.bfloat16().float(), "fp16": weight.half().float(),
              "fp8": _fp8_reference(weight, 8)}[dtype]
    oracle = MemoryTable(*weight.shape)
    with torch.no_grad():
        oracle.weight.copy_(stored)
    table = FileTable(path)
    rows = torch.randint(0, weight.shape[0], (3, 5, 8))
    assert torch.equal(table.lookup(rows), oracle.lookup(rows))
    assert torch.equal(table.lookup(torch.arange(weight.shape[0])), stored)
    if dtype == "fp8":  # per-block scales keep every row within fp8's relative precision
        tol = 0.07 * weight.abs().amax(-1, True).min()
        assert torch.allclose(stored, weight, rtol=0.07, atol=tol)
    h = read_header(path)
    assert (h.layer_id, h.num_rows, h.dim, h.dtype) == (0, weight.shape[0], 64 // 4, dtype)
    assert h.engram_config == CFG.to_dict() and h.hash_profile == hasher.profile(0)
    assert h.data_offset % 4096 == 0 and len(h.chunks) == -(-weight.shape[0] // 50)
    assert header == h


def test_export_from_model_and_checkpoint(tmp_path, hasher):
    tc = TrainConfig(n_layer=3, d_model=32, n_head=2, table_size=60, n_embed_per_ngram=16,
                     n_head_per_ngram=2, engram_layers=(0, 2))
    torch.manual_seed(0)
    model = EngramLM(tc.model_config(vocab_size=50))
    h = NgramHasher(tc.engram_config(), LOOKUP)
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, {"model": model.state_dict()},
                    {"config": tc.to_dict(), "history": []})
    for source, out in ((model, tmp_path / "a"), (tmp_path / "run", tmp_path / "b")):
        paths = export_tables(source, out, hasher=h, dtype="fp32")
        assert sorted(paths) == [0, 2]
        tables = open_tables(out, tc.engram_config(), h)
        for lid, t in tables.items():
            assert torch.equal(t.lookup(torch.arange(t.num_rows)),
                               model.engrams()[lid].table.weight.detach())
    assert read_header(table_path(tmp_path / "b", 0)).tag == "step_00000007.safetensors"  # the file


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corruption_is_detected_and_named(tmp_path, hasher, weight):
    path = tmp_path / "t.table"
    h = _write(path, weight, hasher, chunk_rows=100)
    verify(path)
    _flip(path, h.data_offset + 250 * h.row_bytes + 5)  # a byte of row 250: chunk 2
    with pytest.raises(TableFileError, match=r"chunk 2 \(rows 200:300\)"):
        verify(path)
    with pytest.raises(TableFileError, match="checksum mismatch"):
        FileTable(path)
    _write(path, weight, hasher)
    _flip(path, 40)  # inside the JSON header
    with pytest.raises(TableFileError, match="header checksum"):
        FileTable(path, verify=False)


@pytest.mark.parametrize("dtype", ["fp32", "fp8", "int8", "int4"])
def test_a_file_holding_these_rows_is_kept_and_any_other_written_again(tmp_path, hasher, weight,
                                                                         dtype):
    """``kept`` (an export's rerun): the same rows, header and verified checksums keep the file
    (the same inode: not written again); another row, tag or dtype, a flipped byte or a torn file
    is written again, and the result equals a fresh write byte for byte."""
    path, fresh = tmp_path / "t.table", tmp_path / "fresh.table"
    _write(fresh, weight, hasher, dtype, chunk_rows=100, tag="step_2")
    want = fresh.read_bytes()
    _write(path, weight, hasher, dtype, chunk_rows=100, tag="step_2")
    kept = []
    inode = path.stat().st_ino
    _write(path, weight, hasher, dtype, chunk_rows=100, tag="step_2", kept=kept)
    assert kept == [path] and path.stat().st_ino == inode
    other = weight.clone()
    other[250, 3] += 1  # chunk 2
    h = _write(tmp_path / "other.table", other, hasher, dtype, chunk_rows=100, tag="step_2")
    for spoil in (lambda: _write(path, other, hasher, dtype, chunk_rows=100, tag="step_2"),
                  lambda: _write(path, weight, hasher, dtype, chunk_rows=100, tag="step_4"),
                  lambda: _write(path, weight, hasher, "bf16", chunk_rows=100, tag="step_2"),
                  lambda: _flip(path, h.data_offset + 250 * h.row_bytes + 5),
                  lambda: os.truncate(path, path.stat().st_size - 1)):
        _write(path, weight, hasher, dtype, chunk_rows=100, tag="step_2")
        spoil()
        kept, inode = [], path.stat().st_ino
        _write(path, weight, hasher, dtype, chunk_rows=100, tag="step_2", kept=kept)
        assert kept == [] and path.stat().st_ino != inode and path.read_bytes() == want


def test_fp8_scale_corruption_is_detected(tmp_path, hasher, weight):
    path = tmp_path / "t.table"
    h = _write(path, weight, hasher, "fp8")
    _flip(path, h.scale_offset + 3)
    with pytest.raises(TableFileError, match="chunk 0"):
        verify(path)


def test_truncated_extended_foreign_and_missing_files(tmp_path, hasher, weight):
    path = tmp_path / "t.table"
    h = _write(path, weight, hasher)
    with open(path, "r+b") as f:
        f.truncate(h.file_size - 1)
    with pytest.raises(TableFileError, match=f"truncated: {h.file_size - 1} of {h.file_size}"):
        FileTable(path)
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(TableFileError, match="truncated"):
        read_header(path)
    _write(path, weight, hasher)
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(TableFileError, match="unexpected bytes"):
        read_header(path)
    (tmp_path / "other").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(TableFileError, match="not an Engram table"):
        FileTable(tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="no table file"):
        FileTable(tmp_path / "missing.table")
    with pytest.raises(FileNotFoundError, match="layer 0"):
        open_tables(tmp_path / "empty", CFG)


def test_mismatched_config_hash_profile_or_layer_is_refused(tmp_path, hasher, weight):
    path = tmp_path / "t.table"
    _write(path, weight, hasher)
    h = read_header(path)
    check_compatible(h, CFG, 0, hasher)
    with pytest.raises(TableFileError, match="another Engram config.*seed"):
        check_compatible(h, CFG.replace(seed=5), 0)
    with pytest.raises(TableFileError, match="holds layer 0, expected layer 2"):
        check_compatible(h, CFG, 2)
    other = NgramHasher(CFG, np.arange(300) % 249)  # another tokenizer compression
    with pytest.raises(TableFileError, match="hashed differently.*compression"):
        FileTable(path, expect=(CFG, 0, other))
    # the same compression map reached another way (a fingerprint-less array) still matches
    FileTable(path, expect=(CFG, 0, NgramHasher(CFG, LOOKUP.copy())))
    small = write_table(tmp_path / "s.table", weight[:10], layer_id=0, config=CFG)
    with pytest.raises(TableFileError, match="10 x 16, the cold table of layer 0 needs"):
        check_compatible(small, CFG, 0)


def _version(k, rows, dim):
    """Version k of a table: row i holds k * 1000 + i everywhere (a torn row would mix values)."""
    col = k * 1000 + torch.arange(rows, dtype=torch.float32)
    return col[:, None].expand(rows, dim).contiguous()


def test_publish_during_reads_never_tears(tmp_path):
    rows, dim, versions = 400, 16, 40
    path = tmp_path / "t.table"
    write_table(path, _version(0, rows, dim), layer_id=0, config=CFG, tag="0", chunk_rows=64)
    held = FileTable(path)  # opened before any publish: keeps version 0 throughout
    errors, seen = [], set()

    def publish():
        for k in range(1, versions + 1):
            write_table(path, _version(k, rows, dim), layer_id=0, config=CFG, tag=str(k),
                        chunk_rows=64)

    def read():
        while writer.is_alive():
            try:
                t = FileTable(path)  # verified: header and every chunk from one version
            except FileNotFoundError as e:  # the name must never be missing mid-publish
                errors.append(e)
                return
            k = int(t.header.tag)
            got = t.lookup(torch.randint(0, rows, (64,)))
            if not torch.equal(got - k * 1000, got[:, :1] - k * 1000 + torch.zeros_like(got)):
                errors.append(f"torn row in version {k}")
            first = got[:, 0] - k * 1000
            if bool((first >= rows).any()) or bool((first < 0).any()):
                errors.append(f"row of another version under tag {k}")
            seen.add(k)
            t.close()

    writer = threading.Thread(target=publish)
    readers = [threading.Thread(target=read) for _ in range(2)]
    writer.start()
    for r in readers:
        r.start()
    writer.join()
    for r in readers:
        r.join()
    assert not errors
    assert len(seen) > 1  # the readers really overlapped several publishes
    assert torch.equal(held.lookup(torch.arange(rows)), _version(0, rows, dim))
    assert held.refresh() and held.header.tag == str(versions)
    assert torch.equal(held.lookup(torch.arange(rows)), _version(versions, rows, dim))
    assert not held.refresh()
    assert [p.name for p in tmp_path.iterdir()] == ["t.table"]  # no temp files left behind


def test_failed_publish_keeps_the_old_version(tmp_path):
    path = tmp_path / "t.table"
    write_table(path, _version(1, 10, 4), layer_id=0, config=CFG, tag="1")

    def broken(a, b):
        raise RuntimeError("export crashed")
    with pytest.raises(RuntimeError, match="export crashed"):
        write_table(path, broken, num_rows=10, dim=4, layer_id=0, config=CFG, tag="2")
    assert read_header(path).tag == "1" and os.listdir(tmp_path) == ["t.table"]
    assert torch.equal(FileTable(path).lookup(torch.arange(10)), _version(1, 10, 4))


def test_refresh_refuses_another_shape_and_closed_tables_say_so(tmp_path):
    path = tmp_path / "t.table"
    write_table(path, _version(1, 10, 4), layer_id=0, config=CFG, tag="1")
    table = FileTable(path)
    write_table(path, _version(2, 12, 4), layer_id=0, config=CFG, tag="2")
    with pytest.raises(TableFileError, match="new version is 12 x 4, the old one 10 x 4"):
        table.refresh()
    assert table.header.tag == "1"  # still serving the old version, whole
    assert torch.equal(table.lookup(torch.arange(10)), _version(1, 10, 4))
    table.close()
    with pytest.raises(RuntimeError, match="closed"):
        table.lookup(torch.arange(3))


def test_nine_hot_tier_files_carry_their_index(tmp_path):
    """An Engram-Nine file names its hot index, tier and sharing layers in its hash profile: a plain
    model, another index, or a hot file read as cold is refused, naming what differs."""
    from engram.retrieval.hot import HotIndex, NineHasher
    from engram.retrieval.primes import rows_per_layer

    cfg = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                       n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0)
    plain = NgramHasher(cfg, np.arange(300) % 250)
    nine = NineHasher(plain, HotIndex.build(torch.arange(30) * 7 + 1, bits=8), shared=True)
    other = NineHasher(plain, HotIndex.build(torch.arange(30) * 7 + 2, bits=8), shared=True)
    assert nine.profile(2)["multipliers"] == plain.profile(0)["multipliers"]
    cold = write_table(table_path(tmp_path, 0), torch.randn(rows_per_layer(cfg)[0], 4),
                       layer_id=0, config=cfg, profile=nine.profile(0))
    hot = write_table(table_path(tmp_path, 0, "hot"), torch.randn(30, 16), layer_id=0, config=cfg,
                      profile=nine.profile(0, "hot"))
    check_compatible(cold, cfg, 0, nine)
    check_compatible(hot, cfg, 0, nine, "hot")
    with pytest.raises(TableFileError, match="from an Engram-Nine run; this model has no hot"):
        check_compatible(cold, cfg, 0, plain)
    with pytest.raises(TableFileError, match="another Engram-Nine hot tier \\(index: file"):
        check_compatible(hot, cfg, 0, other, "hot")
    with pytest.raises(TableFileError, match="tier: file 'hot' vs model 'cold'"):
        check_compatible(dataclasses.replace(hot, num_rows=cold.num_rows, dim=4), cfg, 0, nine)
    with pytest.raises(TableFileError, match="from a plain \\(no hot tier\\) run; this model has a"):
        check_compatible(dataclasses.replace(cold, hash_profile=plain.profile(0)), cfg, 0,
                         nine)
    with pytest.raises(ValueError, match="NineHasher"):
        check_compatible(hot, cfg, 0, plain, "hot")
