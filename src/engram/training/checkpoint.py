"""Training checkpoints: one safetensors file per save, published atomically, verified on load.

A checkpoint holds nested state (model, optimisers with sparse row state, RNG, step) flattened to
tensors plus a JSON metadata entry for everything that is not a tensor. ``latest.json`` names the
newest file and its SHA-256, so a torn or corrupted file is refused instead of loaded, and a run
killed at any instant leaves either the old or the new checkpoint, never a mix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..files import publish, publish_text

LATEST = "latest.json"
_TENSOR = "__tensor__"


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        {"file": path.name, "step": step, "sha256": _sha256(path)}))
    old = sorted(directory.glob("step_*.safetensors"))[:-keep] if keep > 0 else []
    for p in old:
        p.unlink(missing_ok=True)
    return path


def saved_step(out_dir: str | Path) -> int | None:
    """The step of the newest checkpoint of run folder ``out_dir`` (one process or sharded), from
    its pointer alone; None when there is none."""
    try:
        return int(json.loads((Path(out_dir) / "checkpoints" / LATEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    try:
        info = json.loads(pointer.read_text())
        path = Path(directory) / info["file"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{pointer} is corrupted: {e}") from e
    if not path.exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing")
    if _sha256(path) != info["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted (checksum mismatch)")
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(state, meta, step) of one checkpoint file."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata()
        skeleton, meta, step = json.loads(md["skeleton"]), json.loads(md["meta"]), int(md["step"])
    except Exception as e:  # safetensors raises several types for a torn or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    return _unflatten(skeleton, tensors), meta, step
