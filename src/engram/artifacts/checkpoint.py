"""Training checkpoints: one safetensors file per save, published atomically, verified on load.

A checkpoint holds nested state (model, optimisers with sparse row state, RNG, step) flattened to
tensors plus a JSON metadata entry for everything that is not a tensor. ``latest.json`` names the
newest file and its SHA-256, so a torn or corrupted file is refused instead of loaded, and a run
killed at any instant leaves either the old or the new checkpoint, never a mix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import InputNotFound, UserError
from ..files import publish, publish_text, sha256_file

FOLDER = "checkpoints"  # RUN/checkpoints/ (an adapter folder's too: its resume state)
LATEST = "latest.json"
_TENSOR = "__tensor__"
# What to do about a damaged checkpoint file or pointer (nothing rebuilds what training learned).
_AGAIN = "copy the checkpoints back from a copy of the run, or train again"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint on disk is missing, corrupted, or does not fit the run (a UserError: the user
    can resume elsewhere or remove it; still a RuntimeError for callers that catch that)."""


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested dict/list by a reference, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "root"
        t = obj.detach().contiguous().cpu()
        # safetensors refuses aliased storage (tied weights): give repeats their own copy.
        if any(u.data_ptr() == t.data_ptr() for u in tensors.values() if t.numel()):
            t = t.clone()
        tensors[key] = t
        return {_TENSOR: key}
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint keys must be str or int, got {type(k).__name__}")
        return {"__dict__": [[k, _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {prefix!r}")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
        items = [_unflatten(v, tensors) for v in obj["__list__"]]
        return tuple(items) if obj["tuple"] else items
    return obj



def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any],
                    meta: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` (nested, with tensors) and JSON-able ``meta`` as step's checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "s", tensors)
    path = directory / f"step_{step:08d}.safetensors"
    publish(path, lambda tmp: save_file(tensors, tmp, metadata={
        "skeleton": json.dumps(skeleton), "meta": json.dumps(meta), "step": str(step)}),
        need=sum(t.numel() * t.element_size() for t in tensors.values()))
    publish_text(directory / LATEST, json.dumps(
        {"file": path.name, "step": step, "sha256": sha256_file(path)}))
    old = sorted(directory.glob("step_*.safetensors"))[:-keep] if keep > 0 else []
    for p in old:
        p.unlink(missing_ok=True)
    return path


def saved_step(out_dir: str | Path) -> int | None:
    """The step of the newest checkpoint of run folder ``out_dir`` (one process or sharded), from
    its pointer alone; None when there is none."""
    try:
        return int(json.loads((Path(out_dir) / FOLDER / LATEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    try:
        info = json.loads(pointer.read_text())
        sharded = "dir" in info and "file" not in info  # dist_checkpoint's pointer
        path = None if sharded else Path(directory) / info["file"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer} is corrupted ({e}): {_AGAIN}") from e
    if path is None:
        tier = any((pointer.parents[1] / "tier").glob("rank-*-of-*"))  # table_tier=file's
        ranks = (f"--nproc-per-node {info.get('world')}: its tables are in per-rank tier "
                 "folders" if tier else "any number of ranks, --nproc-per-node 1 too")
        raise CheckpointError(f"{pointer.parent} holds a torchrun run's sharded checkpoint: resume "
                              f"it under torchrun ({ranks}); "
                              "engram.open / generate / eval read it as it is")
    if not path.exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing: {_AGAIN}")
    if sha256_file(path) != info.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupted (checksum mismatch): {_AGAIN}")
    return path


def load_checkpoint(path: str | Path, parts: tuple[str, ...] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(state, meta, step) of one checkpoint file; ``parts``: only these top-level entries of the
    state are read (a server needs the model, not the optimiser's moments: 2x the tables)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata()
            skeleton, meta, step = (json.loads(md["skeleton"]), json.loads(md["meta"]),
                                    int(md["step"]))
            if parts is not None:
                skeleton = {"__dict__": [kv for kv in skeleton["__dict__"] if kv[0] in parts]}
            tensors = {name: f.get_tensor(name) for name in _tensor_names(skeleton)}
    except Exception as e:  # safetensors raises several types for a torn or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    return _unflatten(skeleton, tensors), meta, step


def saved_meta(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of one checkpoint file (its options, data identity), tensors unread."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()["meta"])
    except Exception as e:  # safetensors raises several types for a torn or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e


def _tensor_names(obj: Any) -> list[str]:
    """Every tensor name under a node of the skeleton."""
    if not isinstance(obj, dict):
        return []
    if _TENSOR in obj:
        return [obj[_TENSOR]]
    children = [v for _, v in obj["__dict__"]] if "__dict__" in obj else obj["__list__"]
    return [n for c in children for n in _tensor_names(c)]


def latest_distributed(out_dir: str | Path) -> tuple[Path, dict] | None:
    """(step directory, pointer) of the newest complete sharded checkpoint, or None."""
    pointer = Path(out_dir) / FOLDER / LATEST
    if not pointer.exists():
        return None
    try:
        info = json.loads(pointer.read_text())
        if "file" in info:  # train.py's pointer
            raise CheckpointError(f"{pointer.parent} holds a single-process checkpoint; a "
                                  "distributed run needs its own out_dir")
        step_dir = pointer.parent / info["dir"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{pointer} is corrupted: {e}") from e
    missing = [f for f, _ in info["shards"] if not (step_dir / f).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {step_dir} lacks shard files {missing}")
    return step_dir, info


def newest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint file of a run folder: train.py's, or a torchrun run's dense part;
    None when there is none."""
    pointer = Path(out_dir) / FOLDER / LATEST
    try:
        sharded = "dir" in json.loads(pointer.read_text())
    except (OSError, ValueError, TypeError):  # latest_checkpoint says what is wrong
        sharded = False
    if not sharded:
        return latest_checkpoint(pointer.parent) if pointer.parent.is_dir() else None
    dense_file = latest_checkpoint(latest_distributed(out_dir)[0] / "dense")
    if dense_file is None:
        raise CheckpointError(f"checkpoint {pointer.parent} has no dense part")
    return dense_file


def served_checkpoint(out_dir: str | Path) -> tuple[dict[str, Any], Path, list[Path]]:
    """A run's newest checkpoint as a server reads it, in one process: (the model's state and a
    Nine run's hot index, no optimiser state; its file; a torchrun run's shard files,
    checksum-verified, whose rows a server holds all of)."""
    ckpt = newest_checkpoint(out_dir)
    if ckpt is None:
        raise InputNotFound(f"no checkpoint under {out_dir}/checkpoints (train one with "
                            f"`engram train --out_dir={out_dir}`)")
    state, meta, step = load_checkpoint(ckpt, parts=("model", "hot_index"))  # hot.STATE_KEY
    if meta.get("config", {}).get("table_tier") == "file":  # the tables are in the tier folder
        state["model"].update(_tier_tables(Path(out_dir), meta, step))
        return state, ckpt, []  # a torchrun run's shard files hold no rows then
    if ckpt.parent.name != "dense":
        return state, ckpt, []
    step_dir, info = latest_distributed(out_dir)
    for name, sha in info["shards"]:
        if sha256_file(step_dir / name) != sha:
            raise CheckpointError(f"checkpoint shard {step_dir / name} is corrupted (checksum "
                                  "mismatch)")
    return state, ckpt, [step_dir / name for name, _ in info["shards"]]


def _tier_tables(out_dir: Path, meta: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    """A file-tier run's tables as its checkpoint holds them: from the run folder's own tier/
    (found wherever the folder was copied), else the --table_dir it recorded."""
    from .tier_files import META, rank_folder, served_rows

    recorded = meta["config"].get("table_dir")
    folders = [out_dir / "tier"] + ([Path(recorded)] if recorded else [])
    record = meta.get("hook_state", {}).get("table_tier") or {}
    first = rank_folder(0, record["world"]) + "/" if "ranks" in record else ""  # torchrun's
    folder = next((f for f in folders if (f / (first + META)).exists()), None)
    if folder is None:
        raise InputNotFound(f"{out_dir} was trained with its tables in files (table_tier=file) "
                            f"and none is here: looked in {', '.join(map(str, folders))}")
    rows = served_rows(folder, record or None, step)
    return {f"blocks.{lid}.engram.table.weight": r for lid, r in rows.items()}
