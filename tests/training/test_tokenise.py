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
