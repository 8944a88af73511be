"""Every tier returns the in-memory store's rows (random and real-text ids): each tier of the
registry (engram.tables.registry: a new tier is tested by registering it), bare and behind the hot
cache and prefetch, and variants of the file tier; a tier that cannot open here says what is
missing; exact cache accounting against a plain LRU; row frequencies; two processes share one pool
without a second copy."""

import multiprocessing as mp
from collections import OrderedDict

import pytest
import torch

from engram import EngramConfig, MemoryTable, NgramHasher, build_engram, rows_per_layer
from engram.tables.cache import CachedTable, count_rows, hot_rows, zipf_exponent
from engram.tables.prefetch import PrefetchTable
from engram.errors import UserError
from engram.tables.registry import REGISTRY, TIERS, open_parts_on
from engram.tables.tablefile import table_path, write_table
from engram.tables.tiers import FileTable, SharedPool, memory_status
from engram.tables.host import PinnedTable
from engram.training.corpus import DataConfig, build_corpus

# pad_id 1: DeepSeek's EOS, as in training, so real text hashes as it does there.
CFG = EngramConfig(engram_vocab_size=[2003, 3001], max_ngram_size=3, n_embed_per_ngram=64,
                   n_head_per_ngram=4, layer_ids=[1, 3], pad_id=1)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hasher(deepseek):
    return NgramHasher(CFG, deepseek)


@pytest.fixture(scope="module")
def text():
    return build_corpus(DataConfig(max_chars=30_000))


@pytest.fixture(scope="module")
def oracles():
    """In-memory tables with random rows, one per layer: the oracle every tier must equal."""
    torch.manual_seed(0)
    return {lid: MemoryTable(n, CFG.head_dim) for lid, n in rows_per_layer(CFG).items()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, oracles, hasher):
    d = tmp_path_factory.mktemp("tables")
    for lid, t in oracles.items():
        write_table(table_path(d, lid), t.weight.detach(), layer_id=lid, config=CFG,
                    profile=hasher.profile(lid), chunk_rows=1000)
    return d


# Configurations the registry's tiers do not open with (the registry's are tested above).
VARIANTS = {
    "file-windowed": lambda d, lid, h: FileTable(table_path(d, lid), window_bytes=8192,
                                                 max_windows=2),
    "file-io-threads": lambda d, lid, h: FileTable(table_path(d, lid), io_threads=3,
                                                   min_split_rows=16),
    "cached": lambda d, lid, h: CachedTable(FileTable(table_path(d, lid)), 300,
                                            hot_rows=torch.arange(0, 2000, 20)),
    "cached-lru-only": lambda d, lid, h: CachedTable(FileTable(table_path(d, lid)), 64),
    "prefetch-cached": lambda d, lid, h: PrefetchTable(
        CachedTable(FileTable(table_path(d, lid)), 300, hot_rows=torch.arange(100))),
}


def _lookup(store, rows, prefetch):
    if prefetch:
        store.prefetch(rows)
    return store.lookup(rows)


def _equals_oracle(tier, store, lid, oracle, hasher, text):
    raw = torch.from_numpy(text.val[:4 * 96].astype("int64")).view(4, 96)
    ids = hasher.hash(raw)  # {layer: [4, 96, H]} local per head (demo-v1 profile)
    g = torch.Generator().manual_seed(1)
    assert (store.num_rows, store.dim) == (oracle.num_rows, oracle.dim)
    real = build_engram(CFG, lid, 32, table=None).rows(ids[lid])  # global rows [4, 96, H]
    batches = [real, torch.randint(0, oracle.num_rows, (3, 7, CFG.num_heads), generator=g),
               real[:, :5], torch.tensor([0, oracle.num_rows - 1, 5, 5]), real]
    for i, rows in enumerate(batches):  # repeated: cache state and windows change in between
        # .cpu(): with CUDA a PinnedTable's rows come back on the device
        got = _lookup(store, rows, prefetch=i % 2 == 0).cpu()
        assert torch.equal(got, oracle.lookup(rows).detach()), (tier, lid, i)
    with pytest.raises(IndexError):  # a clear error, never a row of another id
        store.lookup(torch.tensor([oracle.num_rows]))


