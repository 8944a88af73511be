"""The process-wide settings a training run's numbers depend on, recorded with the run and put back
when it resumes; and the allocator environment training processes start with.

Recorded (``record``): the GEMM route of each shape bucket the run's products took
(engram/compute/gemm.py: torch's MKL or oneDNN, whose summation orders differ), torch's thread count (a
product's summation order follows it too) and the allocator environment. A bucket's route is timed
on its first use on a machine and kept in the user's cache, where a later measurement may replace
it (one made on a busy machine is measured again once it is quiet): the same command on the same
machine could then take the other backend. So a run writes its record to out_dir/settings.json
(at its start, then with its metrics records when it changed) and into every checkpoint's meta,
and a resumed run, or one repeated in the same folder (killed before its first checkpoint, say),
installs the recorded routes before any product runs (``reuse``), whatever the cache holds
then. ``ENGRAM_GEMM`` = torch / onednn still decides
every product it names (the record then says so); buckets the record lacks (another batch size)
are decided as before and join the record. A record from another machine (CPU or torch version)
is not installed: its timings say nothing there, and the bits differ anyway.

Process-wide settings are made where a process starts, never by a library call in the middle of
a run: torch's thread count by ``engram train`` (``TrainConfig.threads``, applied once as the run is
built: ``train.resolve_machine``), the studies' worker initialiser (studies/common.py), the study
commands (cli/) and benchmark mains; the allocator environment (``allocator_env``) by what
starts training processes; the tokenizer's pool by ``engram prepare``
(``prepare.tokenizer_threads``). The record keeps the thread count (GEMM routes are keyed by it:
under another count a bucket is decided afresh).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from ..artifacts.checkpoint import FOLDER as CHECKPOINTS, LATEST
from ..artifacts.run import SETTINGS  # in a run's out_dir: the record of its latest start
from ..compute import gemm
from ..files import publish_text


# glibc gives every freed block above its mmap / trim thresholds back to the kernel, so each step's
# large activations (logits, attention, the FFN's hidden) page-fault in again, zeroed: ~20k minor
# faults and ~12% more CPU time per step of the compare models (benchmarks/train.py, "faults").
# Training processes keep freed memory for the next step instead; peak RSS stays what it was.
# glibc reads these at process start, so they apply to processes started while they are set.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


@contextmanager
def allocator_env() -> Iterator[None]:
    """Processes started inside keep freed memory (``ALLOCATOR_ENV``, unless already set). For
    whatever starts training processes (the studies' worker pool, benchmark mains)."""
    old = {k: os.environ.get(k) for k in ALLOCATOR_ENV}
    for k, v in ALLOCATOR_ENV.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def record() -> dict[str, Any]:
    """This process's settings as a run records them (JSON)."""
    return {"gemm": gemm.record(), "threads": torch.get_num_threads(),
            "allocator": {k: os.environ.get(k) for k in ALLOCATOR_ENV}}


def write(out_dir: str | Path, last: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record, as out_dir/settings.json (on the process that logs: at a run's start, then
    whenever it changed from ``last``, as products sized by the data decide new buckets); returns
    it."""
    rec = record()
    if rec != last:
        publish_text(Path(out_dir) / SETTINGS, json.dumps(rec, indent=1, sort_keys=True))
    return rec


def recorded(out_dir: str | Path) -> dict[str, Any]:
    """What run folder ``out_dir`` recorded: its newest checkpoint's record (one process or
    sharded) over settings.json's; {} when neither has one. An unreadable file counts as none
    (loading that checkpoint refuses it, with the reason)."""
    out = Path(out_dir)
    rec = _json(out / SETTINGS)
    ckpt = _checkpoint_record(out / CHECKPOINTS)
    if not ckpt:
        return rec
    ours, theirs = rec.get("gemm") or {}, ckpt.get("gemm") or {}
    if ours.get("machine") != theirs.get("machine"):
        return ckpt
    # settings.json may have routes decided after the checkpoint (a run killed before the next)
    return {**ckpt, "gemm": {**theirs, "routes": {**ours.get("routes", {}),
                                                  **theirs.get("routes", {})}}}


def reuse(out_dir: str | Path) -> dict[str, Any]:
    """Install the GEMM routes run folder ``out_dir`` recorded (made on this machine), before its
    model runs a product; returns the record ({} when none)."""
    rec = recorded(out_dir)
    gemm.reuse(rec.get("gemm"))
    return rec


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _checkpoint_record(ckpts: Path) -> dict[str, Any]:
    """The record in the meta of the checkpoint ``ckpts/latest.json`` names (train.py's file, or a
    sharded checkpoint's dense part), read from its header alone."""
    latest = _json(ckpts / LATEST)
    if "dir" in latest:  # sharded (dist_checkpoint.py): the dense part is train.py's format
        ckpts = ckpts / str(latest["dir"]) / "dense"
        latest = _json(ckpts / LATEST)
    if "file" not in latest:
        return {}
    try:
        from safetensors import safe_open

        with safe_open(str(ckpts / str(latest["file"])), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
    except Exception:  # safetensors raises several types for a torn or foreign file
        return {}
    rec = meta.get("settings") if isinstance(meta, dict) else None
    return rec if isinstance(rec, dict) else {}
