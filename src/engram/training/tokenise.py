"""Tokenising: batches of texts to token ids (on ``prepare``'s worker threads), and the ids of one
shard's documents to its arrays, index and JSON (format in ``shards``).

The threads get batches of about ``BATCH_CHARS`` of text, not whole shards: the cores stay busy to
the end (a shard of text on each leaves one idle while the other finishes) and the first batch
starts as soon as it is read; a batch comes back as int32 arrays, not Python lists, so what is held
until its shard is written is 4 bytes a token. Every document is encoded without special tokens
(``encode_batch_fast``: no offsets computed) and followed by EOS, the layout the training stream and
the Engram hasher (pad = EOS) expect.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .shards import SPLITS, write_shard

BATCH_CHARS = 1 << 20  # text per encode call and per task of a worker: bounds its memory


def batches(docs: list[tuple[str, str, int, str]]) -> list[tuple[int, int]]:
    """[(start, stop)] of ``docs`` in runs of at most ``BATCH_CHARS`` of text (one doc at least)."""
    out, i = [], 0
    while i < len(docs):
        j, size = i, 0
        while j < len(docs) and (j == i or size + len(docs[j][3]) <= BATCH_CHARS):
            size += len(docs[j][3])
            j += 1
        out.append((i, j))
        i = j
    return out


def encode_texts(texts: list[str], tok: Any) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of every text, concatenated: int32 [n], each text's count: int64 [texts])."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # ids only: no offsets kept
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]  # each .ids makes a new list
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(lengths.sum()))
    return flat, lengths


def write_tokens(folder: str, name: str, input_digest: str, docs: list[tuple[str, str, int, str]],
                 parts: list[tuple[np.ndarray, np.ndarray]], eos: int,
                 vocab_size: int) -> dict[str, Any]:
    """Write shard ``name`` from ``docs`` ([(source, id, split 0/1, text)], in order) and their
    ``encode_texts`` results ``parts`` (in order): each document's ids then EOS, in its split.

    Returns the shard's JSON (``shards.write_shard``): digests, token counts, document ids, stats
    {source: {split: {docs, tokens, chars, bytes}}}.
    """
    ids = np.concatenate([p[0] for p in parts])  # [n] every doc's ids, no EOS
    n = np.concatenate([p[1] for p in parts]) + 1  # [docs] tokens of each doc with its EOS
    split = np.asarray([d[2] for d in docs], dtype=np.uint8)  # [docs]
    full = np.empty(int(n.sum()), dtype=np.int32)  # [n + docs] ids and EOS, in input order
    is_eos = np.zeros(len(full), dtype=bool)
    is_eos[np.cumsum(n) - 1] = True
    full[is_eos] = eos
    full[~is_eos] = ids
    token_split = np.repeat(split, n)  # [n + docs]
    streams = {SPLITS[s]: full[token_split == s] for s in (0, 1)}  # [n_split]
    doc_end = np.zeros(len(docs), dtype=np.int64)  # [docs] end of each doc in its split's array
    for s in (0, 1):
        doc_end[split == s] = np.cumsum(n[split == s])
    stats: dict[str, dict[str, dict[str, int]]] = defaultdict(
        lambda: {s: {"docs": 0, "tokens": 0, "chars": 0, "bytes": 0} for s in SPLITS})
    for (source, _, s, text), k in zip(docs, n.tolist()):
        st = stats[source][SPLITS[s]]
        st["docs"] += 1
        st["tokens"] += k
        st["chars"] += len(text)
        st["bytes"] += len(text.encode("utf-8"))
    counts = [np.bincount(streams[s], minlength=vocab_size) for s in SPLITS]  # [V] each
    used = np.flatnonzero(counts[0] + counts[1]).astype(np.int32)  # [k] ids the shard uses
    index = {"doc_split": split, "doc_end": doc_end, "ids": used,
             "train": counts[0][used].astype(np.int64), "val": counts[1][used].astype(np.int64)}
    meta = {"input": input_digest, "docs": len(docs), "doc_ids": [d[1] for d in docs],
            "stats": dict(stats)}
    return write_shard(Path(folder), name, streams, index, meta)
