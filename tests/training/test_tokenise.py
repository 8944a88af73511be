"""A shard written from batch results equals the plain layout: each document's ids then EOS, in
its split, whatever the batching (the workers' batches must not change a token)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engram.retrieval.compress import default_tokenizer
from engram.training import tokenise
from engram.training.shards import shard_files

EOS = 1


@pytest.mark.parametrize("batch_chars", [1, 40, 1 << 20])
def test_batched_shard_is_each_document_then_eos_in_its_split(tmp_path, monkeypatch, batch_chars):
    tok = default_tokenizer()
    texts = ["In the beginning", "", "God created 天地", "the heaven and the earth.\n" * 3, "é"]
    docs = [("a" if i < 3 else "b", f"d{i}", int(i in (1, 3)), t) for i, t in enumerate(texts)]
    monkeypatch.setattr(tokenise, "BATCH_CHARS", batch_chars)
    runs = tokenise.batches(docs)
    assert [d for i, j in runs for d in docs[i:j]] == docs
    parts = [tokenise.encode_texts([d[3] for d in docs[i:j]], tok) for i, j in runs]
    tokenise.write_tokens(str(tmp_path), "00000", "digest", docs, parts, EOS, 129280)

    want = {0: [], 1: []}
    ends = []
    for _, _, split, text in docs:  # the reference: one document at a time
        want[split] += tok.encode(text, add_special_tokens=False).ids + [EOS]
        ends.append(len(want[split]))
    files = shard_files(tmp_path, "00000")
    for split, name in ((0, "train"), (1, "val")):
        got = np.load(files[name])
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(want[split], dtype=np.int32))
    with np.load(files["index"]) as index:
        np.testing.assert_array_equal(index["doc_end"], ends)
        np.testing.assert_array_equal(index["doc_split"], [d[2] for d in docs])
        all_ids = np.asarray(want[0] + want[1])
        np.testing.assert_array_equal(index["ids"], np.unique(all_ids))
    meta = json.loads((tmp_path / "00000.json").read_text())
    assert meta["stats"]["a"]["val"] == {"docs": 1, "tokens": 1, "chars": 0, "bytes": 0}
    assert meta["stats"]["b"]["train"]["bytes"] == len("é".encode())


def _long_text() -> str:
    """Real text of two kinds (English verse, Chinese news), ~300K chars."""
    from engram.training.sources import load_documents

    parts = []
    for source in ("kjv", "peoples-daily"):
        parts += [d.text for d in load_documents(source)][:60]
    return "\n".join(parts)


def test_a_long_document_is_encoded_in_pieces_to_the_same_ids(monkeypatch):
    tok = default_tokenizer()
    text = _long_text()
    monkeypatch.setattr(tokenise, "PIECE_CHARS", 6000)
    cut = tokenise.pieces(text, tok)
    assert "".join(cut) == text and max(map(len, cut)) <= 6000  # a cut found every time
    ids, lengths = tokenise.encode_texts(["short", text, "end"], tok)
    want = [tok.encode(t, add_special_tokens=False).ids for t in ("short", text, "end")]
    assert lengths.tolist() == [len(w) for w in want]
    np.testing.assert_array_equal(ids, np.asarray(want[0] + want[1] + want[2], dtype=np.int32))


def test_no_cut_where_the_tokenizer_would_tokenise_the_pieces_differently(monkeypatch):
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(default_tokenizer().to_str())
    # A space added before every text: a piece would start with a token the whole text lacks there.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    text = _long_text()[:60_000]
    monkeypatch.setattr(tokenise, "PIECE_CHARS", 6000)
    assert tokenise.pieces(text, tok) == [text]
    ids, _ = tokenise.encode_texts([text], tok)
    np.testing.assert_array_equal(ids, tok.encode(text, add_special_tokens=False).ids)
