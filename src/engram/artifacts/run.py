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

from ..errors import UserError, one_line
from ..files import publish, publish_text, read_json_object
from ..models.model_config import ModelConfig
from ..retrieval.compress import Compression
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher, NgramHasher

FOLDER = "model"
FORMAT = "engram-run-1"
CONFIG = "config.json"  # the run's options (TrainConfig), for people and `--config`
TABLES = "tables"  # the default folder of its table files (`engram export-tables RUN`)
SETTINGS = "settings.json"  # the process-wide settings of its latest start (training/settings.py)


def detect(path: str | Path) -> bool:
    """Whether ``path`` is a run folder: it holds ``model/`` or ``checkpoints/`` (a run that lost
    either is still a run, so that opening names what is gone), and is not an adapter (whose
    folder keeps `engram finetune`'s checkpoints too)."""
    from . import adapter
    from .checkpoint import FOLDER as CHECKPOINTS

    p = Path(path)
    return p.is_dir() and ((p / FOLDER).is_dir() or (p / CHECKPOINTS).is_dir()) and \
        not adapter.detect(p)


def unmarked(path: Path) -> bool:
    """Whether ``path`` is a run an engram from before folder markers wrote (outputs.SIGNATURES):
    its checkpoints' latest.json, or a config.json holding TrainConfig's keys."""
    from .checkpoint import FOLDER as CHECKPOINTS
    from .checkpoint import LATEST

    if (path / CHECKPOINTS / LATEST).is_file():
        return True
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(k in config for k in ("n_layer", "engram_layers",
                                                                  "steps"))


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
        """The tokenizer, or a UserError naming the file (tokenizers raises a bare Exception)."""
        from tokenizers import Tokenizer

        run_dir = self.tokenizer_file.parents[1]
        try:
            tok = Tokenizer.from_file(str(self.tokenizer_file))
        except Exception as e:
            raise UserError(f"{run_dir}: {FOLDER}/{self.tokenizer_file.name} cannot be read "
                            f"({one_line(e)}): {_rewrite(run_dir)}") from e
        size = tok.get_vocab_size(with_added_tokens=True)
        if size != self.compression.raw_vocab_size:  # the map covers the whole tokenizer
            raise UserError(f"{run_dir}: {FOLDER}/{self.tokenizer_file.name} is not the run's "
                            f"tokenizer ({size} ids, the run's maps cover "
                            f"{self.compression.raw_vocab_size}): {_rewrite(run_dir)}")
        return tok

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
    """``identity`` of the files ``run_dir`` holds (None: none, or damaged: a resume writes them
    again)."""
    try:
        files = read_run_files(run_dir)
        files.tokenizer()
        meta = json.loads((Path(run_dir) / FOLDER / "model.json").read_text())
    except (OSError, ValueError):  # UserError is a ValueError
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


def _rewrite(run_dir: str | Path) -> str:
    """What to do about a damaged ``RUN/model/``: what writes it again."""
    return (f"copy {FOLDER}/ back from a copy of the run, or resume it once with its own "
            f"options (`engram train --config {Path(run_dir) / CONFIG} --out_dir {run_dir}`), "
            f"which writes {FOLDER}/ again")


def read_run_files(run_dir: str | Path) -> RunFiles:
    """``RUN/model/``, checked against itself (the compression's digest, the vocabulary's length
    and range), or one UserError naming the part and what to do."""
    from safetensors.torch import load_file

    folder = Path(run_dir) / FOLDER
    meta_path = folder / "model.json"
    if not meta_path.is_file():
        raise UserError(f"{run_dir} has no {FOLDER}/model.json (a run trained before runs kept "
                        f"their model files, or a damaged one): {_rewrite(run_dir)}")
    part = meta_path
    try:
        meta = read_json_object(meta_path)
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        config = model_config_from_dict(meta["model"])
        eos_id = int(meta["eos_id"])
        part = folder / "maps.safetensors"
        maps = load_file(str(part))
        vocab, lookup = maps["vocab"].numpy(), maps["compression"].numpy()
        compression = Compression(lookup, fingerprint=meta.get("compression_fingerprint"))
    except Exception as e:  # json, safetensors (SafetensorError), a config's own checks
        raise UserError(f"{run_dir}: {FOLDER}/{part.name} cannot be read "
                        f"({type(e).__name__}: {one_line(e)}): {_rewrite(run_dir)}") from e
    digest = hashlib.sha256(np.ascontiguousarray(lookup, dtype=np.int64)).hexdigest()
    if meta.get("compression", digest) != digest:
        raise UserError(f"{run_dir}: {FOLDER}/maps.safetensors is damaged (its compression map "
                        f"is not the one model.json records): {_rewrite(run_dir)}")
    if (vocab.ndim != 1 or len(vocab) != config.vocab_size or
            (len(vocab) and (vocab.min() < 0 or vocab.max() >= len(lookup))) or
            bool(np.any(np.diff(vocab) <= 0))):
        raise UserError(f"{run_dir}: {FOLDER}/maps.safetensors is damaged (its vocabulary is not "
                        f"{config.vocab_size} sorted ids of the tokenizer, as model.json says): "
                        f"{_rewrite(run_dir)}")
    counts: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in maps.items():
        if key.startswith("rows."):
            _, lid, part_name = key.split(".", 2)
            counts.setdefault(int(lid), {})[part_name] = t
    return RunFiles(config, vocab, compression, folder / "tokenizer.json", eos_id,
                    meta.get("nine_shared"), meta.get("data") or {}, counts or None)



