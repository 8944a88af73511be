"""The Mooncake Store baseline returns the in-memory table's rows, reads each distinct row once
with ranged reads from a few large objects, and works behind the hot cache and prefetch. Starts
mooncake_master and mooncake_client on loopback; skips when the package or libibverbs is missing."""

import numpy as np
import pytest
import torch

from engram import MemoryTable
from engram.tables.cache import CachedTable
from engram.tables.mooncake import MooncakeTable, mooncake_missing, publish_table
from engram.tables.prefetch import PrefetchTable

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(mooncake_missing() is not None,
                                 reason=f"Mooncake unavailable: {mooncake_missing()}")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from engram.tables.mooncake import MooncakeServices

    with MooncakeServices(segment_bytes=128 << 20,
                          log_dir=tmp_path_factory.mktemp("mooncake")) as services:
        client = services.connect()
        yield client
        client.close()


@pytest.fixture(scope="module")
def oracle():
    torch.manual_seed(0)
    return MemoryTable(30_011, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_memory(store, oracle, dtype):
    w = oracle.weight.detach().to(dtype)
    meta = publish_table(store, f"t/{dtype}", w, object_bytes=1 << 20)  # several objects
    assert meta["objects"] > 1
    table = MooncakeTable(store, f"t/{dtype}", buffer_rows=700, max_ranges=300)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, w.shape[0], (3, 200, 8), generator=g)
    rows[0, :10] = rows[1, :10]  # repeated rows, fetched once
    assert torch.equal(table.lookup(rows), w[rows])
    assert table.stats.ranges == np.unique(rows.numpy()).size  # de-duplicated
    edge = torch.tensor([0, w.shape[0] - 1, meta["object_rows"] - 1, meta["object_rows"]])
    assert torch.equal(table.lookup(edge), w[edge])  # object boundaries
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([w.shape[0]]))
    table.close()


def test_behind_cache_and_prefetch(store, oracle):
    publish_table(store, "t/cached", oracle.weight.detach())
    remote = MooncakeTable(store, "t/cached")
    cache = CachedTable(remote, 2000, hot_rows=torch.arange(0, 3000, 3))
    table = PrefetchTable(cache)
    warm = remote.stats.ranges  # the static rows, read once when the cache is built
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        rows = torch.randint(0, 6000, (4, 50, 8), generator=g)
        table.prefetch(rows)
        assert torch.equal(table.lookup(rows), oracle.lookup(rows).detach())
    assert table.stats.used == 3 and cache.stats.hits > 0
    assert remote.stats.ranges - warm == cache.stats.fetched  # only misses cross the transport
    table.close()
    remote.close()


def test_missing_table_is_a_clear_error(store):
    with pytest.raises(FileNotFoundError, match="publish_table"):
        MooncakeTable(store, "no/such/table")
