"""Prefetch: a model whose tables sit behind background gathers (cache + file) computes exactly what
the in-memory model computes, in full forwards and in cached decode; a layer waits only for its own
rows; unmatched lookups fall back to a direct read."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from engram import EngramConfig, EngramLM, MemoryTable, ModelConfig, NgramHasher
from engram.artifacts.table_files import export_tables
from engram.serving.loader import load_dense_state
from engram.tables.cache import CachedTable
from engram.tables.host import PinnedTable
from engram.tables.prefetch import PrefetchTable, prefetch_batch, wrap_prefetch
from engram.tables.store import SplitLookup
from engram.tables.tiers import open_tables

LOOKUP = np.arange(300) % 250
PROFILES = {
    "demo-v1": EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                            n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0),
    "v4.1": EngramConfig(engram_vocab_size=157, max_ngram_size=3, n_embed_per_ngram=16,
                         n_head_per_ngram=4, layer_ids=[1, 2], pad_id=0, profile="v4.1"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _models(tmp_path, profile):
    cfg = PROFILES[profile]
    hasher = NgramHasher(cfg, LOOKUP)
    mc = ModelConfig(vocab_size=300, n_layer=3, d_model=32, n_head=2, engram=cfg, max_seq_len=64)
    torch.manual_seed(0)
    memory = EngramLM(mc).eval()
    for e in memory.engrams().values():  # a live conv, so decode must carry its state
        if e.short_conv is not None:
            torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    export_tables(memory, tmp_path, hasher=hasher)
    files = open_tables(tmp_path, cfg, hasher)
    tables = wrap_prefetch({lid: CachedTable(t, 40, hot_rows=torch.arange(10))
                            for lid, t in files.items()})
    offloaded = EngramLM(mc, tables=tables).eval()
    load_dense_state(offloaded, memory.state_dict())
    return memory, offloaded, hasher, tables


@pytest.mark.parametrize("profile", sorted(PROFILES))
@torch.no_grad()
def test_prefetched_model_equals_in_memory_model(tmp_path, profile):
    memory, offloaded, hasher, tables = _models(tmp_path, profile)
    raw = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    ids = hasher.hash(raw)
    prefetch_batch(offloaded, ids)
    assert torch.equal(offloaded(raw, ids).logits, memory(raw, ids).logits)
    # cached decode: prefill 7, then one token at a time, prefetching each step's rows
    caches = [m.new_cache(3, 20) for m in (memory, offloaded)]
    streams = [hasher.stream(3) for _ in range(2)]
    for a, b in [(0, 7)] + [(t, t + 1) for t in range(7, 20)]:
        step = [s.step(raw[:, a:b]) for s in streams]
        prefetch_batch(offloaded, step[1])
        want = memory(raw[:, a:b], step[0], cache=caches[0]).logits
        assert torch.equal(offloaded(raw[:, a:b], step[1], cache=caches[1]).logits, want)
    for t in tables.values():
        assert t.stats.used == 15 and t.stats.sync == 0 and t.stats.dropped == 0
        assert t.inner.stats.hits > 0  # the cache did serve part of it


class GatedStore:
    """A slow tier for the test: lookups block until ``gate`` opens (a real MemoryTable behind)."""

    def __init__(self, inner, gate):
        self.inner, self.gate, self.num_rows, self.dim = inner, gate, inner.num_rows, inner.dim

    def lookup(self, rows):
        assert self.gate.wait(timeout=30)
        return self.inner.lookup(rows)

    def prefetch(self, rows):
        pass


def test_a_layer_waits_only_for_its_own_rows():
    fast, slow = MemoryTable(50, 4), MemoryTable(50, 4)
    gate = threading.Event()
    pool = ThreadPoolExecutor(2)
    first = PrefetchTable(fast, pool)
    later = PrefetchTable(GatedStore(slow, gate), pool)
    rows = torch.randint(0, 50, (2, 5, 3))
    later.prefetch(rows)  # its gather is stuck behind the gate
    first.prefetch(rows)
    assert torch.equal(first.lookup(rows), fast.lookup(rows).detach())  # does not wait for later
    pending = later._pending[0].job
    assert not pending.done()
    gate.set()
    assert torch.equal(later.lookup(rows), slow.lookup(rows).detach())
    pool.shutdown()


def test_a_read_no_worker_started_runs_inline():
    gate, pool = threading.Event(), ThreadPoolExecutor(1)
    slow, fast = MemoryTable(50, 4), MemoryTable(50, 4)
    blocker = PrefetchTable(GatedStore(slow, gate), pool)
    table = PrefetchTable(fast, pool)
    rows = torch.randint(0, 50, (3, 4))
    blocker.prefetch(rows)  # takes the only worker and holds it
    table.prefetch(rows)  # queued behind it
    assert torch.equal(table.lookup(rows), fast.lookup(rows).detach())  # no wait for the worker
    assert (table.stats.inline, table.stats.used) == (1, 1)
    gate.set()
    assert torch.equal(blocker.lookup(rows), slow.lookup(rows).detach())
    pool.shutdown()


def test_unmatched_lookups_fall_back_and_old_prefetches_are_dropped():
    inner = MemoryTable(30, 4)
    table = PrefetchTable(inner, max_pending=2)
    a, b = torch.tensor([[1, 2, 2]]), torch.tensor([[3, 4, 5]])
    assert torch.equal(table.lookup(a), inner.lookup(a).detach())  # never prefetched
    table.prefetch(a)
    assert torch.equal(table.lookup(b), inner.lookup(b).detach())  # other rows: direct read
    assert torch.equal(table.lookup(a), inner.lookup(a).detach())  # the prefetched one
    for r in range(3):
        table.prefetch(torch.tensor([r]))
    assert table.stats.dropped == 1 and len(table._pending) == 2
    assert (table.stats.sync, table.stats.used, table.stats.prefetched) == (2, 1, 4)
    table.close()


def test_a_split_lookup_reads_only_its_misses_in_the_background():
    """A cache is a SplitLookup: the prefetch takes its hits at once and the worker reads only the
    distinct misses from the cache's source (here a cache that holds nothing, counting reads)."""
    memory = MemoryTable(200, 4)
    source = CachedTable(memory, 0)  # every row asked of it is fetched from memory
    cache = CachedTable(source, 30, hot_rows=torch.arange(20))
    assert isinstance(cache, SplitLookup) and not isinstance(memory, SplitLookup)
    table = PrefetchTable(cache)
    warm = source.stats.lookups  # the static rows, read once when the cache was built
    rows = torch.tensor([[3, 150, 150, 7], [151, 3, 19, 20]])
    table.prefetch(rows)
    assert torch.equal(table.lookup(rows), memory.lookup(rows).detach())
    assert source.stats.lookups - warm == 3  # rows 20, 150, 151: the rest were held
    assert (table.stats.used, table.stats.sync) == (1, 0)
    table.prefetch(rows)  # now all held: no read at all
    assert torch.equal(table.lookup(rows), memory.lookup(rows).detach())
    assert source.stats.lookups - warm == 3 and table.stats.used == 2
    table.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("store_device", ["cpu", "cuda"])
def test_prefetch_to_cuda_from_host_and_device_pinned_tables(store_device):
    """A PinnedTable on "cuda" (its default with CUDA) copies rows to the device itself; the
    prefetcher used to pin those device rows, which raises."""
    weight = torch.randn(5000, 8)
    table = PrefetchTable(PinnedTable(weight, device=store_device), device="cuda")
    rows = [torch.randint(0, 5000, (4, 64, 6)) for _ in range(6)]
    table.prefetch(rows[0])
    for i, r in enumerate(rows):
        if i + 1 < len(rows):
            table.prefetch(rows[i + 1])
        out = table.lookup(r)
        assert out.is_cuda and torch.equal(out.cpu(), weight[r])
    assert table.stats.used == len(rows) and table.stats.sync == 0
    table.close()
