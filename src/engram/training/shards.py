"""A prepared corpus on disk: token shards, their index and a manifest (``engram prepare`` writes
it; training reads windows from it, ``streams``).

    DIR/manifest.json            written last; names every shard with its digests, so a manifest
                                 never names a missing or partial shard
    DIR/tokenizer.json           the tokenizer the shards were made with
    DIR/compression.npy          [V] int64 its compression map (spec 1.1), built once, stored here
    DIR/counts.npy               [2, V] int64 occurrences of each raw id in train, val
    DIR/shards/NNNNN.train.npy   [n] int32 raw ids of the shard's training documents, each + EOS
    DIR/shards/NNNNN.val.npy     [m] int32 the same for its held-out documents
    DIR/shards/NNNNN.index.npz   doc_split [docs] uint8 (0 train, 1 val), doc_end [docs] int64 (end of
                                 each document in its split's array), ids [k] with their counts
                                 train [k], val [k] (the shard's share of counts.npy)
    DIR/shards/NNNNN.json        written last of the shard: what went in (input digest), the
                                 files' digests, document ids, per-source stats

Every file is published atomically (``engram.files``), so a killed ``prepare`` leaves whole shards
and no manifest; its rerun keeps every shard whose input digest and files still match.

Shape legend: V the tokenizer's vocabulary, n tokens of a split, b windows, t window length.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..errors import InputNotFound, UserError
from ..files import publish_bytes, publish_text, sha256_file
from .streams import NpyFile, TokenStream

FORMAT = "engram-shards-1"  # bump when the layout changes: older folders are refused, not misread
SPLITS = ("train", "val")
MANIFEST = "manifest.json"


class DataError(UserError):
    """A prepared corpus that must not be trained on: unfinished, corrupt, or from other inputs."""


def _save_stream(path: Path, length: int, pieces: Iterable[np.ndarray]) -> str:
    """Publish an int32 [length] .npy file (the bytes ``np.save`` writes) from ``pieces`` in order,
    never joined: a shard's stream is not held whole; returns the file's digest."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": np.lib.format.dtype_to_descr(np.dtype("<i4")), "fortran_order": False,
               "shape": (length,)})
    h = hashlib.sha256(head.getvalue())

    def write(f: Any) -> None:
        f.write(head.getvalue())
        n = 0
        for piece in pieces:
            data = np.ascontiguousarray(piece, dtype="<i4").data
            f.write(data)
            h.update(data)
            n += len(piece)
        if n != length:
            raise ValueError(f"{path.name}: {n} tokens written, {length} announced")

    publish_bytes(path, write)
    return h.hexdigest()


