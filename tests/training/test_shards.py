"""A prepared folder at train time: memory-mapped streams (== one array in memory), what is refused
and why, training and evaluating on it, the full vocabulary."""

import json
import shutil

import numpy as np
import pytest
import torch

from engram.artifacts.checkpoint import CheckpointError
from engram.errors import UserError
from engram.training.corpus import DataConfig, build_corpus, open_corpus
from engram.training.prepare import PrepareConfig, prepare
from engram.training.sources import load_documents
from engram.training.streams import NpyFile, TokenStream
from engram.training.train import TrainConfig, train

TINY = dict(n_layer=1, d_model=32, n_head=2, seq_len=16, batch_size=4, table_size=101,
            n_embed_per_ngram=16, n_head_per_ngram=2, engram_layers=(0,), steps=4, warmup=1,
            eval_every=2, eval_batches=2, ckpt_every=2, log_every=1, head_cutoffs=(64,))


def make(tmp_path_factory, name: str, texts: list[str], shard_mb: float, **kw) -> str:
    base = tmp_path_factory.mktemp(name)
    src = base / "in"  # the same name everywhere: document ids "in/000.txt", the same split
    src.mkdir()
    for i, t in enumerate(texts):
        (src / f"{i:03d}.txt").write_text(t)
    out = base / "data"
    prepare(PrepareConfig(out=str(out), input=[str(src)], workers=0, val_fraction=0.3,
                          shard_mb=shard_mb, **kw), progress=False)
    return str(out)


@pytest.fixture(scope="module")
def texts():
    return [d.text for d in load_documents("kjv", max_chars=80_000)]


@pytest.fixture(scope="module")
def many(tmp_path_factory, texts):  # several shards
    return make(tmp_path_factory, "many", texts, 0.01)


@pytest.fixture(scope="module")
def one(tmp_path_factory, texts):  # the same documents in one shard
    return make(tmp_path_factory, "one", texts, 100)


# -- streams ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["files", "memory"])
def test_token_stream_reads_across_shards_like_one_array(tmp_path, where):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50, n).astype(np.int32) for n in (5, 0, 1, 7, 3)]
    whole = np.concatenate(parts)
    if where == "files":  # positioned reads from .npy files, as training reads its shards
        for i, p in enumerate(parts):
            np.save(tmp_path / f"{i}.npy", p)
        parts = [NpyFile(tmp_path / f"{i}.npy") for i in range(len(parts))]
    s = TokenStream(parts)
    assert len(s) == len(whole) == 16
    for lo in range(17):
        for hi in range(lo, 17):
            np.testing.assert_array_equal(s.read(lo, hi), whole[lo:hi])
    starts = np.array([0, 4, 5, 12, 9])
    np.testing.assert_array_equal(s.windows(starts, 4), whole[starts[:, None] + np.arange(4)])
    np.testing.assert_array_equal(s.array(), whole)
    with pytest.raises(IndexError):
        s.read(10, 17)


def test_sharded_corpus_equals_one_stream_and_trains_the_same(tmp_path, many, one):
    a, b = open_corpus(many), open_corpus(one)
    assert len(a.manifest["shards"]) >= 6 and len(b.manifest["shards"]) == 1
    np.testing.assert_array_equal(a.vocab, b.vocab)
    np.testing.assert_array_equal(a.frequencies(), b.frequencies())
    # Windows across shard boundaries, batches and losses: the memory map is invisible.
    ra = train(TrainConfig(out_dir=str(tmp_path / "a"), data=many, **TINY), progress=False)
    rb = train(TrainConfig(out_dir=str(tmp_path / "b"), data=one, **TINY), progress=False)
    assert [h["loss"] for h in ra.history] == [h["loss"] for h in rb.history]
    assert ra.history[-1]["val_loss"] == rb.history[-1]["val_loss"]
    counts = np.bincount(a.to_local(a.train), minlength=a.vocab_size)
    np.testing.assert_array_equal(a.frequencies(), counts)  # the stored counts are the stream's


def test_full_vocab_scores_any_text(tmp_path, many):
    from engram.serving.runtime import Runtime

    corpus = open_corpus(many, vocab="full")
    tok = corpus.tokenizer()
    assert corpus.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    run = train(TrainConfig(out_dir=str(tmp_path / "full"), data=many, vocab="full",
                            **{**TINY, "steps": 2}), progress=False)
    assert run.model.config.vocab_size == corpus.vocab_size
    raw = np.asarray(tok.encode("量子力学 and the Lord said unto Moses").ids + [1], dtype=np.int64)
    unseen = [int(i) for i in raw if corpus.counts[0][i] == 0]
    assert unseen  # Chinese physics is not in the King James Bible
    rank = run.model.head.rank  # adaptive classes ordered by training frequency: unseen ids last
    seen = int((corpus.counts[0] > 0).sum())
    assert int(rank[int(np.argmax(corpus.counts[0]))]) == 0
    assert all(int(rank[i]) >= seen for i in unseen)
    res = Runtime.from_parts(run.model, run.hasher, corpus.vocab).score(raw, 16)
    assert res["left_out"] == 0 and np.isfinite(res["loss"])
    small = train(TrainConfig(out_dir=str(tmp_path / "r"), data=many, **{**TINY, "steps": 2}),
                  progress=False)  # the corpus's ids only: unseen tokens are context, not scored
    assert small.corpus.vocab_size < corpus.vocab_size
    res = Runtime.from_parts(small.model, small.hasher, small.corpus.vocab).score(raw, 16)
    assert res["left_out"] == int(np.isin(raw[1:], small.corpus.vocab, invert=True).sum()) > 0


