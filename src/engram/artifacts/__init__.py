"""What is on disk: each kind of folder engram writes, read and written in one place, below both
training (which writes them) and serving (which opens them). One module per kind, each with
``detect(path)``, ``read(path)`` (its parts, checked) and ``write(...)``, and the kind's file
names defined there alone: a run folder (run), an ``engram export-hf`` folder (export), an
``engram finetune`` adapter (adapter). Their parts: checkpoints (checkpoint), a file-tier run's
table and optimiser files (tier_files) and the table files of a model or a checkpoint
(table_files). tables/ owns the bytes of a table file."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputNotFound, UserError

# What a torchrun run's config.json holds besides TrainConfig's fields (training/distributed.py):
# `--config RUN/config.json` passes over them where no option of the command owns them.
RUN_RECORDS = ("world_size", "table_init")
KINDS = ("adapter", "run", "export")  # the order kind_of asks in (each detect excludes the others)


def kind_of(path: str | Path) -> str:
    """"run", "export" or "adapter": the kind of model folder ``path`` is, or one UserError line
    naming the path and what it lacks."""
    from . import adapter, export, run
    from .checkpoint import FOLDER as CHECKPOINTS

    p = Path(path)
    if not p.exists():
        raise InputNotFound(f"{p}: no such folder (a run, an `engram export-hf` folder or an "
                            "`engram finetune` adapter is expected)")
    if not p.is_dir():
        raise UserError(f"{p} is a file, not a model folder (a run, an `engram export-hf` folder "
                        "or an `engram finetune` adapter)")
    for name, module in zip(KINDS, (adapter, run, export)):
        if module.detect(p):
            return name
    raise UserError(f"{p} is not a model folder: it has no {run.FOLDER}/ or {CHECKPOINTS}/ "
                    f"(a run), no {export.CONFIG} (an `engram export-hf` folder) and no "
                    f"{adapter.WEIGHTS} (an `engram finetune` adapter)")


__all__ = ["KINDS", "RUN_RECORDS", "kind_of"]
