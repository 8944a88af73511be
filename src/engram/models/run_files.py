"""What a trained run keeps so that it opens with nothing else present: ``RUN/model/``.

Training writes it once, when the run starts (rank 0); the runtime (serving/runtime.py) reads it.
It sits below both, so neither imports the other to open a folder. Before it existed, opening a
run rebuilt the training corpus to get the tokenizer, the vocabulary map and the compression map,
so a run could not be used without its data at the same relative path.

    RUN/model/model.json        ModelConfig, EOS id, Engram-Nine sharing, the data's identity
    RUN/model/tokenizer.json    the tokenizer the data was made with (hashing and decoding use it)
    RUN/model/maps.safetensors  vocab [V] (model id -> raw id), compression [W] (raw -> P(raw)),
                                row counts of each table part on the training text (hot cache)

The hot index of an Engram-Nine run travels in its checkpoints (it is part of what was trained).

Shape legend: V model vocabulary, W tokenizer vocabulary, r rows of a table part.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..files import publish, publish_text
from ..retrieval.compress import Compression
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher, NgramHasher
from .model_config import ModelConfig

FOLDER = "model"
FORMAT = "engram-run-1"


@dataclass
class RunFiles:
    config: ModelConfig
    vocab: np.ndarray  # [V] int64, sorted: model id -> raw id
    compression: Compression  # over the whole tokenizer (identity for a run without compression)
    tokenizer_file: Path
    eos_id: int  # the token that ends every training document
    nine_shared: bool | None  # Engram-Nine: one table set for every layer; None: not a Nine run
    data: dict[str, Any]  # the training data's identity (fingerprint, tokenizer), for resume
    row_counts: dict[int, dict[str, torch.Tensor]] | None  # {owner layer: {part: [r]}}

    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_file))

    def hasher(self, state: dict[str, Any] | None = None) -> Hasher | None:
        """The hasher training used; ``state``: a checkpoint's, whose hot index a Nine run reads."""
        if self.config.engram is None:
            return None
        from ..retrieval.hot import checkpoint_hasher

        plain = NgramHasher(self.config.engram, self.compression)
        return checkpoint_hasher(plain, state or {}, bool(self.nine_shared))


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    d["engram"] = None if d.get("engram") is None else EngramConfig.from_dict(d["engram"])
    return ModelConfig.from_dict(d)


def identity(config: ModelConfig, compression: Compression, nine_shared: bool | None,
             data: dict[str, Any]) -> dict[str, Any]:
    """What decides the files' content (the vocabulary and row counts follow from the data)."""
    digest = hashlib.sha256(np.ascontiguousarray(compression.lookup, dtype=np.int64)).hexdigest()
    return json.loads(json.dumps({"model": config.to_dict(), "compression": digest,
                                  "nine_shared": nine_shared, "data": data}))


def read_identity(run_dir: str | Path) -> dict[str, Any] | None:
    """``identity`` of the files ``run_dir`` holds (None: none, or unreadable)."""
    folder = Path(run_dir) / FOLDER
    try:
        meta = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return None
    if not (folder / "maps.safetensors").is_file() or not (folder / "tokenizer.json").is_file():
        return None
    return {k: meta.get(k) for k in ("model", "compression", "nine_shared", "data")}


def write_run_files(run_dir: str | Path, *, config: ModelConfig, vocab: Any,
                    compression: Compression, tokenizer_file: str | Path, eos_id: int,
                    nine_shared: bool | None, data: dict[str, Any],
                    row_counts: dict[int, dict[str, torch.Tensor]] | None) -> Path:
    """Write ``RUN/model/`` (each file published whole; model.json last, as the folder's mark)."""
    from safetensors.torch import save_file

    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"vocab": torch.as_tensor(np.asarray(vocab), dtype=torch.long).contiguous(),
               "compression": torch.from_numpy(compression.lookup.astype(np.int64)).contiguous()}
    for lid, parts in (row_counts or {}).items():
        for part, c in parts.items():
            tensors[f"rows.{lid}.{part}"] = c.to(torch.int64).contiguous()
    publish(folder / "maps.safetensors", lambda p: save_file(tensors, p))
    publish(folder / "tokenizer.json", lambda p: shutil.copyfile(tokenizer_file, p))
    publish_text(folder / "model.json", json.dumps({
        "format": FORMAT, **identity(config, compression, nine_shared, data),
        "eos_id": int(eos_id), "compression_fingerprint": compression.fingerprint}, indent=1))
    return folder


def read_run_files(run_dir: str | Path) -> RunFiles:
    """``RUN/model/``, or a UserError saying how to get it."""
    from safetensors.torch import load_file

    folder = Path(run_dir) / FOLDER
    meta_path = folder / "model.json"
    if not meta_path.is_file():
        raise UserError(f"{run_dir} has no {FOLDER}/model.json: it was trained before runs kept "
                        "their model files; resume it once with the same `engram train` options "
                        "(it writes them) or train it again")
    try:
        meta = json.loads(meta_path.read_text())
        maps = load_file(str(folder / "maps.safetensors"))
    except (OSError, ValueError) as e:
        raise UserError(f"{folder} cannot be read ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise UserError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    counts: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in maps.items():
        if key.startswith("rows."):
            _, lid, part = key.split(".", 2)
            counts.setdefault(int(lid), {})[part] = t
    return RunFiles(model_config_from_dict(meta["model"]), maps["vocab"].numpy(),
                    Compression(maps["compression"].numpy(),
                                fingerprint=meta.get("compression_fingerprint")),
                    folder / "tokenizer.json", int(meta["eos_id"]), meta.get("nine_shared"),
                    meta.get("data") or {}, counts or None)


def load_dense_state(model: Any, state: dict[str, torch.Tensor],
                     outside: Any = ()) -> None:
    """Load a full state dict into a model whose tables may live in outside stores: their rows
    come from the stores, so the checkpoint's table entries are skipped for those layers
    (``outside``: layers whose tables came from a tier, which keep their rows even when the store
    is a module with parameters of its own, e.g. the memory or sharded tier)."""
    own = model.state_dict()
    kept = tuple(f"blocks.{lid}.engram.table." for lid in outside)
    keep = {k: v for k, v in own.items() if k.startswith(kept)}
    skip = {k for k in state if ".engram.table." in k and (k not in own or k in keep)}
    missing = set(own) - set(state) - set(keep)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict({**{k: v for k, v in state.items() if k not in skip}, **keep},
                          strict=True)
