"""The Nine LM: an empty hot tier is exactly the plain hashed model; shared tables count once."""

import numpy as np
import pytest
import torch

from engram.models.model import EngramLM, ModelConfig
from engram.models.nine_model import build_nine_lm, nine_param_counts
from engram.retrieval.config import EngramConfig
from engram.retrieval.hashing import NgramHasher
from engram.retrieval.hot import HotIndex, NineHasher, build_hot_index

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(layers=(1,)):
    ec = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                      n_head_per_ngram=2, layer_ids=list(layers), pad_id=0)
    return ModelConfig(vocab_size=300, n_layer=3, d_model=32, n_head=2, max_seq_len=32, engram=ec,
                       sparse_tables=True)


def _raw(seed=0):
    from engram.training.corpus import DataConfig, build_corpus

    c = build_corpus(DataConfig(max_chars=20_000))
    return torch.from_numpy((c.train[seed * 64:seed * 64 + 64] % 300).astype(np.int64).reshape(2, 32))


def test_empty_hot_tier_is_exactly_the_plain_hashed_model(tiny_lookup):
    cfg = _config()
    torch.manual_seed(0)
    plain = EngramLM(cfg)
    nine = build_nine_lm(cfg, hot_slots=0, shared=False)
    sd = {k.replace("engram.table.weight", "engram.table.cold.weight"): v
          for k, v in plain.state_dict().items()}
    nine.load_state_dict(sd)
    hasher = NgramHasher(cfg.engram, tiny_lookup)
    empty = NineHasher(hasher, HotIndex.build(torch.zeros(0, dtype=torch.long)), shared=False)
    raw = _raw()
    tokens, targets = raw[:, :-1], raw[:, 1:]
    lp = plain.loss(plain(tokens, hasher.hash(tokens)), targets)
    ln = nine.loss(nine(tokens, empty.hash(tokens)), targets)
    assert torch.equal(lp, ln)
    lp.backward()
    ln.backward()
    gp = dict(plain.named_parameters())
    for name, p in nine.named_parameters():
        q = gp[name.replace("table.cold.", "table.")]
        a, b = p.grad, q.grad
        a, b = (a.to_dense(), b.to_dense()) if a.is_sparse else (a, b)
        assert torch.equal(a, b), name


def test_shared_table_set_counts_once_and_reads_hot_rows(tiny_lookup):
    cfg = _config(layers=(0, 2))
    hasher = NgramHasher(cfg.engram, tiny_lookup)
    stream = _raw(1).flatten().numpy()
    index = build_hot_index(hasher, stream, 5)
    nine = build_nine_lm(cfg, hot_slots=index.num_slots, shared=True)
    stores = {id(nine.blocks[i].engram.table) for i in (0, 2)}
    assert len(stores) == 1
    pc = nine_param_counts(nine)
    store = nine.blocks[0].engram.table
    assert pc["hot"] == 10 * 16 and pc["cold"] == store.cold.weight.numel()
    assert pc["total"] == sum(p.numel() for p in nine.parameters())
    ids = NineHasher(hasher, index, shared=True).hash(_raw(1))
    assert (ids[0][..., -2:] >= 0).any()
    out = nine(_raw(1), ids, return_gates=True)
    assert set(out.gates) == {0, 2}
    nine.loss(out, _raw(1)).backward()
    assert store.hot.weight.grad is not None  # the hot rows were read and trained


def test_nine_needs_an_engram_config():
    with pytest.raises(ValueError, match="Engram config"):
        build_nine_lm(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=2), 0)
