"""Hot tier keys and slots from token ids: exact packing, counting, and the per-batch lookup,
each against a slow per-position reference."""

from collections import Counter

import numpy as np
import pytest
import torch

from engram.retrieval.hashing import NgramHasher
from engram.retrieval.hot import (
    HotIndex,
    NineHasher,
    build_hot_index,
    count_keys,
    ngram_keys,
    top_keys,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hasher(tiny_config, tiny_lookup):
    return NgramHasher(tiny_config, tiny_lookup)


@pytest.fixture(scope="module")
def stream():
    # Real text ids, folded into the tiny vocabulary: a Zipfian stream with repeats.
    from engram.training.corpus import DataConfig, build_corpus

    c = build_corpus(DataConfig(max_chars=20_000))
    return (c.train[:6000] % 300).astype(np.int64)


def _ngrams(hasher, raw):
    """Slow reference: per position, the tuple of compressed ids of each order (pads before 0)."""
    comp = hasher.compression.lookup[raw]
    n_max, out = hasher.config.max_ngram_size, []
    for t in range(len(raw)):
        ctx = [comp[t - j] if t - j >= 0 else hasher.pad for j in range(n_max)]
        out.append([(n, tuple(ctx[:n])) for n in range(2, n_max + 1)])
    return out


def test_keys_are_exact_ngram_codes(hasher, stream):
    raw = stream[:400]
    keys = ngram_keys(hasher, hasher.compression(torch.from_numpy(raw)[None]))[0]  # [t, G]
    ref = _ngrams(hasher, raw)
    by_key = {}
    for t, grams in enumerate(ref):
        for g, gram in enumerate(grams):
            k = int(keys[t, g])
            assert by_key.setdefault(k, gram) == gram  # one key, one n-gram
    assert len(set(by_key.values())) == len(by_key)  # one n-gram, one key


def test_counts_match_a_counter_and_chunks_do_not_matter(hasher, stream):
    counted = count_keys(hasher, stream)
    chunked = count_keys(hasher, stream, chunk=777)
    ref = Counter(gram for grams in _ngrams(hasher, stream) for gram in grams)
    for g, ((k, c), (k2, c2)) in enumerate(zip(counted, chunked)):
        assert np.array_equal(k, k2) and np.array_equal(c, c2)
        want = sorted(v for (n, _), v in ref.items() if n == g + 2)
        assert sorted(c.tolist()) == want


def test_top_keys_and_too_many_hot_rows(hasher, stream):
    counted = count_keys(hasher, stream)
    top = top_keys(counted, 10)
    assert top.numel() == 20
    for g, (k, c) in enumerate(counted):
        chosen = c[np.isin(k, top[g * 10:(g + 1) * 10].numpy())]
        assert chosen.min() >= np.sort(c)[::-1][9]  # nothing more frequent was left out
    distinct = min(len(k) for k, _ in counted)
    with pytest.raises(ValueError, match="distinct n-grams"):
        top_keys(counted, distinct + 1)


@pytest.mark.parametrize("kind", ["exact", "mphf"])
def test_nine_hasher_equals_per_position_reference(hasher, stream, kind):
    index = build_hot_index(hasher, stream, 15, kind=kind)
    nine = NineHasher(hasher, index, shared=False)
    raw = torch.from_numpy(stream[1000:1000 + 3 * 50].reshape(3, 50))
    mask = torch.ones_like(raw)
    mask[1, :7] = 0  # left padding: dead positions read like the sequence start
    out = nine.hash(raw, attention_mask=mask)
    plain = hasher.hash(raw, attention_mask=mask)
    h = hasher.num_heads
    hot = {}  # key -> slot, from the index's own slot order
    for slot, k in enumerate(index.keys.tolist()):
        hot[k] = slot
    keys = ngram_keys(hasher, torch.where(mask.bool(), hasher.compression(raw), -1))
    for lid in hasher.layer_ids:
        cold, slots = nine.split(out[lid])
        assert torch.equal(cold, plain[lid] + torch.tensor(hasher.offsets(lid)))
        ref = torch.tensor([[[hot.get(int(k), -1) for k in pos] for pos in row] for row in keys])
        if kind == "exact":
            assert torch.equal(slots, ref)
        else:  # members exact; a non-member may pass at ~2^-16 (none expected here)
            assert torch.equal(slots[ref >= 0], ref[ref >= 0])
            assert int((slots[ref < 0] >= 0).sum()) == 0
        assert out[lid].shape == (3, 50, h + 2)
    assert (slots >= 0).any() and (slots < 0).any()  # both tiers serve in this batch


def test_shared_gives_every_layer_the_same_ids(hasher, stream):
    nine = NineHasher(hasher, build_hot_index(hasher, stream, 5), shared=True)
    out = nine.hash(torch.from_numpy(stream[:64].reshape(2, 32)))
    assert torch.equal(out[0], out[2])


def test_index_state_round_trip(hasher, stream):
    idx = build_hot_index(hasher, stream, 20)
    again = HotIndex.from_state_dict(idx.state_dict())
    keys = ngram_keys(hasher, hasher.compression(torch.from_numpy(stream[:500])[None]))
    assert torch.equal(again.lookup(keys), idx.lookup(keys)) and again.equals(idx)
    with pytest.raises(ValueError, match="hot index state"):
        HotIndex.from_state_dict({"kind": "mphf"})


# -- the Hasher interface: what callers ask of either hasher --------------------------------------

def test_read_counts_of_both_hashers_agree(hasher, stream):
    """An empty hot index reads exactly the plain tables; with hot slots, every hot read replaces
    the K cold reads of its order (so cold + K * hot = the plain reads), each counted once."""
    plain = hasher.count_reads(stream, window=777)  # windows cut through n-grams
    empty = NineHasher(hasher, HotIndex.build(torch.zeros(0, dtype=torch.long), "exact"),
                       shared=False)
    assert empty.parts == hasher.parts == ("cold",) and empty.owners == hasher.owners
    for lid, counts in empty.count_reads(stream, window=1000).items():
        assert list(counts) == ["cold"] and torch.equal(counts["cold"], plain[lid]["cold"])
        assert empty.table_shape(lid) == hasher.table_shape(lid)
    nine = NineHasher(hasher, build_hot_index(hasher, stream, 15), shared=True)
    assert nine.parts == ("cold", "hot") and nine.owners == [0] and nine.owner(2) == 0
    reads = nine.count_reads(stream, window=1000)
    assert reads[0] is reads[2]  # a shared set: one pair of counts
    k = hasher.config.n_head_per_ngram
    assert int(reads[0]["hot"].sum()) > 0
    assert (int(reads[0]["cold"].sum()) + k * int(reads[0]["hot"].sum())
            == int(plain[0]["cold"].sum()) == len(stream) * hasher.num_heads)
    assert nine.table_shape(2, "hot") == (nine.index.num_slots, k * hasher.config.head_dim)
    with pytest.raises(ValueError, match="no 'hot' tables"):
        hasher.table_shape(0, "hot")


def test_checkpoint_state_round_trip(hasher, stream):
    """A Nine run's checkpoint carries its hot index; a plain one carries nothing; the hasher a
    checkpoint was trained with comes back from its state and the plain hasher."""
    from engram.retrieval.hot import checkpoint_hasher

    assert hasher.checkpoint_state() == {}
    assert checkpoint_hasher(hasher, {"model": {}}, shared=True) is hasher
    nine = NineHasher(hasher, build_hot_index(hasher, stream, 15), shared=True)
    state = {"model": {}, **nine.checkpoint_state()}
    back = checkpoint_hasher(hasher, state, shared=True)
    assert isinstance(back, NineHasher) and back.index.digest() == nine.index.digest()
    assert back.profile(2, "hot") == nine.profile(0, "hot")  # the stamp names the index
    other = NineHasher(hasher, build_hot_index(hasher, stream, 5), shared=True)
    with pytest.raises(ValueError, match="another hot index"):
        checkpoint_hasher(other, state, shared=True)
    other.load_checkpoint_state(state)  # resuming: the saved index replaces the rebuilt one
    assert other.index.equals(nine.index) and checkpoint_hasher(other, state, True) is other
    with pytest.raises(ValueError, match="no hot index"):
        other.load_checkpoint_state({"model": {}})