@pytest.mark.parametrize("front", ["bare", "cache+prefetch"])
@pytest.mark.parametrize("tier", TIERS)
def test_every_registered_tier_equals_memory_table(tier, front, exported, oracles, hasher, text):
    why = REGISTRY[tier].missing()
    if why:
        pytest.skip(f"tier {tier} cannot open on this machine: {why}")
    opened = open_parts_on(tier, exported, CFG, hasher)
    try:
        assert sorted(opened.parts) == [("cold", lid) for lid in sorted(oracles)]
        for (_, lid), store in opened.parts.items():
            if front != "bare":
                store = PrefetchTable(CachedTable(store, 300, hot_rows=torch.arange(0, 2000, 20)))
            _equals_oracle(tier, store, lid, oracles[lid], hasher, text)
    finally:
        opened.close()


def test_the_memory_tier_reads_the_files_rows_and_draws_nothing(exported, oracles, hasher):
    """Issue 48 (build on meta, load with assign): the memory tier's tables hold the files' rows
    bit for bit, read into the tensor it serves, not over rows drawn from the caller's generator
    first (which it leaves as it was)."""
    untouched = torch.rand(1, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    opened = open_parts_on("memory", exported, CFG, hasher)
    try:
        assert torch.equal(torch.rand(1), untouched)
        assert sorted(opened.parts) == [("cold", lid) for lid in sorted(oracles)]
        for (_, lid), store in opened.parts.items():
            assert isinstance(store, MemoryTable)
            assert torch.equal(store.weight.detach(), oracles[lid].weight.detach()), lid
    finally:
        opened.close()


def test_unknown_or_unavailable_tiers_are_clear_errors(exported, hasher, monkeypatch):
    with pytest.raises(ValueError, match="tier must be one of .*'memory'.*got 'nvme'"):
        open_parts_on("nvme", exported, CFG, hasher)
    monkeypatch.setenv("PATH", "/nonexistent")  # Mooncake's services are not on this PATH
    with pytest.raises(UserError, match="'mooncake' cannot open on this machine: "
                                           "mooncake_master not on PATH"):
        open_parts_on("mooncake", exported, CFG, hasher)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_equal_memory_table_on_random_and_real_text_ids(variant, exported, oracles,
                                                                 hasher, text):
    for lid, oracle in oracles.items():
        _equals_oracle(variant, VARIANTS[variant](exported, lid, hasher), lid, oracle, hasher,
                       text)


def _reference_lru(capacity, static, batches):
    """A row-by-row LRU: occurrences are hits if cached before the call; then the batch's distinct
    non-static rows are touched in ascending order."""
    lru, hits, lookups, fetched = OrderedDict(), 0, 0, 0
    n_lru = capacity - len(static)
    for rows in batches:
        flat = rows.reshape(-1).tolist()
        cached = set(static) | set(lru)
        lookups += len(flat)
        hits += sum(r in cached for r in flat)
        fetched += len({r for r in flat if r not in cached})
        for r in sorted(set(flat) - set(static)):
            if r in lru:
                lru.move_to_end(r)
            elif n_lru > 0:
                if len(lru) >= n_lru:
                    lru.popitem(last=False)
                lru[r] = True
    return hits, lookups, fetched, set(static) | set(lru)


def test_cache_counts_a_hand_worked_example():
    inner = MemoryTable(10, 4)
    cache = CachedTable(inner, capacity=3, hot_rows=torch.tensor([7]))
    for rows in ([1, 2], [2, 3, 7, 7], [1, 4]):
        r = torch.tensor(rows)
        assert torch.equal(cache.lookup(r), inner.lookup(r).detach())
    # b1: 2 misses; b2: 2 and 7, 7 hit, 3 misses (evicts 1); b3: 1 and 4 miss (evict 2, then 3)
    assert cache.stats.as_dict() == {"lookups": 8, "hits": 3, "misses": 5, "fetched": 5,
                                     "hit_rate": 3 / 8}
    assert sorted(cache.cached_rows().tolist()) == [1, 4, 7]


@pytest.mark.parametrize("capacity,n_static", [(40, 10), (40, 0), (25, 25), (8, 3)])
def test_cache_counts_match_a_reference_lru(capacity, n_static):
    torch.manual_seed(capacity + n_static)
    inner = MemoryTable(120, 4)
    counts = torch.randint(0, 100, (120,))
    static = hot_rows(counts, n_static)
    cache = CachedTable(inner, capacity, hot_rows=static)
    # Zipf-like ids so there are hits; batch sizes from 1 to above the capacity
    probs = 1.0 / torch.arange(1, 121).float()
    batches = [torch.multinomial(probs, int(n), replacement=True)
               for n in torch.randint(1, 60, (40,))]
    for rows in batches:
        assert torch.equal(cache.lookup(rows), inner.lookup(rows).detach())
    hits, lookups, fetched, cached = _reference_lru(capacity, static.tolist(), batches)
    assert (cache.stats.hits, cache.stats.lookups, cache.stats.fetched) == (hits, lookups, fetched)
    assert set(cache.cached_rows().tolist()) == cached
    assert 0 < cache.stats.hit_rate < 1


def test_row_counts_hot_rows_and_zipf(hasher, text):
    stream = text.train[:5000]
    counts = count_rows(hasher, stream, window=777)  # windows cut through n-grams
    whole = hasher.hash(torch.from_numpy(stream.astype("int64"))[None])  # one pass: the reference
    for lid in CFG.layer_ids:
        rows = build_engram(CFG, lid, 32, table=None).rows(whole[lid]).reshape(-1)
        assert torch.equal(counts[lid], torch.bincount(rows, minlength=counts[lid].numel()))
        top = hot_rows(counts[lid], 10)
        assert counts[lid][top].tolist() == sorted(counts[lid].tolist(), reverse=True)[:10]
    c = torch.tensor([0, 5, 9, 9, 1])
    assert hot_rows(c, 3).tolist() == [2, 3, 1] and hot_rows(c, 9).tolist() == [2, 3, 1, 4]
    ranks = torch.arange(1, 2001, dtype=torch.float64)
    assert zipf_exponent((1e7 * ranks ** -1.1).round().long()) == pytest.approx(1.1, abs=0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_and_prefetch_deliver_rows_on_the_device(exported, oracles):
    lid, oracle = next(iter(oracles.items()))
    rows = torch.randint(0, oracle.num_rows, (4, 9, CFG.num_heads))
    pinned = PinnedTable(FileTable(table_path(exported, lid)))
    assert pinned.pinned and pinned.host.is_pinned()
    out = pinned.lookup(rows)
    assert out.is_cuda and torch.equal(out.cpu(), oracle.lookup(rows).detach())
    pre = PrefetchTable(FileTable(table_path(exported, lid)), device="cuda")
    pre.prefetch(rows)
    out = pre.lookup(rows)
    assert out.is_cuda and pre.stats.used == 1
    assert torch.equal(out.cpu(), oracle.lookup(rows).detach())


# -- the shared pool across processes --------------------------------------------------------------

POOL_CFG = EngramConfig(engram_vocab_size=[131072, 131072], max_ngram_size=3,
                        n_embed_per_ngram=256, n_head_per_ngram=4, layer_ids=[0], pad_id=1)


def _pool_reader(directory, go, done, results):
    """A server process: attach to the pool, read every row, report its memory growth."""
    torch.set_num_threads(1)
    table = SharedPool(directory, POOL_CFG).store(0)
    go.wait()
    before, total = memory_status(), 0.0
    for a in range(0, table.num_rows, 4096):  # small chunks: the reads' own buffers stay tiny
        total += float(table.lookup(torch.arange(a, min(a + 4096, table.num_rows))).sum())
    after = memory_status()
    results.put({**{k: after.get(k, 0) - before.get(k, 0) for k in after}, "total": total})
    done.wait()  # keep the mapping while the other process measures


def test_two_processes_share_one_pool(tmp_path):
    rows = rows_per_layer(POOL_CFG)[0]
    g = torch.Generator().manual_seed(0)
    header = write_table(table_path(tmp_path, 0), lambda a, b: torch.randn(b - a, 64, generator=g),
                         num_rows=rows, dim=64, layer_id=0, config=POOL_CFG)
    size = header.file_size
    assert size > 250e6
    ctx = mp.get_context("spawn")
    gos, done, results = [ctx.Event(), ctx.Event()], ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_pool_reader, args=(tmp_path, go, done, results)) for go in gos]
    for p in procs:
        p.start()
    try:
        gos[0].set()
        first = results.get(timeout=120)
        gos[1].set()
        second = results.get(timeout=120)
    finally:
        done.set()
        for p in procs:
            p.join(timeout=60)
    assert first["total"] == second["total"]
    # The second process mapped and read every row (its file-backed resident set grew by ~the
    # table) but holds no copy: its private memory grew by far less, its pages are shared.
    assert second["RssFile"] + second.get("RssShmem", 0) > 0.9 * size
    assert second["RssAnon"] < 0.05 * size
    assert second["Private_Clean"] + second["Private_Dirty"] < 0.05 * size
    assert second["Shared_Clean"] > 0.9 * size
