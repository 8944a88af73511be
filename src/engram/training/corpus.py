"""The training corpus: a prepared folder of token shards (``engram prepare``), opened for reading.

Two ways to name one, one path behind both:

- ``DataConfig(data=DIR)``: a folder written by ``engram prepare`` from the user's own text.
- ``DataConfig(sources=...)``: the built-in sources (``sources.py``: KJV and People's Daily by
  default); ``build_corpus`` prepares them once, with ``prepare.write_corpus``, into a cache folder
  keyed by the sources, the tokenizer and the split, and opens that.

Opening checks the folder against its manifest (``shards.verify``: every file's digest, so a
corrupt shard or another tokenizer's files are refused, naming the file) and its recorded inputs
(a changed input is refused). The split was made at prepare time, by a stable hash of each document
id, so no validation text is ever trained on. Cutting the streams into batches lives in ``batches``.

Shape legend:
    n tokens in a stream, V the tokenizer's vocabulary, V_loc the model's vocabulary: the raw ids
    the corpus uses (``vocab="corpus"``, a restricted output layer) or all V (``vocab="full"``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..models.vocab import VocabMap
from ..retrieval.compress import EOS_TOKEN, Compression, default_tokenizer, tokenizer_fingerprint
from ..retrieval.compress import cache_dir as _compression_cache_dir
from . import shards
from .shards import SPLITS, DataError
from .shards import in_val as _in_val  # noqa: F401  (finetune's split; its old home)
from .sources import (  # noqa: F401  (their old home)
    SOURCES,
    Document,
    _rst_tree,
    load_documents,
    source_files,
)
from .streams import TokenStream

# Bump when documents, cleaning or the stream layout change, so stale caches are never reused.
DATA_VERSION = "engram-data-2"
VOCABS = ("corpus", "full")


@dataclass
class DataConfig:
    # Text sources by name (see SOURCES): "kjv", "peoples-daily", optional "linux-doc", "python-doc".
    sources: tuple[str, ...] = ("kjv", "peoples-daily")
    # Share of each source's documents held out for validation, chosen by a stable hash of the id.
    val_fraction: float = 0.05
    # Seed of that hash: another seed gives another split, equally stable across processes.
    split_seed: int = 0
    # Where prepared sources are cached; None means $ENGRAM_CACHE/data (else ~/.cache/engram/data).
    cache_dir: str | None = None
    # Keep only the first max_chars characters of each source (None: all), for fast tests and runs.
    max_chars: int | None = None
    # A folder written by `engram prepare` (replaces sources; its split was made there).
    data: str | None = None
    # The model's output ids: "corpus" (those the corpus uses) or "full" (the whole tokenizer).
    vocab: str = field(default="corpus", metadata={"choices": VOCABS})

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):  # a bare string would iterate its characters
            raise UserError(f"sources must be a tuple of names, got the string {self.sources!r}")
        self.sources = tuple(self.sources)
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise UserError(f"sources must be non-empty and unique, got {self.sources}")
        for s in self.sources:
            if s not in SOURCES:
                raise UserError(f"unknown source {s!r}; known: {sorted(SOURCES)}")
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise UserError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not isinstance(self.split_seed, int) or self.split_seed < 0:
            raise UserError(f"split_seed must be a non-negative int, got {self.split_seed!r}")
        if self.max_chars is not None and (not isinstance(self.max_chars, int) or self.max_chars < 1):
            raise UserError(f"max_chars must be a positive int or None, got {self.max_chars!r}")
        if self.data is not None and self.max_chars is not None:
            raise UserError("max_chars cuts the built-in sources; a prepared corpus (--data) is "
                            "used whole")
        if self.vocab not in VOCABS:
            raise UserError(f"vocab must be one of {VOCABS}, got {self.vocab!r}")

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else _compression_cache_dir().parent / "data"


class Corpus:
    """A prepared folder opened for training: each split's tokens (``streams``, read from the shard
    files window by window), the model's vocabulary, and what came with the data (tokenizer,
    compression map, id counts)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], vocab: str = "corpus"):
        self.folder, self.manifest = Path(folder), manifest
        self.streams: dict[str, TokenStream] = shards.open_streams(self.folder, manifest)
        self.counts = np.load(self.folder / "counts.npy")  # [2, V] train, val occurrences
        self.eos_id = int(manifest["tokenizer"]["eos_id"])
        self.fingerprint: str = manifest["fingerprint"]  # the data's identity (shards.fingerprint)
        for split in SPLITS:
            if not len(self.streams[split]):
                n = manifest["summary"]["documents"]
                raise UserError(f"the split of {self.folder} leaves {split} empty ({n} documents, "
                                f"val_fraction={manifest['split']['val_fraction']}): training "
                                "needs both; prepare more documents or change val_fraction")
        if vocab == "full":  # every id of the tokenizer, so any text can be scored
            self.vocab = np.arange(self.counts.shape[1], dtype=np.int32)
        else:  # the ids the corpus uses: a restricted output layer
            used = self.counts.sum(0) > 0
            used[self.eos_id] = True
            self.vocab = np.flatnonzero(used).astype(np.int32)  # [V_loc] sorted raw ids
        self.ids = VocabMap(self.vocab, int(self.vocab.max()) + 1)  # raw id <-> local id
        self._doc_ids: dict[str, list[str]] | None = None
        self._tokenizer: Any = None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def train(self) -> np.ndarray:
        """The whole training stream [n] (memory-mapped when it is one shard, else joined in memory:
        for whole-corpus analyses; training reads windows from ``streams``)."""
        return self.streams["train"].array()

    @property
    def val(self) -> np.ndarray:
        """The whole validation stream [n], as ``train``."""
        return self.streams["val"].array()

    @property
    def doc_ids(self) -> dict[str, list[str]]:
        """{"train": ids, "val": ids} in stream order."""
        if self._doc_ids is None:
            self._doc_ids = shards.doc_ids(self.folder, self.manifest)
        return self._doc_ids

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]

    def tokenizer(self) -> Any:
        """The tokenizers.Tokenizer the shards were made with (stored in the folder)."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        return self._tokenizer

    def compression(self) -> Compression:
        """The tokenizer's compression map, built at prepare time and stored with the data."""
        return Compression(np.load(self.folder / "compression.npy"),
                           fingerprint=self.tokenizer_fingerprint)

    def frequencies(self) -> np.ndarray:
        """[V_loc] int64: how often each model id occurs in the training text."""
        return self.counts[0][self.vocab]

    @property
    def sources(self) -> list[str]:
        """What the text came from, in input order: the built-in sources' names, or the --input
        arguments (``engram prepare`` counts by these)."""
        return [s for s in self.manifest["stats"] if s != "total"]

    def stats(self) -> dict[str, Any]:
        """{source or "total": {split: {"docs", "tokens" (eos included), "chars", "bytes"}}}."""
        return json.loads(json.dumps(self.manifest["stats"]))

    def to_local(self, raw: Any) -> Any:
        """Raw ids -> local ids (index in ``vocab``); int64, an array or tensor as given."""
        a, device = _as_numpy(raw)
        loc = self.ids.to_local(a)
        if (loc < 0).any():
            bad = int(a.flat[int(np.argmax(loc.ravel() < 0))])
            raise ValueError(f"raw id {bad} is not in the corpus vocabulary ({self.vocab_size} ids)")
        return _like(loc, device)

    def to_raw(self, local: Any) -> Any:
        a, device = _as_numpy(local)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise ValueError(f"local ids must be in [0, {self.vocab_size}), got {a.min()}..{a.max()}")
        return _like(self.vocab[a], device)