# The options of a run (training/train.py's TrainConfig, as RUN/config.json and each checkpoint
# hold them) that decide the model served: its shapes, its hashing, its vocabulary. The rest are
# how it was trained or bookkeeping (out_dir, steps, device, lr, a moved --data folder, ...), which
# may differ between the two copies (a resume rewrites config.json before its first save).
MODEL_OPTIONS = (
    "n_layer", "d_model", "n_head", "d_ff", "seq_len", "head", "head_cutoffs", "tie_embeddings",
    "hc_mult", "moe", "n_routed_experts", "n_shared_experts", "top_k", "d_expert",
    "engram", "engram_layers", "table_size", "max_ngram_size", "n_head_per_ngram",
    "n_embed_per_ngram", "engram_gate", "engram_profile", "engram_norm_eps", "engram_conv",
    "engram_fixed_gate", "engram_shared_key", "compress", "engram_lookup", "engram_prime_sizes",
    "engram_head_gain", "hot_rows", "hot_index", "fingerprint_bits", "shared_tables", "seed",
    "sources", "max_chars", "val_fraction", "vocab")


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _differences(ours: dict[str, Any], theirs: dict[str, Any], keys: Any) -> list[str]:
    """``key (ours vs theirs)`` for each of ``keys`` both hold and that differs."""
    return [f"{k} ({_plain(ours[k])!r} vs {_plain(theirs[k])!r})" for k in keys
            if k in ours and k in theirs and _plain(ours[k]) != _plain(theirs[k])]


def _said_by_options(options: dict[str, Any], files: RunFiles) -> list[str]:
    """Where ``RUN/model/model.json`` disagrees with the options the checkpoint was trained with,
    on the fields TrainConfig.model_config copies over unchanged (the derived ones, such as the
    table sizes, show in the checkpoint's shapes)."""
    m = files.config
    ours = {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head,
            "seq_len": m.max_seq_len, "tie_embeddings": m.tie_embeddings, "hc_mult": m.hc_mult,
            "moe": m.moe, "engram": m.engram is not None,
            "engram_fixed_gate": m.engram_fixed_gate, "engram_shared_key": m.engram_shared_key,
            "engram_head_gain": m.engram_head_gain}
    for k in ("d_ff", "d_expert", "engram_gate", "engram_conv", "engram_norm_eps"):
        if options.get(k) is not None:  # None in the options: a default the model resolves
            ours[k] = getattr(m, k)
    if m.moe:
        ours.update(n_routed_experts=m.n_routed_experts, n_shared_experts=m.n_shared_experts,
                    top_k=m.top_k)
    e = m.engram
    if e is not None:
        ours.update(engram_layers=list(e.layer_ids), max_ngram_size=e.max_ngram_size,
                    n_embed_per_ngram=e.n_embed_per_ngram, n_head_per_ngram=e.n_head_per_ngram,
                    seed=e.seed, engram_profile=e.profile, engram_lookup=e.lookup,
                    engram_prime_sizes=e.prime_sizes)
        if "hot_rows" in options and "shared_tables" in options:  # Engram-Nine: its sharing
            nine = bool(options["hot_rows"]) or bool(options["shared_tables"])
            options = {**options, "nine_shared": bool(options["shared_tables"]) if nine else None}
            ours["nine_shared"] = files.nine_shared
    return _differences(ours, options, ours)


def check_copies(run_dir: str | Path, files: RunFiles, checkpoint: str | Path,
                 meta: dict[str, Any]) -> None:
    """Refuse a run whose copies of its config disagree, in one line: RUN/config.json and
    RUN/model/model.json against ``meta``, the metadata of its newest checkpoint ``checkpoint``
    (what was trained), on what decides the model served (``MODEL_OPTIONS``). A missing
    config.json is not needed to open the run; an unreadable one is refused."""
    run_dir = Path(run_dir)
    trained = meta.get("config")
    name = Path(checkpoint).name
    if not isinstance(trained, dict):
        return  # a checkpoint without its options (none of ours): nothing to compare
    path = run_dir / CONFIG
    if path.exists():
        try:
            options = read_json_object(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{run_dir}: {CONFIG} cannot be read ({type(e).__name__}: "
                            f"{one_line(e)}): it records the options the run was trained with; "
                            f"copy it back from a copy of the run, or delete it (the run opens "
                            f"with the copy its checkpoint {name} holds)") from e
        diff = _differences(options, trained, MODEL_OPTIONS)
        if diff:
            raise UserError(f"{run_dir}: {CONFIG} disagrees with its checkpoint {name} on "
                            f"{', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''} "
                            "(config.json's value vs the checkpoint's): undo the edit (the "
                            "checkpoint's values are what was trained), or train a new run with "
                            "these options "
                            "(`engram train --config ... --out_dir NEW`)")
    diff = _said_by_options(trained, files)
    data = meta.get("data")
    if isinstance(data, dict) and files.data and files.data != data:
        diff.append(f"data ({files.data!r} vs {data!r})")
    if diff:
        raise UserError(f"{run_dir}: {FOLDER}/model.json disagrees with its checkpoint {name} "
                        f"on {', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''} "
                        f"(model.json's value vs the checkpoint's): {_rewrite(run_dir)}")


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
