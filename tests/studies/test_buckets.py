"""Where the gain lands (studies/buckets.py): the training counts of each held-out token's n-gram
equal a brute-force count over the windows training drew, that n-gram is what the hash keys on,
and the buckets split the tokens and the difference without loss."""

from collections import Counter

import numpy as np
import pytest
import torch
from test_analyze import TINY

from engram.studies.buckets import (
    BUCKETS,
    bucket_of,
    combine,
    run_buckets,
    summarise,
    training_counts,
    training_windows,
)
from engram.studies.evidence import paired_interval
from engram.training.batches import val_batches
from engram.training.train import TrainConfig, build_run, train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Engram run with two micro-batches a step, stratified windows and 4-grams."""
    cfg = TrainConfig(out_dir=str(tmp_path_factory.mktemp("buckets") / "engram"), steps=3,
                      grad_accum=2, sampling="stratified", max_ngram_size=4, seed=3, **TINY)
    return train(cfg, progress=False)


def test_counts_equal_a_brute_force_count_over_the_trained_windows(run):
    cfg, corpus, hasher = run.cfg, run.corpus, run.hasher
    # the reference windows: the batch source training itself read (loop.train_step's indices)
    source = build_run(cfg, corpus).batches
    trained = [source.batch(s * cfg.grad_accum + m).raw
               for s in range(cfg.steps) for m in range(cfg.grad_accum)]
    val = list(val_batches(corpus.val, 4, cfg.seq_len, corpus, hasher, max_batches=3))
    pad = hasher.pad

    def ngrams(raw: torch.Tensor, n: int):  # x'[t-n+1..t] per position, pad' before the window
        xc = hasher.compression(raw).tolist()
        return [tuple(row[t - j] if t >= j else pad for j in range(n - 1, -1, -1))
                for row in xc for t in range(len(row))]

    got = training_counts(training_windows(cfg, corpus, cfg.steps),
                          np.concatenate([b.raw.numpy() for b in val]), hasher)
    assert sorted(got) == [2, 3, 4]
    for n in (2, 3, 4):
        seen = Counter(g for raw in trained for g in ngrams(raw, n))
        want = [seen[g] for b in val for g in ngrams(b.raw, n)]
        assert got[n].tolist() == want, n
        assert 0 < (got[n] > 0).sum() < len(want)  # both kinds of token occur
        # the counted n-gram is the one the hash keys on: equal n-grams read equal rows
        k = hasher.config.n_head_per_ngram
        rows = torch.cat([b.hash_ids[min(b.hash_ids)] for b in val]).flatten(0, 1)
        rows = rows[:, (n - 2) * k:(n - 1) * k].tolist()
        keyed: dict = {}
        for g, r in zip((g for b in val for g in ngrams(b.raw, n)), rows):
            assert keyed.setdefault(g, r) == r
    # the count falls with the order: an n-gram occurs at most as often as its (n-1)-suffix
    assert (got[3] <= got[2]).all() and (got[4] <= got[3]).all()


def test_buckets_split_the_tokens_and_the_difference(run):
    cfg, corpus, hasher = run.cfg, run.corpus, run.hasher
    val = list(val_batches(corpus.val, 4, cfg.seq_len, corpus, hasher, max_batches=3))
    m = sum(b.raw.numel() for b in val)
    rng = np.random.default_rng(0)  # per-token losses of three models (only their sums matter)
    nll = {k: rng.gamma(2.0, 2.0, m) for k in ("engram", "dense", "pathway")}
    res = run_buckets(cfg, run.corpus, hasher, cfg.out_dir, val, nll)
    assert res["steps"] == 3 and res["training_windows"] == 3 * 2 * cfg.batch_size
    assert res["tokens"] == m
    for n, rows in res["orders"].items():
        assert list(rows) == list(BUCKETS)
        assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
        assert sum(r["n"] for r in rows.values()) == m
        for o in ("dense", "pathway"):  # the buckets' parts add up to the whole difference
            parts = sum(r["part"][o] for r in rows.values() if r["part"][o] is not None)
            assert parts == pytest.approx(res["all"]["diff"][o])
            assert res["all"]["diff"][o] == pytest.approx((nll["engram"] - nll[o]).mean())
    assert bucket_of(np.array([0, 1, 9, 10, 99, 100, 10**6])).tolist() == [0, 1, 1, 2, 2, 3, 3]


def test_combine_applies_the_rule_and_the_paired_interval():
    def one(e, d, share):
        row = {"n": 10, "share": share, "nll": {"engram": e, "dense": d}, "diff": {"dense": e - d},
               "part": {"dense": share * (e - d)}}
        empty = {"n": 0, "share": 0.0, "nll": {"engram": None, "dense": None},
                 "diff": {"dense": None}, "part": {"dense": None}}
        return {"models": ["engram", "dense"], "tokens": 20, "all": row,
                "orders": {"2": {"0": row, "1-9": empty, "10-99": row, "100+": row}}}

    seeds = [one(3.0, 3.5, 0.5), one(3.1, 3.5, 0.5), one(3.05, 3.6, 0.5)]
    c = combine(seeds)
    v = c["orders"]["2"]["0"]["vs"]["dense"]
    diffs = [-0.5, -0.4, -0.55]
    assert v["per_seed"] == pytest.approx(diffs) and v["mean"] == pytest.approx(np.mean(diffs))
    # the rule: engram spread 0.1, dense 0.1; |mean| 0.483 > 2 x 0.1
    assert v["spread"] == pytest.approx(0.1) and v["resolved"]
    assert v["interval"] == pytest.approx(paired_interval(diffs))
    empty = c["orders"]["2"]["1-9"]["vs"]["dense"]
    assert empty["mean"] is None and not empty["resolved"] and empty["interval"] is None
    assert summarise({2: np.array([0, 5])}, {"engram": np.array([1.0, 2.0])})["models"] == [
        "engram"]
