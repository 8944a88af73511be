"""The pool region (DAX / CXL stand-in): rows equal the in-memory table, 2 MiB alignment, a
half-written pool is refused, and a writer rewriting while several reader processes read never
hands out torn rows."""

import multiprocessing as mp
import os
import time

import pytest
import torch

import engram.tables.pool as tp
from engram import EngramConfig, MemoryTable, NgramHasher, rows_per_layer
from engram.tables.pool import PoolRegion, load_pool, write_pool
from engram.tables.tablefile import TableFileError, table_path, write_table
from engram.tables.tiers import FileTable

CFG = EngramConfig(engram_vocab_size=[2003, 3001], max_ngram_size=3, n_embed_per_ngram=64,
                   n_head_per_ngram=4, layer_ids=[1, 3], pad_id=1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def oracles():
    torch.manual_seed(0)
    return {lid: MemoryTable(n, CFG.head_dim) for lid, n in rows_per_layer(CFG).items()}


@pytest.fixture(scope="module")
def hasher(deepseek):
    return NgramHasher(CFG, deepseek)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, oracles, hasher):
    d = tmp_path_factory.mktemp("tables")
    for lid, t in oracles.items():
        for dtype in ("fp32", "fp8"):
            write_table(table_path(d / dtype, lid), t.weight.detach(), layer_id=lid, config=CFG,
                        profile=hasher.profile(lid), dtype=dtype, tag="v1")
    return d


def test_pool_rows_equal_memory_and_file(tmp_path, oracles, exported, hasher):
    ids = torch.randint(0, 8000, (3, 5, 16))
    g = torch.Generator().manual_seed(1)
    info = write_pool(tmp_path / "pool", {lid: t.weight for lid, t in oracles.items()},
                      config=CFG, hasher=hasher)
    assert info["size"] % tp.ALIGN == 0 and os.path.getsize(tmp_path / "pool") == info["size"]
    assert all(e["data_offset"] % tp.ALIGN == 0 for e in info["layers"].values())
    region = PoolRegion(tmp_path / "pool", expect=(CFG, hasher))
    for lid, t in oracles.items():
        rows = torch.randint(0, t.num_rows, (3, 5, 16), generator=g)
        assert torch.equal(region.store(lid).lookup(rows), t.lookup(rows).detach())
    # From exported files, fp8 included: the pool returns what the file tier returns.
    fp8 = load_pool(tmp_path / "pool8", exported / "fp8", CFG, hasher, rank=0, verify=True)
    for lid in CFG.layer_ids:
        rows = ids % oracles[lid].num_rows
        want = FileTable(table_path(exported / "fp8", lid)).lookup(rows)
        assert torch.equal(fp8.store(lid).lookup(rows), want)
        assert not torch.equal(want, oracles[lid].lookup(rows).detach())  # fp8 really lossy