def _as_numpy(x: Any) -> tuple[np.ndarray, torch.device | None]:
    """int64 ids as numpy, and the device to return a tensor to (None: return numpy)."""
    device = x.device if isinstance(x, torch.Tensor) else None
    a = x.detach().cpu().numpy() if device is not None else np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False), device


def _like(a: np.ndarray, device: torch.device | None) -> Any:
    a = a.astype(np.int64, copy=False)
    return a if device is None else torch.from_numpy(a).to(device)


# -- opening ---------------------------------------------------------------------------------------

def open_corpus(folder: str | Path, vocab: str = "corpus") -> Corpus:
    """A prepared folder, checked (DataError naming why it is refused) and opened."""
    folder = Path(folder)
    manifest = shards.read_manifest(folder)
    shards.verify(folder, manifest)
    changed = shards.changed_inputs(manifest["inputs"])
    if changed:
        raise DataError(f"{folder} was prepared from inputs that have changed since: "
                        f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}; rerun "
                        "`engram prepare` (it redoes only the shards whose text changed)")
    return Corpus(folder, manifest, vocab)


def build_corpus(cfg: DataConfig | None = None, tokenizer: Any = None) -> Corpus:
    """The corpus of ``cfg``: its prepared folder (``data``), or its built-in sources prepared once
    into the cache and opened from there. ``tokenizer`` (default DeepSeek's) tokenises the sources;
    with ``data`` it must be the folder's own."""
    cfg = DataConfig() if cfg is None else cfg
    cfg.__post_init__()  # the fields may have been changed since construction
    if tokenizer is not None:
        tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers wraps one
    if cfg.data is not None:
        corpus = open_corpus(cfg.data, cfg.vocab)
        if tokenizer is not None and tokenizer_fingerprint(tokenizer) != corpus.tokenizer_fingerprint:
            raise DataError(f"{cfg.data} was tokenised with another tokenizer than the one given")
        return corpus
    tok = default_tokenizer() if tokenizer is None else tokenizer
    if tok.token_to_id(EOS_TOKEN) is None:
        raise UserError(f"the tokenizer has no {EOS_TOKEN!r} token to separate documents")
    key = json.dumps({"version": DATA_VERSION, "sources": list(cfg.sources), "max_chars": cfg.max_chars,
                      "split_seed": cfg.split_seed, "val_fraction": float(cfg.val_fraction),
                      "tokenizer": tokenizer_fingerprint(tok)}, sort_keys=True)
    name = f"{'+'.join(cfg.sources)}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    folder = cfg.resolved_cache_dir() / name
    if (folder / shards.MANIFEST).exists():
        try:
            corpus = open_corpus(folder, cfg.vocab)
            if corpus.manifest.get("key") == key:
                return corpus
        except DataError as e:
            warnings.warn(f"data cache {folder} cannot be used ({e}); rebuilding it")
    _prepare_sources(cfg, tok, folder, key)
    return open_corpus(folder, cfg.vocab)


def _prepare_sources(cfg: DataConfig, tok: Any, folder: Path, key: str) -> None:
    """The built-in sources through ``prepare.write_corpus``, as ``engram prepare --source``."""
    from .prepare import write_corpus

    inputs = [shards.input_stat(p) for s in cfg.sources for p in source_files(s)]
    docs = ((s, d.id, d.text) for s in cfg.sources for d in load_documents(s, cfg.max_chars))
    try:
        write_corpus(docs, folder, tok, EOS_TOKEN, val_fraction=cfg.val_fraction,
                     split_seed=cfg.split_seed, workers=0, inputs=inputs, key=key)
    except OSError as e:
        raise UserError(f"cannot write the data cache at {folder} ({e}); point ENGRAM_CACHE at a "
                        "writable folder") from e
