"""The hot+cold store against a per-position reference and against the plain MemoryTable; the hot
tier file round trip."""

import pytest
import torch

from engram.retrieval.config import EngramConfig
from engram.retrieval.hot import HotIndex
from engram.tables.hotcold import HotColdStore, hot_path, read_hot_tier, write_hot_tier
from engram.tables.store import MemoryTable
from engram.tables.tablefile import TableFileError

pytestmark = pytest.mark.usefixtures("one_thread")
G, K, E, R, S = 2, 3, 4, 50, 7  # orders, heads per order, head dim, cold rows, hot slots


def _ids(b=2, t=9, seed=0, hot_rate=0.4):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, R, (b, t, G * K), generator=g)
    slots = torch.randint(0, S, (b, t, G), generator=g)
    slots = torch.where(torch.rand(b, t, G, generator=g) < hot_rate, slots, -1)
    return torch.cat([rows, slots], -1)


def test_lookup_equals_per_position_reference():
    torch.manual_seed(0)
    store = HotColdStore(R, E, G, K, S)
    ids = _ids()
    out = store.lookup(ids)
    assert out.shape == (2, 9, G * K, E)
    for b in range(2):
        for t in range(9):
            for g in range(G):
                slot = int(ids[b, t, G * K + g])
                want = (store.hot.weight[slot].view(K, E) if slot >= 0 else
                        store.cold.weight[ids[b, t, g * K:(g + 1) * K]])
                assert torch.equal(out[b, t, g * K:(g + 1) * K], want)


def test_empty_hot_tier_is_exactly_the_hashed_table():
    torch.manual_seed(0)
    store = HotColdStore(R, E, G, K, 0)
    plain = MemoryTable(R, E, sparse=True)
    plain.weight.data.copy_(store.cold.weight.data)
    ids = _ids(hot_rate=0.0)
    a, b = store.lookup(ids), plain.lookup(ids[..., :G * K])
    assert torch.equal(a, b)
    w = torch.randn_like(a)
    (a * w).sum().backward()
    (b * w).sum().backward()
    assert torch.equal(store.cold.weight.grad.to_dense(), plain.weight.grad.to_dense())


def test_each_tier_gets_gradient_only_where_it_served():
    torch.manual_seed(0)
    store = HotColdStore(R, E, G, K, S)
    ids = _ids(hot_rate=0.5)
    store.lookup(ids).sum().backward()
    cold_grad = store.cold.weight.grad.coalesce()
    rows, slots = ids[..., :G * K].reshape(-1, G, K), ids[..., G * K:].reshape(-1, G)
    served_cold = set(rows[slots < 0].flatten().tolist())
    assert set(cold_grad.indices()[0].tolist()) == served_cold
    assert set(store.hot.weight.grad.coalesce().indices()[0].tolist()) == set(
        slots[slots >= 0].tolist())


def test_bad_ids_raise():
    store = HotColdStore(R, E, G, K, S)
    with pytest.raises(ValueError, match="hot slots"):
        store.lookup(_ids()[..., :-1])
    bad = _ids()
    bad[0, 0, -1] = S
    with pytest.raises(ValueError, match="out of range"):
        store.lookup(bad)
    with pytest.raises(ValueError, match="no hot tier"):
        HotColdStore(R, E, G, K, 0).lookup(_ids(hot_rate=1.0))


@pytest.mark.parametrize("kind", ["mphf", "exact"])
def test_hot_tier_file_round_trip(tmp_path, kind):
    cfg = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=12,
                       n_head_per_ngram=3, layer_ids=[0], pad_id=0)
    keys = torch.arange(40) * 7919 + 3
    idx = HotIndex.build(keys, kind, bits=12)
    rows = torch.randn(40, 12)
    path = write_hot_tier(hot_path(tmp_path, 0), idx, rows, cfg, tag="step 5")
    idx2, rows2 = read_hot_tier(path, cfg)
    assert torch.equal(rows2, rows) and idx2.equals(idx)
    q = torch.cat([keys, keys + 1])
    assert torch.equal(idx2.lookup(q), idx.lookup(q))
    with pytest.raises(TableFileError, match="another Engram config \\(seed: file 0 vs model 1"):
        read_hot_tier(path, cfg.replace(seed=1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip a byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(TableFileError, match="checksum"):
        read_hot_tier(path)
    with pytest.raises(ValueError, match="hot rows"):
        write_hot_tier(tmp_path / "x.safetensors", idx, rows[:3], cfg)


def test_store_over_table_files_with_cache_and_prefetch_equals_memory(tmp_path):
    """Serving: the same lookup over outside stores (the oracle: the in-memory store); a prefetch
    announces exactly the rows each tier's lookup then asks for."""
    from engram.tables.cache import CachedTable
    from engram.tables.prefetch import wrap_prefetch
    from engram.tables.tablefile import table_path, write_table
    from engram.tables.tiers import FileTable

    cfg = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=12,
                       n_head_per_ngram=3, layer_ids=[0], pad_id=0)
    torch.manual_seed(0)
    memory = HotColdStore(R, E, G, K, S)
    for tier, t in (("cold", memory.cold), ("hot", memory.hot)):
        write_table(table_path(tmp_path, 0, tier), t.weight, layer_id=0, config=cfg)
    files = wrap_prefetch({"cold": CachedTable(FileTable(table_path(tmp_path, 0)), 10),
                           "hot": FileTable(table_path(tmp_path, 0, "hot"))})
    served = HotColdStore(R, E, G, K, S, cold=files["cold"], hot=files["hot"])
    assert not list(served.parameters())  # the rows live outside
    for seed, rate in ((1, 0.4), (2, 0.0), (3, 1.0)):
        ids = _ids(seed=seed, hot_rate=rate)
        served.prefetch(ids)
        assert torch.equal(served.lookup(ids), memory.lookup(ids).detach())
    assert files["cold"].stats.sync == 0 and files["hot"].stats.sync == 0
    assert files["cold"].stats.used == 3 and files["hot"].stats.used == 2  # (no hot row at 0.0)
    with pytest.raises(ValueError, match="hot store is 7 x 12, expected 8 x 12"):
        HotColdStore(R, E, G, K, S + 1, cold=files["cold"], hot=files["hot"])
    with pytest.raises(ValueError, match="no hot store"):
        HotColdStore(R, E, G, K, S, cold=files["cold"])
