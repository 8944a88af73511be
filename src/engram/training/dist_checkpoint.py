"""Checkpoints of a distributed run: dense state once, each table shard by its owner, resharded on
load so a run saved at one world size resumes at another (split out of distributed.py).

Layout: ``checkpoints/step_N/dense/`` (train.py's format) plus ``step_N/shard-R-of-W.safetensors``,
each written atomically; ``latest.json`` is published last with every shard's SHA-256.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..artifacts.checkpoint import (
    FOLDER as CHECKPOINTS,
    LATEST,
    CheckpointError,
    latest_checkpoint,
    latest_distributed,
    load_checkpoint,
    save_checkpoint,
)
from ..files import publish_text, sha256_file
from ..models.model import EngramLM
from ..tables.sharded import read_shards, row_range, shard_bounds, write_shard
from .process_group import Dist
from .train import (
    Run,
    TrainConfig,
    build_run,
    check_same_config,
    check_same_data,
    checkpoint_meta,
    load_position,
    save,
)
from .working_table import WorkingRows




def _tables(model: EngramLM) -> dict[int, Any]:
    """The tables whose rows the shard files hold (a file-tier run's are in its tier folders)."""
    return {L: e.table for L, e in model.engrams().items()
            if not isinstance(e.table, WorkingRows)}


def _table_keys(model: EngramLM) -> set[str]:
    tables = _tables(model).values()
    return {f"{n}.weight" for n, m in model.named_modules() if any(m is t for t in tables)}


def _dense_state(run: Run) -> dict[str, Any]:
    """train.py's checkpoint state minus the table rows and their optimiser state."""
    skip = _table_keys(run.model)
    model = {k: v for k, v in run.model.state_dict().items() if k not in skip}
    optim = {"dense": run.optim.dense.state_dict(), "table_lr_mult": run.optim.table_lr_mult}
    if run.optim.scaler is not None:  # fp16's loss scale
        optim["scaler"] = run.optim.scaler.state_dict()
    return {"model": model, "optim": optim, "rng": torch.get_rng_state()}


def save_distributed(run: Run, d: Dist, keep: int = 2) -> Path:
    """Collective: each rank writes its shard, rank 0 the dense part, then publishes latest.json."""
    root = Path(run.cfg.out_dir) / CHECKPOINTS
    step_dir = root / f"step_{run.step:08d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    name = f"shard-{d.rank:05d}-of-{d.world:05d}.safetensors"
    write_shard(step_dir / name, _tables(run.model), run.optim.tables,
                {"step": run.step, "rank": d.rank, "world": d.world})
    # A rank that died before writing its shard fails the save here, naming the ranks missing.
    dist.monitored_barrier(group=d.control, timeout=timedelta(seconds=d.timeout_s),
                           wait_all_ranks=True)
    shards = [None] * d.world
    dist.all_gather_object(shards, (name, sha256_file(step_dir / name)), group=d.control)
    if d.rank == 0:
        shutil.rmtree(step_dir / "dense", ignore_errors=True)
        save_checkpoint(step_dir / "dense", run.step, _dense_state(run), checkpoint_meta(run),
                        keep=0)
        publish_text(root / LATEST, json.dumps(
            {"step": run.step, "dir": step_dir.name, "world": d.world, "shards": shards}))
        for old in sorted(root.glob("step_*"))[:-keep]:
            if old.name != step_dir.name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=d.control)  # nobody runs ahead of a publication
    return step_dir


def _shards_to_read(tables: dict[int, Any], info: dict, step_dir: Path) -> list[Path]:
    """The shard files whose rows overlap this process's (the only ones read), checksum-verified."""
    paths = []
    for k, (name, sha) in enumerate(info["shards"]):
        ranges = [shard_bounds(t.num_rows, info["world"])[k:k + 2] for t in tables.values()]
        mine = [row_range(t) for t in tables.values()]
        if any(max(a, lo) < min(z, hi) for (a, z), (lo, hi) in zip(ranges, mine)):
            if sha256_file(step_dir / name) != sha:
                raise CheckpointError(f"checkpoint shard {step_dir / name} is corrupted "
                                      "(checksum mismatch)")
            paths.append(step_dir / name)
    return paths


def load_distributed(run: Run, step_dir: Path, info: dict, check_config: bool = True) -> None:
    """Load a sharded checkpoint into ``run`` at this world size, or into a single-process model."""
    dense_file = latest_checkpoint(step_dir / "dense")  # checksum-verified
    if dense_file is None:
        raise CheckpointError(f"checkpoint {step_dir} has no dense part")
    state, meta, step = load_checkpoint(dense_file)
    if check_config:
        check_same_config(run.cfg, meta["config"], step_dir)
        check_same_data(run.corpus, meta, step_dir)
    try:
        missing, unexpected = run.model.load_state_dict(state["model"], strict=False)
        rows = _table_keys(run.model)
        if unexpected or set(missing) - rows:
            raise CheckpointError(f"checkpoint {step_dir} does not fit this model (missing "
                                  f"{sorted(set(missing) - rows)}, unexpected {unexpected})")
        run.optim.dense.load_state_dict(state["optim"]["dense"])
        if run.optim.scaler is not None and "scaler" in state["optim"]:
            run.optim.scaler.load_state_dict(state["optim"]["scaler"])
        tables = _tables(run.model)
        read_shards(_shards_to_read(tables, info, step_dir), tables, run.optim.tables)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir} does not fit this model: {e}") from e
    torch.set_rng_state(state["rng"])
    load_position(run, meta, step)


class ShardedCheckpoints:
    """``loop.Checkpoints`` of a torchrun job in out_dir/checkpoints; every rank calls each
    method (saving is collective)."""

    def __init__(self, d: Dist, out_dir: str | Path, keep: int = 2):
        self.d, self.out_dir, self.keep = d, out_dir, keep

    def latest(self) -> tuple[Path, dict] | None:
        return latest_distributed(self.out_dir)

    def load(self, run: Run, found: tuple[Path, dict]) -> None:
        load_distributed(run, *found)

    def save(self, run: Run) -> Path:
        return save_distributed(run, self.d, self.keep)


def consolidate(src_out_dir: str | Path, dst_out_dir: str | Path) -> Path:
    """Turn the newest sharded checkpoint into a single-process one ``engram train`` resumes."""
    found = latest_distributed(src_out_dir)
    if found is None:
        raise CheckpointError(f"no sharded checkpoint in {src_out_dir}")
    step_dir, info = found
    meta = load_checkpoint(latest_checkpoint(step_dir / "dense"))[1]
    if meta["config"].get("table_tier") == "file":
        raise CheckpointError(f"{src_out_dir} trained its tables in per-rank tier folders "
                              "(table_tier=file): engram.open / eval / generate / export-hf read "
                              "them from the run folder; consolidate is for in-memory tables")
    cfg = TrainConfig.from_record({**meta["config"], "out_dir": str(dst_out_dir)}, step_dir)
    run = build_run(cfg)
    load_distributed(run, step_dir, info, check_config=False)
    Path(dst_out_dir).mkdir(parents=True, exist_ok=True)
    return save(run)
