"""Tokenising one shard: documents in, its token arrays, index and JSON out (``shards`` format).

Runs in ``prepare``'s worker processes (one tokenizer each, its own thread pool off: the processes
are the parallelism) or in the calling process. Imports no torch, so a spawned worker starts in a
fraction of a second. Every document is encoded without special tokens and followed by EOS, the
layout the training stream and the Engram hasher (pad = EOS) expect.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .shards import SPLITS, write_shard

BATCH_CHARS = 1 << 20  # text per encode call: bounds the tokenizer's per-call memory
_TOKENIZER: Any = None  # a worker process's tokenizer (set by init_worker)


def init_worker(tokenizer_json: str) -> None:
    """A worker's start: its tokenizer, single-threaded (several workers share the cores)."""
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(tokenizer_json)


def tokenise_shard(folder: str, name: str, input_digest: str, docs: list[tuple[str, str, int, str]],
                   eos: int, vocab_size: int, tokenizer: Any = None) -> dict[str, Any]:
    """Encode ``docs`` ([(source, id, split 0/1, text)], in order) and write shard ``name``.

    Returns the shard's JSON (``shards.write_shard``): digests, token counts, document ids, stats
    {source: {split: {docs, tokens, chars, bytes}}}.
    """
    tok = tokenizer if tokenizer is not None else _TOKENIZER
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # ids only: no offsets kept
    pieces: dict[int, list[np.ndarray]] = {0: [], 1: []}  # split -> arrays of whole documents
    filled = [0, 0]  # tokens so far per split
    doc_end = np.zeros(len(docs), dtype=np.int64)  # [docs] end of each doc in its split's array
    stats: dict[str, dict[str, dict[str, int]]] = defaultdict(
        lambda: {s: {"docs": 0, "tokens": 0, "chars": 0, "bytes": 0} for s in SPLITS})
    i = 0
    while i < len(docs):
        j, size = i, 0
        while j < len(docs) and (j == i or size + len(docs[j][3]) <= BATCH_CHARS):
            size += len(docs[j][3])
            j += 1
        encs = encode([d[3] for d in docs[i:j]], add_special_tokens=False)
        flat: dict[int, list[int]] = {0: [], 1: []}  # this call's ids per split (Python ints)
        for k, (d, e) in enumerate(zip(docs[i:j], encs)):
            source, _, split, text = d
            flat[split].extend(e.ids)
            flat[split].append(eos)
            doc_end[i + k] = filled[split] + len(flat[split])
            st = stats[source][SPLITS[split]]
            st["docs"] += 1
            st["tokens"] += len(e.ids) + 1
            st["chars"] += len(text)
            st["bytes"] += len(text.encode("utf-8"))
        for s in (0, 1):
            pieces[s].append(np.asarray(flat[s], dtype=np.int32))
            filled[s] += len(flat[s])
        i = j
    streams = {SPLITS[s]: np.concatenate(pieces[s]) if pieces[s] else np.empty(0, np.int32)
               for s in (0, 1)}  # [n_split]
    counts = [np.bincount(streams[s], minlength=vocab_size) for s in SPLITS]  # [V] each
    used = np.flatnonzero(counts[0] + counts[1]).astype(np.int32)  # [k] ids the shard uses
    index = {"doc_split": np.asarray([d[2] for d in docs], dtype=np.uint8), "doc_end": doc_end,
             "ids": used, "train": counts[0][used].astype(np.int64),
             "val": counts[1][used].astype(np.int64)}
    meta = {"input": input_digest, "docs": len(docs), "doc_ids": [d[1] for d in docs],
            "stats": dict(stats)}
    return write_shard(Path(folder), name, streams, index, meta)