def in_val(doc_id: str, seed: int, fraction: float) -> bool:
    """Whether a document is held out: a stable hash of its id, so the split never moves."""
    # blake2b, not hash(): Python salts str hashes per process, and the split must never move.
    h = hashlib.blake2b(f"{seed}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < fraction


# -- one shard -------------------------------------------------------------------------------------

def shard_files(folder: Path, name: str) -> dict[str, Path]:
    return {k: folder / f"{name}.{k}.{'npz' if k == 'index' else 'npy'}"
            for k in ("train", "val", "index")}


def write_shard(folder: Path, name: str,
                streams: dict[str, tuple[int, Iterable[np.ndarray]]],
                index: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, Any]:
    """Publish one shard's files, then its JSON (the mark that the shard is whole); returns the
    JSON's content (``meta`` plus the files' digests) less the document ids. ``streams``: {split:
    (its length, its int32 pieces in order)}."""
    files = shard_files(folder, name)
    digests = {s: _save_stream(files[s], *streams[s]) for s in SPLITS}
    publish_bytes(files["index"], lambda f: np.savez(f, **index))
    digests["index"] = sha256_file(files["index"])
    meta = {**meta, "name": name, "sha256": digests,
            "tokens": {s: int(streams[s][0]) for s in SPLITS}}
    publish_text(folder / f"{name}.json", json.dumps(meta))
    return _without_ids(meta)


def _without_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """A shard's JSON as ``prepare`` keeps it in memory: without its document ids, which can
    outnumber everything else (a corpus of short records), so prepare's memory stays flat."""
    return {k: v for k, v in meta.items() if k != "doc_ids"}


def finished_shard(folder: Path, name: str, input_digest: str) -> dict[str, Any] | None:
    """The JSON of a shard already written from the same input whose files still match their
    digests, or None (absent, from other input, or damaged: it is made again)."""
    try:
        meta = json.loads((folder / f"{name}.json").read_text("utf-8"))
        if meta.get("input") != input_digest:
            return None
        files = shard_files(folder, name)
        if all(sha256_file(files[k]) == meta["sha256"][k] for k in files):
            return _without_ids(meta)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def remove_shards(folder: Path, keep: int) -> None:
    """Delete shard files numbered ``keep`` and above (left by an earlier, longer run) and any
    temporary file a killed run left behind."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        stem = p.name.split(".")[0]
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif stem.isdigit() and int(stem) >= keep:
            p.unlink(missing_ok=True)


# -- the manifest ----------------------------------------------------------------------------------

def input_stat(path: str | Path) -> list:
    """[path, size, mtime_ns]: how a changed input is told at train time."""
    st = os.stat(path)
    return [str(path), st.st_size, st.st_mtime_ns]


def changed_inputs(inputs: Iterable[list]) -> list[str]:
    """Recorded inputs that still exist but differ from when they were read (a removed input is
    not a change: the prepared shards stand on their own)."""
    out = []
    for path, size, mtime in inputs:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            out.append(f"{path} (size {size} -> {st.st_size})" if st.st_size != size else str(path))
    return out


def fingerprint(manifest: dict[str, Any]) -> str:
    """The data's identity: tokenizer, compression, split and every shard's digests (not where the
    folder is, nor the inputs' paths: the same tokens elsewhere are the same data)."""
    parts = {"format": manifest["format"], "tokenizer": manifest["tokenizer"]["fingerprint"],
             "compression": manifest["compression"]["sha256"], "split": manifest["split"],
             "shards": [s["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def write_manifest(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {**manifest, "format": FORMAT}
    manifest["fingerprint"] = fingerprint(manifest)
    publish_text(out / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(out: Path) -> dict[str, Any]:
    """The manifest of a prepared folder, or a ``DataError`` saying why there is none."""
    out = Path(out)
    if not out.is_dir():
        raise InputNotFound(f"--data {out}: no such folder (make one with `engram prepare "
                            f"--input PATH --out {out}`)")
    path = out / MANIFEST
    if not path.is_file():
        if (out / "shards").is_dir():
            raise DataError(f"{out} has shards but no manifest: its `engram prepare` did not "
                            "finish; rerun the same command (finished shards are kept)")
        raise DataError(f"{out} is not a prepared corpus (no {MANIFEST}; make one with "
                        "`engram prepare`)")
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); rerun `engram prepare`") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{out} was written in format {manifest.get('format')!r}, this version "
                        f"reads {FORMAT!r}; rerun `engram prepare`")
    return manifest


def verify(out: Path, manifest: dict[str, Any]) -> None:
    """Refuse (DataError, naming the file) a folder whose files differ from its manifest: a shard
    changed or cut short, another tokenizer or compression map put in, counts edited."""
    top = {"tokenizer.json": manifest["tokenizer"]["sha256"],
           "compression.npy": manifest["compression"]["sha256"],
           "counts.npy": manifest["counts_sha256"]}
    for name, want in top.items():
        _check(out / name, want, f"{name} is not the one its shards were made with")
    for s in manifest["shards"]:
        for kind, path in shard_files(out / "shards", s["name"]).items():
            _check(path, s["sha256"][kind], f"shard {s['name']} ({kind}) is corrupt: its digest "
                   "does not match the manifest")


def _check(path: Path, want: str, why: str) -> None:
    if not path.is_file():
        raise DataError(f"{path} is missing; rerun `engram prepare` (it redoes only what is gone)")
    if sha256_file(path) != want:
        raise DataError(f"{path}: {why}; rerun `engram prepare` (it redoes only that shard)")


# -- reading -----------------------------------------------------------------------------------

def open_streams(out: Path, manifest: dict[str, Any]) -> dict[str, TokenStream]:
    """Each split's stream over its shard files (``streams.TokenStream``)."""
    parts: dict[str, list[NpyFile]] = {s: [] for s in SPLITS}
    for s in manifest["shards"]:
        for split in SPLITS:
            path = shard_files(out / "shards", s["name"])[split]
            try:
                f = NpyFile(path)
            except (OSError, ValueError) as e:
                raise DataError(f"{path} is not a token array ({e}); rerun `engram prepare`") from None
            if f.dtype != np.int32 or len(f) != s["tokens"][split]:
                raise DataError(f"{path} holds {f.dtype} ({len(f)},), the manifest says int32 "
                                f"({s['tokens'][split]},)")
            parts[split].append(f)
    return {s: TokenStream(p) for s, p in parts.items()}


def doc_ids(out: Path, manifest: dict[str, Any]) -> dict[str, list[str]]:
    """{split: document ids in stream order}, from the shards' JSON files."""
    ids: dict[str, list[str]] = {s: [] for s in SPLITS}
    for s in manifest["shards"]:
        meta = json.loads((out / "shards" / f"{s['name']}.json").read_text("utf-8"))
        with np.load(shard_files(out / "shards", s["name"])["index"]) as index:
            splits = index["doc_split"]
        for i, split in zip(meta["doc_ids"], splits):
            ids[SPLITS[int(split)]].append(i)
    return ids


def save_file(path: Path, write) -> str:
    """Publish a side file (``write(binary_file)``) and return its digest."""
    publish_bytes(path, write)
    return sha256_file(path)
