"""engram.training.corpus and engram.training.batches on real text from the packages (small
prefixes via max_chars, a tmp cache dir): the built-in sources, prepared into a cache folder."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import engram
from engram.errors import UserError
from engram.training.batches import Batch, TokenBatches, val_batches
from engram.training.corpus import Corpus, DataConfig, build_corpus, load_documents

MAX_CHARS = 40_000
EOS = 1


@pytest.fixture(scope="module")
def tok():
    return engram.default_tokenizer()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def small(cache_dir, **kw) -> DataConfig:
    kw = {"max_chars": MAX_CHARS, "val_fraction": 0.2, **kw}
    return DataConfig(cache_dir=str(cache_dir), **kw)


@pytest.fixture(scope="module")
def corpus(cache, tok) -> Corpus:
    return build_corpus(small(cache), tok)


@pytest.fixture(scope="module")
def hasher():
    cfg = engram.EngramConfig(engram_vocab_size=[1009, 2003], max_ngram_size=3, n_embed_per_ngram=16,
                              n_head_per_ngram=2, layer_ids=[0, 1], pad_id=1)
    return engram.NgramHasher(cfg, engram.build_compression())


def digest(c: Corpus) -> str:
    return hashlib.sha256(c.train.tobytes() + b"|" + c.val.tobytes()).hexdigest()


def segments(stream: np.ndarray) -> list[tuple]:
    """The documents of a stream: every document ends with EOS."""
    assert stream[-1] == EOS
    cuts = np.flatnonzero(stream == EOS)
    return [tuple(s) for s in np.split(stream, cuts + 1)[:-1]]


# -- sources ------------------------------------------------------------------------------------------

def test_kjv_is_the_bible_by_chapter():
    docs = load_documents("kjv")
    assert len(docs) == 1189  # chapters of the Protestant canon
    assert docs[0].id == "kjv/01-001" and docs[-1].id == "kjv/66-022"
    assert docs[0].text.startswith("In the beginning God created the heaven and the earth.")
    assert docs[-1].text.endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert not any(re.search(r"(^|\s)\d+\. |\[|\]", d.text) for d in docs[:50])  # no verse numbers


def test_peoples_daily_is_plain_chinese_by_article():
    docs = load_documents("peoples-daily", max_chars=200_000)
    assert len(docs) > 100 and len({d.id for d in docs}) == len(docs)
    assert docs[0].text.startswith("迈向充满希望的新世纪")
    assert "江泽民" in docs[0].text  # "江/nr  泽民/nr" joined with the tags gone
    text = "".join(d.text for d in docs)
    assert not re.search(r"/[A-Za-z]", text) and "  " not in text
    assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 0.6 * len(text)


def test_max_chars_keeps_a_prefix():
    full, cut = load_documents("kjv"), load_documents("kjv", max_chars=10_000)
    assert sum(len(d.text) for d in cut) == 10_000
    assert [d.id for d in cut] == [d.id for d in full[:len(cut)]]
    assert cut[-1].text == full[len(cut) - 1].text[:len(cut[-1].text)]


def test_unknown_and_missing_sources():
    with pytest.raises(ValueError, match="unknown source 'wiki'"):
        DataConfig(sources=("kjv", "wiki"))
    with pytest.raises(ValueError, match="unknown source"):
        load_documents("wiki")
    with pytest.raises(ValueError, match="tuple of names"):
        DataConfig(sources="kjv")
    with pytest.raises(ValueError, match="non-empty"):
        DataConfig(sources=())
    if not list(Path("/usr/share/doc").glob("linux-doc-*/html/_sources")):
        with pytest.raises(FileNotFoundError, match="apt-get install linux-doc"):
            load_documents("linux-doc")


def test_rst_sources_are_one_document_per_file(tmp_path):
    from engram.training.corpus import SOURCES, _rst_tree
    assert {"linux-doc", "python-doc"} <= set(SOURCES)
    root = tmp_path / "doc-1" / "html" / "_sources"
    (root / "sub").mkdir(parents=True)
    (root / "b.rst.txt").write_text("Title\n=====\nbody\n")
    (root / "sub" / "a.rst.txt").write_text("Sub\n")
    (root / "notes.txt").write_text("not rst")
    docs = list(_rst_tree("t", str(tmp_path / "doc-*" / "html" / "_sources"), "t-doc")())
    assert [(d.id, d.text) for d in docs] == [("t/b.rst.txt", "Title\n=====\nbody\n"),
                                              ("t/sub/a.rst.txt", "Sub\n")]
    with pytest.raises(FileNotFoundError, match="apt-get install t-doc"):
        list(_rst_tree("t", str(tmp_path / "none-*"), "t-doc")())


@pytest.mark.parametrize("kw", [{"val_fraction": 0.0}, {"val_fraction": 1.0}, {"max_chars": 0},
                                {"split_seed": -1}])
def test_bad_config(kw):
    with pytest.raises(ValueError):
        DataConfig(**kw)


# -- corpus, split, cache -------------------------------------------------------------------------

def test_corpus_layout_and_stats(corpus):
    assert corpus.train.dtype == np.int32 and corpus.val.dtype == np.int32
    assert corpus.eos_id == EOS
    st = corpus.stats()
    for split in ("train", "val"):
        stream = getattr(corpus, split)
        assert (stream == EOS).sum() == len(corpus.doc_ids[split]) == st["total"][split]["docs"]
        assert st["total"][split]["tokens"] == len(stream)
        for src in ("kjv", "peoples-daily"):
            assert st[src][split]["docs"] > 0 and st[src][split]["tokens"] > 0
    assert sum(st["kjv"][s]["chars"] for s in ("train", "val")) == MAX_CHARS
    assert sum(st["peoples-daily"][s]["chars"] for s in ("train", "val")) == MAX_CHARS


def test_tokens_decode_to_the_source_text(corpus, tok):
    first = list(segments(corpus.train)[0][:-1])
    text = tok.decode(first, skip_special_tokens=False)
    assert text == load_documents("kjv", MAX_CHARS)[0].text  # full tokenizer, no BOS added


def test_split_is_by_document_and_disjoint(corpus):
    train, val = set(corpus.doc_ids["train"]), set(corpus.doc_ids["val"])
    assert train and val and not train & val
    every = {d.id for s in ("kjv", "peoples-daily") for d in load_documents(s, MAX_CHARS)}
    assert train | val == every
    assert not set(segments(corpus.train)) & set(segments(corpus.val))  # no text in both


def test_split_is_deterministic_and_seeded(corpus, tmp_path, tok):
    again = build_corpus(small(tmp_path / "a"), tok)  # rebuilt from scratch, not read
    assert digest(again) == digest(corpus) and again.doc_ids == corpus.doc_ids
    other = build_corpus(small(tmp_path / "b", split_seed=1), tok)
    assert other.doc_ids["val"] != corpus.doc_ids["val"]


def test_split_is_stable_across_processes(corpus, tmp_path):
    code = ("import hashlib, sys; from engram.training.corpus import DataConfig, build_corpus; "
            f"c = build_corpus(DataConfig(cache_dir=sys.argv[1], max_chars={MAX_CHARS}, val_fraction=0.2)); "
            "print(hashlib.sha256(c.train.tobytes() + b'|' + c.val.tobytes()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str hash salt must not matter
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == digest(corpus)


def test_cache_is_a_prepared_folder_and_is_read(cache, corpus, tok):
    (folder,) = cache.iterdir()  # the built-in sources go through `engram prepare`'s format
    assert {p.name for p in folder.iterdir()} >= {"manifest.json", "shards", "tokenizer.json",
                                                 "compression.npy", "counts.npy"}
    assert not list(folder.rglob("*.tmp"))
    # Prove the second call reads the cache: a marker put in the manifest comes back out.
    manifest = folder / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "marker": 1}))
    again = build_corpus(small(cache), tok)
    assert again.manifest["marker"] == 1
    assert digest(again) == digest(corpus) and again.doc_ids == corpus.doc_ids
    np.testing.assert_array_equal(again.vocab, corpus.vocab)


def test_cache_is_keyed(tmp_path, tok):
    build_corpus(small(tmp_path), tok)
    build_corpus(small(tmp_path, max_chars=MAX_CHARS // 2), tok)
    build_corpus(small(tmp_path, val_fraction=0.3), tok)
    assert len(list(tmp_path.glob("*/manifest.json"))) == 3


def test_env_var_sets_the_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_CACHE", str(tmp_path))
    assert DataConfig().resolved_cache_dir() == tmp_path / "data"


@pytest.mark.parametrize("damage", ["garbage", "flipped", "manifest"])
def test_corrupt_cache_is_rebuilt(tmp_path, tok, damage):
    # Digest first: the damage below is done in place, under this process's memory map (a
    # SIGBUS to touch after truncation); prepare itself only ever replaces files by renaming.
    good = digest(build_corpus(small(tmp_path), tok))
    (npy,) = tmp_path.glob("*/shards/*.train.npy")
    if damage == "garbage":
        npy.write_bytes(b"not a numpy file")
    elif damage == "flipped":  # valid header, one token changed: only the digest can tell
        arr = np.load(npy)
        arr[len(arr) // 2] += 1
        np.save(npy, arr)
    else:
        (meta,) = tmp_path.glob("*/manifest.json")
        meta.write_text(meta.read_text()[:100])
    with pytest.warns(UserWarning, match="data cache .* cannot be used"):
        again = build_corpus(small(tmp_path), tok)
    assert digest(again) == good
    assert digest(build_corpus(small(tmp_path), tok)) == good  # and the cache is whole again


def test_empty_splits_raise(tmp_path, tok):
    # Two tiny documents: with these fractions (seed 0) both land on one side.
    with pytest.raises(ValueError, match="leaves val empty"):
        build_corpus(small(tmp_path, max_chars=100, val_fraction=0.01), tok)
    with pytest.raises(ValueError, match="leaves train empty"):
        build_corpus(small(tmp_path, max_chars=100, val_fraction=0.99), tok)


def test_tokenizer_without_eos_raises(tmp_path):
    from tokenizers import Tokenizer, models
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="end▁of▁sentence"):
        build_corpus(small(tmp_path), bare)


# -- vocabulary -----------------------------------------------------------------------------------------

def test_vocab_and_local_ids(corpus):
    v = corpus.vocab
    np.testing.assert_array_equal(v, np.unique(np.concatenate([corpus.train, corpus.val])))
    assert EOS in v and corpus.vocab_size == len(v)
    local = corpus.to_local(corpus.val)
    assert local.dtype == np.int64 and 0 <= local.min() and local.max() < corpus.vocab_size
    np.testing.assert_array_equal(corpus.to_raw(local), corpus.val)
    t = torch.from_numpy(corpus.train[:100].astype(np.int64)).view(4, 25)
    lt = corpus.to_local(t)
    assert isinstance(lt, torch.Tensor) and lt.dtype == torch.long and lt.shape == (4, 25)
    assert torch.equal(corpus.to_raw(lt), t)
    unused = int(np.setdiff1d(np.arange(v.max()), v)[0])
    for bad in (unused, int(v.max()) + 1, -3):
        with pytest.raises(ValueError, match=f"raw id {bad} is not in the corpus vocabulary"):
            corpus.to_local(np.array([v[0], bad]))
    with pytest.raises(ValueError, match="local ids"):
        corpus.to_raw(np.array([corpus.vocab_size]))


# -- batches ----------------------------------------------------------------------------------------------

def test_batches_are_a_function_of_seed_and_step(corpus, hasher):
    a = TokenBatches(corpus.train, 4, 32, corpus, hasher, seed=7)
    b = TokenBatches(corpus.train, 4, 32, corpus, hasher, seed=7)
    b.batch(0), b.batch(1)  # history must not matter: a resumed run starts at step k
    for step in (3, 1000):
        x, y = a.batch(step), b.batch(step)
        for f in ("raw", "inputs", "targets"):
            assert torch.equal(getattr(x, f), getattr(y, f))
    assert not torch.equal(a.batch(0).raw, a.batch(1).raw)
    assert not torch.equal(a.batch(0).raw, TokenBatches(corpus.train, 4, 32, corpus, seed=8).batch(0).raw)


def test_stratified_batches(corpus):
    """Window i of every batch starts in the i-th b-th of the stream; (seed, step) alone decides;
    the seed changes the windows; a stream too short for b strata falls back to uniform."""
    b, t = 8, 32
    span = len(corpus.train) - t
    edges = np.arange(b + 1) * span // b
    st = TokenBatches(corpus.train, b, t, corpus, seed=3, sampling="stratified")
    windows = np.lib.stride_tricks.sliding_window_view(corpus.train, t)
    seen = set()
    for step in range(20):
        raw = st.batch(step).raw.numpy()
        for i in range(b):  # the window's start: where its tokens occur inside stratum i
            lo, hi = edges[i], edges[i + 1]
            assert (windows[lo:hi] == raw[i]).all(axis=1).any(), (step, i)
        seen.add(raw.tobytes())
    assert len(seen) == 20
    again = TokenBatches(corpus.train, b, t, corpus, seed=3, sampling="stratified")
    assert torch.equal(again.batch(7).raw, st.batch(7).raw)
    other = TokenBatches(corpus.train, b, t, corpus, seed=4, sampling="stratified")
    assert not torch.equal(other.batch(7).raw, st.batch(7).raw)
    tiny = np.asarray(corpus.train[:t + 3])  # 3 starts, 8 windows: no 8 strata
    assert TokenBatches(tiny, b, t, corpus, seed=0, sampling="stratified").batch(0).raw.shape == (b, t)
    with pytest.raises(UserError, match="sampling must be one of"):
        TokenBatches(corpus.train, b, t, corpus, sampling="sorted")


def test_batch_contents(corpus, hasher):
    bt = TokenBatches(corpus.train, 3, 16, corpus, hasher, seed=0).batch(5)
    assert isinstance(bt, Batch)
    for f in (bt.raw, bt.inputs, bt.targets):
        assert f.shape == (3, 16) and f.dtype == torch.long
    assert torch.equal(corpus.to_raw(bt.inputs), bt.raw)
    assert torch.equal(bt.targets[:, :-1], bt.inputs[:, 1:])  # next-token targets
    windows = np.lib.stride_tricks.sliding_window_view(corpus.train, 17)
    for row in range(3):  # each row + its last target is a contiguous window of the stream
        full = np.append(bt.raw[row].numpy(), corpus.to_raw(bt.targets[row, -1:].numpy()))
        assert (windows == full).all(axis=1).any()
    ref = hasher.hash(bt.raw)
    assert sorted(bt.hash_ids) == [0, 1]
    for lid in (0, 1):
        assert bt.hash_ids[lid].shape == (3, 16, 4) and torch.equal(bt.hash_ids[lid], ref[lid])
    assert TokenBatches(corpus.train, 3, 16, corpus, None).batch(5).hash_ids == {}


def test_val_batches_sweep(corpus, hasher):
    t, b = 24, 5
    batches = list(val_batches(corpus.val, b, t, corpus, hasher))
    windows = (len(corpus.val) - 1) // t
    assert len(batches) == -(-windows // b) and sum(x.raw.shape[0] for x in batches) == windows
    raw = torch.cat([x.raw for x in batches]).flatten().numpy()
    np.testing.assert_array_equal(raw, corpus.val[:windows * t])  # in order, no overlap, no gap
    tgt = corpus.to_raw(torch.cat([x.targets for x in batches]).flatten().numpy())
    np.testing.assert_array_equal(tgt, corpus.val[1:windows * t + 1])
    again = list(val_batches(corpus.val, b, t, corpus, hasher, max_batches=2))
    assert len(again) == 2 and torch.equal(again[0].hash_ids[1], hasher.hash(again[0].raw)[1])
    # A capped sweep spreads its windows over the whole stream, first to last window.
    kept = torch.cat([x.raw for x in again])
    assert torch.equal(kept[0], batches[0].raw[0]) and torch.equal(kept[-1], batches[-1].raw[-1])
    assert kept.shape[0] == 2 * b and len({tuple(r.tolist()) for r in kept}) == 2 * b


def test_bad_batch_inputs(corpus):
    n = len(corpus.val)
    with pytest.raises(ValueError, match=f"seq_len={n} needs at least {n + 1} tokens"):
        TokenBatches(corpus.val, 2, n, corpus)
    with pytest.raises(ValueError, match="seq_len"):
        val_batches(corpus.val, 2, n, corpus)  # raised at the call, not at the first next()
    with pytest.raises(ValueError, match="the stream has 0"):
        TokenBatches(np.array([], dtype=np.int32), 2, 8, corpus)
    with pytest.raises(ValueError, match="1-D integer"):
        TokenBatches(corpus.val.reshape(1, -1), 2, 8, corpus)
    with pytest.raises(ValueError, match="batch_size"):
        TokenBatches(corpus.val, 0, 8, corpus)
    with pytest.raises(ValueError, match="not in the corpus vocabulary"):  # mapped per batch
        TokenBatches(np.full(100, int(corpus.vocab.max()) + 5), 2, 8, corpus).batch(0)
    with pytest.raises(ValueError, match="step"):
        TokenBatches(corpus.val, 2, 8, corpus).batch(-1)