def test_pool_refuses_foreign_config_and_corruption(tmp_path, oracles, hasher):
    write_pool(tmp_path / "pool", {1: oracles[1].weight}, config=CFG, hasher=hasher)
    other = EngramConfig(engram_vocab_size=[2003, 3001], max_ngram_size=3, n_embed_per_ngram=64,
                         n_head_per_ngram=4, layer_ids=[1, 3], pad_id=1, seed=7)
    with pytest.raises(TableFileError, match="another Engram config"):
        PoolRegion(tmp_path / "pool", expect=(other, None))
    with open(tmp_path / "pool", "r+b") as f:  # flip one byte of layer 1's rows
        f.seek(tp.ALIGN + 12345)
        b = f.read(1)
        f.seek(tp.ALIGN + 12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(tp.PoolError, match="checksum"):
        PoolRegion(tmp_path / "pool")
    (tmp_path / "junk").write_bytes(b"x" * (tp.ALIGN + 10))
    with pytest.raises(tp.PoolError, match="not an Engram pool"):
        PoolRegion(tmp_path / "junk")


def test_half_written_pool_is_refused(tmp_path, oracles):
    path = tmp_path / "pool"

    def crash(done, total):
        if done > total // 2:
            raise KeyboardInterrupt  # rank 0 dies half way through
    with pytest.raises(KeyboardInterrupt):
        write_pool(path, {lid: t.weight for lid, t in oracles.items()}, chunk_bytes=1 << 16,
                   on_chunk=crash)
    with pytest.raises(tp.PoolNotReady, match="still writing"):
        PoolRegion(path)
    t0 = time.monotonic()
    with pytest.raises(tp.PoolNotReady):
        PoolRegion(path, wait_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    write_pool(path, {lid: t.weight for lid, t in oracles.items()})  # a restarted rank 0
    region = PoolRegion(path)
    rows = torch.arange(0, 4000, 7)
    assert torch.equal(region.store(3).lookup(rows), oracles[3].lookup(rows).detach())


def test_open_reader_sees_rewrite_as_changed(tmp_path, oracles):
    path = tmp_path / "pool"
    write_pool(path, {1: oracles[1].weight})
    region = PoolRegion(path)
    rows = torch.arange(100)
    region.store(1).lookup(rows)
    write_pool(path, {1: oracles[1].weight * 2})
    with pytest.raises(tp.PoolChanged):
        region.store(1).lookup(rows)
    assert torch.equal(PoolRegion(path).store(1).lookup(rows), 2 * oracles[1].weight[:100])


# -- one writer, several reader processes ----------------------------------------------------------

def _base(rows: int = 20_000, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return 1 + torch.rand(rows, dim, generator=g)  # never 0, so a row's generation is its ratio


def _writer(path: str, gens: int, started) -> None:
    base = _base()
    for k in range(1, gens + 1):
        write_pool(path, {0: base * k}, chunk_bytes=1 << 16,
                   on_chunk=lambda d, t: time.sleep(0.0003))
        if k == 1:
            started.set()
        time.sleep(0.002)


def _reader(path: str, seed: int, started, done, out) -> None:
    torch.set_num_threads(1)
    base, g = _base(), torch.Generator().manual_seed(seed)
    stats = {"ok": 0, "refused": 0, "changed": 0, "torn": 0, "gens": set()}
    started.wait(30)
    region = None
    while not done.is_set():
        try:
            if region is None:
                region = PoolRegion(path, verify=False)
            rows = torch.randint(0, base.shape[0], (512,), generator=g)
            ratio = region.store(0).lookup(rows) / base[rows]  # [n, e], one generation k
            ks = torch.round(ratio)
            if not torch.allclose(ratio, ks) or ks.min() != ks.max():
                stats["torn"] += 1
            else:
                stats["ok"] += 1
                stats["gens"].add(int(ks[0, 0]))
        except tp.PoolNotReady:
            stats["refused"] += 1
            region = None
        except tp.PoolChanged:
            stats["changed"] += 1
            region = None
    stats["gens"] = sorted(stats["gens"])
    out.put(stats)


def test_writer_and_reader_processes_never_see_torn_rows(tmp_path):
    ctx = mp.get_context("fork")
    path = str(tmp_path / "pool")
    started, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_writer, args=(path, 6, started))
    readers = [ctx.Process(target=_reader, args=(path, s, started, done, out)) for s in range(3)]
    writer.start()
    for r in readers:
        r.start()
    writer.join(60)
    time.sleep(0.05)
    done.set()
    stats = [out.get(timeout=30) for _ in readers]
    for r in readers:
        r.join(10)
    assert writer.exitcode == 0
    assert all(s["torn"] == 0 for s in stats), stats
    assert sum(s["ok"] for s in stats) > 0
    # The readers did overlap the rewrites: some lookups were refused or invalidated, and more
    # than one generation was read.
    assert sum(s["refused"] + s["changed"] for s in stats) > 0, stats
    assert len(set().union(*[s["gens"] for s in stats])) > 1, stats


def test_tmpfs_region_and_device_size(oracles):
    """/dev/shm (a RAM-backed tmpfs, like a CXL-backed one) holds a pool as any path does; a
    character device that is not device-DAX is refused with its sysfs path named."""
    from engram.tables.pool import region_size

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/engram-test-pool-{os.getpid()}"
    try:
        write_pool(path, {3: oracles[3].weight})
        rows = torch.tensor([[0, 5, 4000]])
        assert torch.equal(PoolRegion(path).store(3).lookup(rows), oracles[3].lookup(rows).detach())
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(tp.PoolError, match="device-DAX"):
            region_size("/dev/zero")