# -- refused at train time, naming why -------------------------------------------------------------

@pytest.mark.parametrize("damage, match", [
    ("shard", "shard 00001 \\(train\\) is corrupt"),
    ("truncated", "shard 00002 \\(val\\) is corrupt"),
    ("missing", "00001.index.npz is missing"),
    ("tokenizer", "tokenizer.json is not the one its shards were made with"),
    ("compression", "compression.npy is not the one"),
    ("format", "was written in format 'engram-shards-0'"),
    ("unfinished", "has shards but no manifest: its `engram prepare` did not finish"),
    ("empty", "is not a prepared corpus"),
])
def test_damaged_folder_is_refused(tmp_path, many, damage, match):
    from engram.cli import main

    d = tmp_path / "data"
    shutil.copytree(many, d)
    shards = d / "shards"
    if damage == "shard":
        a = np.load(shards / "00001.train.npy")
        a[3] += 1
        np.save(shards / "00001.train.npy", a)
    elif damage == "truncated":
        p = shards / "00002.val.npy"
        p.write_bytes(p.read_bytes()[:-8])
    elif damage == "missing":
        (shards / "00001.index.npz").unlink()
    elif damage == "tokenizer":
        from tokenizers import Tokenizer, models
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(d / "tokenizer.json"))
    elif damage == "compression":
        np.save(d / "compression.npy", np.zeros(10, dtype=np.int64))
    elif damage == "format":
        m = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps({**m, "format": "engram-shards-0"}))
    elif damage == "unfinished":
        (d / "manifest.json").unlink()
    else:
        shutil.rmtree(d)
        d.mkdir()
    with pytest.raises(UserError, match=match):
        build_corpus(DataConfig(data=str(d)))
    args = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in TINY.items()]
    assert main(["train", f"--data={d}", f"--out_dir={tmp_path / 'run'}", *args]) == 2


def test_a_run_resumes_on_its_data_only(tmp_path, tmp_path_factory, many, texts):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), data=many, **{**TINY, "steps": 2})
    train(cfg, progress=False)
    moved = tmp_path / "moved"
    shutil.copytree(many, moved)  # the same tokens elsewhere: the same data
    run = train(TrainConfig(out_dir=str(tmp_path / "run"), data=str(moved), **TINY), progress=False)
    assert run.step == 4
    other = make(tmp_path_factory, "other", texts[::-1], 0.02)
    with pytest.raises(CheckpointError, match="trained on other data: .* holds other tokens"):
        train(TrainConfig(out_dir=str(tmp_path / "run"), data=other, **{**TINY, "steps": 6}),
              progress=False)


def test_eval_on_held_out_shards(tmp_path, tmp_path_factory, many, texts):
    from engram.studies.evaluate import EvalConfig, run_eval

    train(TrainConfig(out_dir=str(tmp_path / "run"), data=many, **TINY), progress=False)
    res = run_eval(str(tmp_path / "run"), EvalConfig(data=many), progress=False)
    corpus = open_corpus(many)
    assert res["tokens"] == len(corpus.streams["val"]) and res["left_out"] == 0
    assert res["documents"] == len(corpus.doc_ids["val"]) and np.isfinite(res["loss"])
    spec = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    t.save(str(spec))
    bpe = make(tmp_path_factory, "bpe", texts, 100, tokenizer=str(spec))
    with pytest.raises(UserError, match="tokenised with another tokenizer than the run's"):
        run_eval(str(tmp_path / "run"), EvalConfig(data=bpe), progress=False)


def test_a_corpus_too_small_for_one_batch(tmp_path, tmp_path_factory):
    tiny = make(tmp_path_factory, "tiny", ["In the beginning.", "And the earth.", "Light.",
                                           "Darkness.", "Evening.", "Morning."], 100)
    with pytest.raises(UserError, match="seq_len=16 needs at least 17 tokens; the stream has"):
        train(TrainConfig(out_dir=str(tmp_path / "r"), data=tiny, **TINY), progress=False)


def test_custom_tokenizer_trains_with_its_stored_compression(tmp_path, tmp_path_factory, texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    spec = tmp_path / "tokenizer.json"
    t.save(str(spec))
    data = make(tmp_path_factory, "bpe2", texts, 0.02, tokenizer=str(spec))
    run = train(TrainConfig(out_dir=str(tmp_path / "r"), data=data, **TINY), progress=False)
    corpus = open_corpus(data)
    assert torch.equal(run.hasher.compression.table(), corpus.compression().table())
    assert len(run.hasher.compression) < 300 and np.isfinite(run.history[-1]["val_loss"])
