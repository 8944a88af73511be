"""An Engram adapter folder: the trained memory of an injected transformers model, as files.

    DIR/engram.safetensors     every Engram tensor, under ``layers.<id>.<name>``, with a JSON
                               header entry ("engram"): the Engram config, the injection options,
                               the base model's and the tokenizer's fingerprints
                               (models/adapter.py),
                               and a digest of the tensors (adapters written before it: none)
    DIR/engram_config.json     the same JSON, for people to read (opening checks it agrees)
    DIR/tokenizer.json         the tokenizer the tables are indexed by (self-contained adapters)
    DIR/compression.npy        its compression map
    DIR/finetune.json          `engram finetune`'s summary: its data folder, held-out loss
                               before and after (the held-out split a lossy format is scored on)
    DIR/checkpoints/           `engram finetune`'s resume state (not read by opening)
    DIR/tables/                table files of its tables (`engram export-tables DIR`), for the
                               file tiers; stamped with ``AdapterFiles.tag``

``write`` (public as ``save_engram``) writes it; ``read`` reads and checks it; ``load_engram``
puts an adapter into a model and ``from_pretrained`` (public as ``engram.load_adapter``) loads the
base model an adapter names with its Engram. The model surgery (injecting, fingerprints, copying
the tensors in) is models/adapter.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from ..errors import InputNotFound, UserError, one_line
from ..files import publish, publish_bytes, publish_text, read_json_object
from ..models.adapter import (AdapterMismatch, attach, base_fingerprint, compression_fingerprint,
                              engram_state_dict)
from ..retrieval.compress import Compression, tokenizer_fingerprint
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher

FORMAT = "engram-hf-adapter-1"
WEIGHTS = "engram.safetensors"
META = "engram_config.json"
TOKENIZER = "tokenizer.json"
COMPRESSION = "compression.npy"
SUMMARY = "finetune.json"
TABLES = "tables"  # the default folder of its table files, as a run's
_DIGEST = "tensors_sha256"  # in the header's JSON: what the tensors hash to (see tensor_digest)
TABLE_KEY = ".table.weight"  # a layer's table: layers.<id>.table.weight
_CHUNK_BYTES = 8 << 20  # bytes of a table hashed at a time when it stays in the file
_AGAIN = "copy the adapter back, or finetune it again (`engram finetune ... --out_dir DIR`)"


def detect(path: str | Path) -> bool:
    """Whether ``path`` is an adapter folder: it holds engram.safetensors or engram_config.json
    (either one, so that ``read`` names the other when it is gone)."""
    p = Path(path)
    return p.is_dir() and ((p / WEIGHTS).is_file() or (p / META).is_file())


@dataclass
class AdapterFiles:
    """What an adapter folder holds, read and checked."""

    folder: Path
    meta: dict[str, Any]  # the header's JSON: format, config, options, base, tokenizer, ...
    tensors: dict[str, torch.Tensor]  # layers.<id>.<name>
    tokenizer: Any  # tokenizers.Tokenizer; None: an adapter saved without its tokenizer
    compression: Compression | None  # None with the tokenizer
    digest: str  # what every tensor hashes to (tensor_digest), tables included whether read or not

    @property
    def base_model(self) -> str | None:
        return self.meta.get("base_model")

    @property
    def eos_id(self) -> int | None:
        return self.meta.get("eos_id")

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / TOKENIZER

    @property
    def tag(self) -> str:
        """What its table files are stamped with (a run's are with their checkpoint's name): the
        digest of its tensors, so files of another adapter, or of this one finetuned further,
        are refused as stale."""
        return "adapter-" + self.digest[:16]

    def hasher(self) -> NgramHasher:
        """The hasher its tables are indexed by (its config over its tokenizer's compression),
        without its base model: what the injected model's runtime builds (models/hf.py)."""
        return NgramHasher(EngramConfig.from_dict(self.meta["config"]), self.compression)


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the tensors' names, shapes, dtypes and bytes, in name order: safetensors has no
    checksum, and a flipped byte in a table would load without a word."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k]
        _digest_part(h, k, tuple(t.shape), t.dtype, [t])
    return h.hexdigest()


def _digest_part(h: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 chunks: Any) -> None:
    """One tensor into ``tensor_digest``'s hash from ``chunks`` of its bytes in order (tensors, or
    bytes read from the file: a table streamed hashes as it would whole)."""
    h.update(f"{name}:{shape}:{dtype}:".encode())
    for t in chunks:
        h.update(t if isinstance(t, bytes) else
                 t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _file_bytes(path: Path, name: str) -> Iterator[bytes]:
    """The bytes of tensor ``name`` of a safetensors file, read a chunk at a time with plain reads
    (not mapped: the pages do not stay in the process)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start, end = json.loads(f.read(n))[name]["data_offsets"]
        f.seek(8 + n + start)
        for a in range(start, end, _CHUNK_BYTES):
            yield f.read(min(_CHUNK_BYTES, end - a))


def write(model: nn.Module, directory: str | os.PathLike, *, base_model: str | None = None,
          tokenizer: Any = None, eos_id: int | None = None,
          base: dict[str, Any] | None = None) -> Path:
    """Write the adapter of ``model`` (an injected transformers model) into ``directory``
    (created if needed); returns the weights path.

    ``base_model`` (a packaged name or folder), ``tokenizer`` (a tokenizers.Tokenizer, the one
    the compression was built from) and ``eos_id`` make it self-contained (``from_pretrained``);
    ``base``: the base fingerprint when the caller has it already (it reads every weight)."""
    from safetensors.torch import save_file

    from ..models.hf import engram_runtime

    rt = engram_runtime(model)
    tensors = engram_state_dict(model)
    meta = {"format": FORMAT, "config": rt.config.to_dict(),
            "options": {"gate": rt.options.gate, "conv": rt.options.conv},
            "base": base if base is not None else base_fingerprint(model),
            "tokenizer": compression_fingerprint(rt.compression),
            "compressed_vocab": len(rt.compression), _DIGEST: tensor_digest(tensors)}
    if base_model is not None:
        meta["base_model"] = base_model
    if eos_id is not None:
        meta["eos_id"] = int(eos_id)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        if tokenizer_fingerprint(tokenizer) != meta["tokenizer"]:
            raise ValueError("the tokenizer given is not the one the injected compression was "
                             "built from")
        publish_text(out / TOKENIZER, tokenizer.to_str())
        publish_bytes(out / COMPRESSION, lambda f: np.save(f, rt.compression.lookup))
    text = json.dumps(meta, sort_keys=True)
    publish(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"engram": text}))
    publish_text(out / META, json.dumps(meta, indent=2, sort_keys=True))
    return out / WEIGHTS


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The header JSON of DIR/engram.safetensors (its format checked)."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise InputNotFound(f"{directory}: no Engram adapter ({WEIGHTS} is missing): {_AGAIN}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("engram", "{}"))
    except Exception as e:  # safetensors' own error types for a torn header; bad JSON
        raise UserError(f"{directory}: {WEIGHTS} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): {_AGAIN}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise AdapterMismatch(f"{path} is not an Engram adapter of format {FORMAT} "
                              f"(found {found!r})")
    return meta


def read_tensors(directory: str | os.PathLike, meta: dict[str, Any], tables: bool = True
                 ) -> tuple[dict[str, torch.Tensor], str]:
    """(the adapter's tensors, their digest), checked against the digest its header records (when
    it has one). ``tables=False`` leaves the tables out (their rows on a tier instead): they are
    hashed from the file a chunk at a time, never held whole."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    h, tensors = hashlib.sha256(), {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in sorted(f.keys()):
                if tables or not k.endswith(TABLE_KEY):
                    tensors[k] = t = f.get_tensor(k)
                    _digest_part(h, k, tuple(t.shape), t.dtype, [t])
                    continue
                part = f.get_slice(k)  # its shape and dtype; the bytes are read plainly
                _digest_part(h, k, tuple(part.get_shape()), part[0:1].dtype, _file_bytes(path, k))
    except Exception as e:  # a file cut short after its header
        raise UserError(f"{directory}: {WEIGHTS} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): {_AGAIN}") from e
    digest = h.hexdigest()
    if _DIGEST in meta and digest != meta[_DIGEST]:
        raise UserError(f"{directory}: {WEIGHTS} is damaged (its tensors are not the ones its "
                        f"header records): {_AGAIN}")
    return tensors, digest


def read_tokenizer(directory: str | os.PathLike, meta: dict[str, Any] | None = None
                   ) -> tuple[Any, Compression]:
    """(tokenizers.Tokenizer, its compression map) a self-contained adapter holds, checked against
    the header (``meta``, read when not given): the tokenizer's fingerprint, and a map of the
    tokenizer's size onto the adapter's compressed vocabulary."""
    from tokenizers import Tokenizer

    d = Path(directory)
    meta = read_meta(d) if meta is None else meta
    if not (d / TOKENIZER).is_file() and not (d / COMPRESSION).is_file():
        raise InputNotFound(f"{d} holds no {TOKENIZER} and {COMPRESSION}: an adapter written by "
                            "save_engram without its tokenizer (load it with load_engram)")
    for name in (TOKENIZER, COMPRESSION):
        if not (d / name).is_file():
            raise InputNotFound(f"{d}: {name} is missing: {_AGAIN}")
    try:
        tok = Tokenizer.from_file(str(d / TOKENIZER))
    except Exception as e:  # tokenizers raises a bare Exception for a torn file
        raise UserError(f"{d}: {TOKENIZER} cannot be read ({one_line(e)}): {_AGAIN}") from None
    fingerprint = tokenizer_fingerprint(tok)
    if fingerprint != meta.get("tokenizer", fingerprint):
        raise UserError(f"{d}: {TOKENIZER} is not the tokenizer the adapter was trained with "
                        f"(fingerprint {fingerprint}, {WEIGHTS} records {meta['tokenizer']}): "
                        f"{_AGAIN}")
    try:
        lookup = np.load(d / COMPRESSION, allow_pickle=False)
        size = tok.get_vocab_size(with_added_tokens=True)
        vocab = int(meta.get("compressed_vocab", 0)) or None
        if lookup.ndim != 1 or len(lookup) < size or lookup.dtype.kind not in "iu":
            raise ValueError(f"shape {lookup.shape} {lookup.dtype}, the tokenizer has {size} ids")
        if len(lookup) and (lookup.min() < 0 or (vocab and lookup.max() >= vocab)):
            raise ValueError(f"ids outside [0, {vocab})")
        compression = Compression(lookup, fingerprint=fingerprint)
    except Exception as e:  # numpy's own errors for a torn file, ours above
        raise UserError(f"{d}: {COMPRESSION} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): {_AGAIN}") from e
    return tok, compression


def read_summary(directory: str | os.PathLike) -> dict[str, Any]:
    """``engram finetune``'s finetune.json (its data folder, held-out losses, config), or one
    UserError line: an adapter written by save_engram has none."""
    path = Path(directory) / SUMMARY
    try:
        return read_json_object(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{directory}: {SUMMARY} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): it names the data the adapter was finetuned on") from e


def _check_copy(d: Path, meta: dict[str, Any]) -> None:
    """engram_config.json, the readable copy of the header, agrees with it (or is gone)."""
    path = d / META
    if not path.exists():
        return
    try:
        copy = read_json_object(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{d}: {META} cannot be read ({type(e).__name__}: {one_line(e)}): it "
                        f"is a copy of {WEIGHTS}'s header, for people; copy it back or delete "
                        "it") from e
    differ = sorted(k for k in set(copy) | set(meta) if copy.get(k) != meta.get(k))
    if differ:
        raise UserError(f"{d}: {META} disagrees with {WEIGHTS}'s header on "
                        f"{', '.join(differ[:3])}: undo the edit, or delete {META} (the header is "
                        "what was trained)")


def read(directory: str | os.PathLike, tokenizer: bool = True, tables: bool = True
         ) -> AdapterFiles:
    """Every part of an adapter folder, checked: one UserError naming the folder and the part for
    a missing, torn or edited one. ``tokenizer=False``: an adapter saved without its tokenizer.
    ``tables=False``: its tables are checked but not kept (served from its table files)."""
    d = Path(directory)
    meta = read_meta(d)
    _check_copy(d, meta)
    tensors, digest = read_tensors(d, meta, tables)
    tok, compression = read_tokenizer(d, meta) if tokenizer else (None, None)
    return AdapterFiles(d, meta, tensors, tok, compression, digest)


def load_engram(model: nn.Module, directory: str | os.PathLike, tokenizer: Any = None, *,
                compression: Compression | None = None, check_base: bool = True) -> nn.Module:
    """Load an adapter onto ``model``: injects it first when the model has no Engram yet.

    A model without Engram needs its ``tokenizer`` (or ``compression``). Every check runs before
    the model is touched, so a refused adapter leaves the model as it was.
    """
    files = read(directory, tokenizer=False)
    return attach(model, files.meta, files.tensors, tokenizer, compression=compression,
                  check_base=check_base)


def load_base(files: AdapterFiles, base: str | None = None, device: str | None = None,
              tables: dict[int, Any] | None = None) -> nn.Module:
    """The base model an adapter names (or ``base``), with the adapter's Engram in it; ``tables``:
    {layer: store} of its rows on a tier (``files`` read with ``tables=False``)."""
    from ..models.pretrained import load_pretrained

    name = base if base is not None else files.base_model
    if name is None:
        raise UserError(f"{files.folder} names no base model: pass base=")
    model, _ = load_pretrained(name, tokenizer=False)
    if device is not None:
        model.to(device)
    return attach(model, files.meta, files.tensors, compression=files.compression, tables=tables)


def from_pretrained(directory: str | os.PathLike, base: str | None = None,
                    device: str | None = None) -> tuple[nn.Module, Any]:
    """Open an ``engram finetune`` adapter folder (public as ``engram.load_adapter``): returns
    (the base transformers model with the adapter's Engram injected and loaded, its tokenizer as
    a transformers ``PreTrainedTokenizerFast``). The model is the base model's own class, with its
    usual ``generate``; greedy tokens equal ``engram generate``'s on the folder.

    ``base``: the base model's folder or packaged name (default: the one the adapter names); it
    must be the model the adapter was trained on (else ``AdapterMismatch``, one line).
    ``device``: where to move the model (default: where it loads, the CPU)."""
    from transformers import PreTrainedTokenizerFast

    files = read(directory)
    model = load_base(files, base, device)
    tok, eos = files.tokenizer, files.eos_id
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, **({"eos_token": tok.id_to_token(eos)} if eos is not None else {}))
    return model, hf_tok


save_engram = write  # the public name (engram.models.adapter's before the files moved here)

