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
from typing import Any, Iterator

import numpy as np

from .shards import SPLITS, write_shard

BATCH_CHARS = 1 << 20  # text per task of a worker: bounds its memory
# Text per encode call within a task. A call cannot be stopped (Rust holds the thread), so Ctrl-C
# waits for the calls in flight: ~0.4 s each at 256K on a 2-core Zen 4 (2 s at 1M); as fast.
ENCODE_CHARS = 1 << 18
# The tokenizer takes ~100 bytes of memory per byte of a document while encoding it (a 2 MB document
# peaked at +220 MiB), so a longer document is encoded in pieces (``pieces``): with 64K, prepare's
# peak over 1 GB of text was 0.88x what it was with 256K (two threads' documents at once).
PIECE_CHARS = 1 << 16
CHECK_CHARS = 2000  # text either side of a cut encoded to check that the cut changes no token


def batches(docs: list[tuple[str, str, int, str]]) -> list[tuple[int, int]]:
    """[(start, stop)] of ``docs`` in runs of at most ``BATCH_CHARS`` of text (one doc at least)."""
    return _runs([len(d[3]) for d in docs])


def encode_texts(texts: list[str], tok: Any, stop: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of every text, concatenated: int32 [n], each text's count: int64 [texts]).

    A text longer than ``PIECE_CHARS`` is encoded in pieces (``pieces``), at most ``ENCODE_CHARS``
    of them at a time: the ids are the same, the memory is bounded whatever a document's size.
    ``stop``: a ``threading.Event``; once set, ``Stopped`` is raised before the next call."""
    cut = [pieces(t, tok) for t in texts]
    flat = [p for ps in cut for p in ps]
    ids: list[list[int]] = []
    for i, j in _runs([len(p) for p in flat], ENCODE_CHARS):
        if stop is not None and stop.is_set():
            raise Stopped
        ids += _ids(tok, flat[i:j])
    counts = np.fromiter(map(len, ids), np.int64, len(ids))  # [pieces]
    owner = np.repeat(np.arange(len(texts)), [len(ps) for ps in cut])  # [pieces] -> its text
    lengths = np.bincount(owner, weights=counts, minlength=len(texts)).astype(np.int64)
    out = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(counts.sum()))
    return out, lengths


def pieces(text: str, tok: Any) -> list[str]:
    """``text`` cut into pieces of at most ``PIECE_CHARS`` (as far as cuts are found) at line starts
    where the tokens do not change: ``CHECK_CHARS`` either side of each cut are encoded apart and
    across it, and the cut is kept only when both give the same ids (so a tokenizer that would
    join or reshape tokens there, or that adds a prefix to every text, gets no cut). A text
    without such a place stays whole."""
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = _cut(text, start, tok)
        if cut is None:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _cut(text: str, start: int, tok: Any, tries: int = 20) -> int | None:
    """The last line start in ``text[start + PIECE_CHARS // 2 : start + PIECE_CHARS]`` whose cut
    leaves the tokens as they are, trying ``tries`` line starts from the end; None if none does."""
    lo, end = start + PIECE_CHARS // 2, start + PIECE_CHARS
    for _ in range(tries):
        nl = text.rfind("\n", lo, end)
        if nl < 0:
            return None
        c, end = nl + 1, nl
        a, b = text[max(start, c - CHECK_CHARS):c], text[c:c + CHECK_CHARS]
        across, left, right = _ids(tok, [a + b, a, b])
        if across == left + right:
            return c
    return None


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids, without special tokens (``encode_batch_fast``: no offsets computed)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]  # .ids: a new list each


class Stopped(Exception):
    """A batch given up because the work was stopped (Ctrl-C): its ids are not wanted."""


def _runs(sizes: list[int], limit: int = BATCH_CHARS) -> list[tuple[int, int]]:
    """[(start, stop)] of consecutive items of at most ``limit`` in all (one at least)."""
    out, i = [], 0
    while i < len(sizes):
        j, size = i, 0
        while j < len(sizes) and (j == i or size + sizes[j] <= limit):
            size += sizes[j]
            j += 1
        out.append((i, j))
        i = j
    return out


def write_tokens(folder: str, name: str, input_digest: str, docs: list[tuple[str, str, int, str]],
                 parts: list[tuple[np.ndarray, np.ndarray]], eos: int,
                 vocab_size: int) -> dict[str, Any]:
    """Write shard ``name`` from ``docs`` ([(source, id, split 0/1, text)], in order) and their
    ``encode_texts`` results ``parts`` (in order): each document's ids then EOS, in its split.

    Returns the shard's JSON (``shards.write_shard``): digests, token counts, document ids, stats
    {source: {split: {docs, tokens, chars, bytes}}}.
    """
    n = np.concatenate([p[1] for p in parts]) + 1  # [docs] tokens of each doc with its EOS
    split = np.asarray([d[2] for d in docs], dtype=np.uint8)  # [docs]
    # Counted per (split, id) in one pass over the batches, the EOS ending each doc added after.
    counts = np.zeros(2 * vocab_size, dtype=np.int64)  # [2 V]
    per_batch = np.split(split, np.cumsum([len(p[1]) for p in parts])[:-1])  # [k] each
    for (ids, lengths), doc_split in zip(parts, per_batch):
        key = np.repeat(doc_split.astype(np.int64) * vocab_size, lengths) + ids  # [n_b]
        counts += np.bincount(key, minlength=2 * vocab_size)
    counts = counts.reshape(2, vocab_size)  # [2, V]
    counts[:, eos] += np.bincount(split, minlength=2)
    # Each split's stream goes to its file batch by batch: a 16 MB shard of text held as one array,
    # and again split, took ~100 MB at once; a batch's pieces take ~5 MB.
    streams = {SPLITS[s]: (int(n[split == s].sum()), _pieces(parts, split, eos, s)) for s in (0, 1)}
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
    used = np.flatnonzero(counts[0] + counts[1]).astype(np.int32)  # [k] ids the shard uses
    index = {"doc_split": split, "doc_end": doc_end, "ids": used,
             "train": counts[0][used].astype(np.int64), "val": counts[1][used].astype(np.int64)}
    meta = {"input": input_digest, "docs": len(docs), "doc_ids": [d[1] for d in docs],
            "stats": dict(stats)}
    return write_shard(Path(folder), name, streams, index, meta)


def _pieces(parts: list[tuple[np.ndarray, np.ndarray]], split: np.ndarray, eos: int,
            s: int) -> Iterator[np.ndarray]:
    """Split ``s``'s stream, batch by batch: int32 [m] pieces, each document's ids then EOS."""
    start = 0
    for ids, lengths in parts:  # [n_b] ids, [k] tokens of each of the batch's k docs
        k = len(lengths)
        n = lengths + 1  # [k] with EOS
        full = np.empty(len(ids) + k, dtype=np.int32)  # [n_b + k] ids and EOS, in input order
        is_eos = np.zeros(len(full), dtype=bool)
        is_eos[np.cumsum(n) - 1] = True
        full[is_eos] = eos
        full[~is_eos] = ids
        yield full[np.repeat(split[start:start + k] == s, n)]
        start += k
