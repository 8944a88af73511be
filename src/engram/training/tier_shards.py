"""A torchrun rank's part of a file-tier run (``torchrun ... engram train --table_tier file``):
each rank keeps its shard of every table (rows [lo, hi), ``tables.sharded.shard_bounds``) and their
optimiser state in its own tier folder, ``<table_dir>/rank-RRRRR-of-WWWWW``
(artifacts/tier_files.py), and trains from it as one process does (tier_tables.py): every rank reads
the global batch, so each computes, with no communication, the rows of its shard the step's lookups
will ask it for (row ids depend on token ids only, paper section 2.5) and loads exactly those before
the step.

A checkpoint records every rank's tier (run id) in its dense part; a resume puts each rank's
folder back to it. The folders are not resharded: a tier run resumes at the world size it was
trained at (refused otherwise, before any work).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..artifacts.checkpoint import CheckpointError, latest_distributed
from ..artifacts.tier_files import rank_folder
from ..errors import UserError
from ..tables.sharded import shard_bounds


class Shard:
    """This rank's rows of each table and the collectives its tier's checkpoint records need."""

    def __init__(self, rank: int, world: int, rows: dict[int, int], fresh: bool, group=None,
                 control=None):
        self.rank, self.world, self.rows, self.fresh = rank, world, rows, fresh
        self.group, self.control = group, control  # the tables' all-to-alls; bookkeeping

    @property
    def folder(self) -> str:
        return rank_folder(self.rank, self.world)

    def span(self, lid: int) -> tuple[int, int]:
        """Rows [lo, hi) of layer ``lid``'s table on this rank (file row i is table row lo + i)."""
        b = shard_bounds(self.rows[lid], self.world)
        return b[self.rank], b[self.rank + 1]

    def gather(self, record: dict[str, Any]) -> dict[str, Any]:
        """Every rank's tier record (collective): what the dense checkpoint keeps."""
        out: list = [None] * self.world
        dist.all_gather_object(out, record, group=self.control)
        return {"step": record["step"], "world": self.world, "ranks": out}

    def pick(self, record: dict[str, Any] | None, where: Any) -> dict[str, Any] | None:
        """This rank's record in a checkpoint's (None: not a torchrun tier run's)."""
        if record is None or "ranks" not in record:
            return None
        if record["world"] != self.world:
            raise CheckpointError(_other_world(where, record["world"], self.world))
        return record["ranks"][self.rank]


def _other_world(where: Any, theirs: int, ours: int) -> str:
    return (f"checkpoint {where} was trained with table_tier=file on {theirs} ranks, each "
            f"holding its shard of the tables in its own tier folder; resume it with "
            f"--nproc-per-node {theirs} (tier folders are not resharded; this job has {ours})")


def check_world(out_dir: str, world: int) -> bool:
    """Whether a tier run in ``out_dir`` starts fresh; refused in one line when its newest
    checkpoint was written at another world size."""
    found = latest_distributed(out_dir)
    if found is not None and found[1]["world"] != world:
        raise UserError(_other_world(found[0], found[1]["world"], world))
    return found is None
