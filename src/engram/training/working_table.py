"""A layer's table while it trains from the file tier (training/tier_tables.py): the step's rows
as a small dense parameter, looked up through remapped ids; outside a step, the file's rows.
``WorkingTable`` is one process's whole table; ``WorkingShard`` a torchrun rank's shard
of it (a ``ShardedTable`` whose owner side serves the asked rows from the working set).

Shape legend: r rows of the table (of the shard: its files' rows), e row width, u distinct rows of
the step, n row ids of a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tables.sharded import ShardedTable
from ..tables.store import MemoryTable
from . import sparse_rows


class WorkingRows:
    """What both working tables share: ``weight`` [u, e] holds the step's rows (ids ``uniq`` [u]
    of the tier's files, sorted); outside a step (evaluation) rows are read from the files. Its
    rows are not in the model's state dict (they are files)."""

    # how the in-memory table's clip coalesces its gradient (train.py's clip_grad_norm_); None: the
    # gradient is left to the clip
    coalesce = staticmethod(sparse_rows.coalesce_rows)

    def _working(self, files, lid: int) -> None:
        self.files, self.lid = files, lid  # the tier's files (tier_files.TierFiles)
        self.held = files.shapes[lid][0]  # rows in the files: the table's, or the shard's
        self.uniq: torch.Tensor | None = None
        self.last_micro = False  # set while the step's last micro-batch runs (TierBatches)
        self.before_read = None  # called before rows are read from the file (TierTables.wait)
        if self.coalesce is not None:
            self.weight.register_post_accumulate_grad_hook(self._coalesce)

    def reset_parameters(self, *args, **kwargs) -> None:
        pass

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """File row ids -> rows of the working set (each must be in it)."""
        local = torch.searchsorted(self.uniq, ids).clamp_(max=self.uniq.numel() - 1)
        if not bool((self.uniq[local] == ids).all()):
            raise RuntimeError("a row outside the step's working set was looked up")
        return local

    def file_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """File row ids [...] -> their rows [..., e] read now (evaluation; no gradient)."""
        if self.before_read is not None:
            self.before_read()
        u, inv = torch.unique(ids.reshape(-1), return_inverse=True)
        got = self.files.read(self.lid, u, names=["rows"])["rows"]  # [u, e]
        return got[inv].view(*ids.shape, self.dim)

    def _coalesce(self, p: torch.Tensor) -> None:
        # Duplicates summed exactly as the in-memory table's gradient is (same function, same shape,
        # same entries in the same order), so the clip and the optimiser see the same floats.
        # Only after the last micro-batch: autograd adds micro-batches' gradients by concatenation,
        # and a sum coalesced early would be added in another order.
        g = p.grad
        if g is None or g.is_coalesced() or not self.last_micro:
            return
        idx = self.uniq[g._indices()[0]]
        full = self.coalesce(torch.sparse_coo_tensor(
            idx.unsqueeze(0), g._values(), (self.held, self.dim), check_invariants=False))
        local = torch.searchsorted(self.uniq, full._indices()[0])
        p.grad = torch.sparse_coo_tensor(local.unsqueeze(0), full._values(), p.shape,
                                         is_coalesced=True, check_invariants=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass  # the rows live in the tier's files

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        pass


class WorkingTable(WorkingRows, MemoryTable):
    """One process's table during tier training. A MemoryTable to build_optimizers and
    clipping."""

    def __init__(self, files, lid: int):
        nn.Module.__init__(self)
        self.num_rows, self.dim = files.shapes[lid]
        self.sparse, self.init_std, self.deferred = True, 0.0, False
        self.weight = nn.Parameter(torch.empty(0, self.dim))
        self._working(files, lid)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.uniq is None:  # between steps (evaluation): the file's rows, no gradient
            return self.file_rows(rows)
        return F.embedding(self.local(rows), self.weight, sparse=True)

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, tier=file"


class WorkingShard(WorkingRows, ShardedTable):
    """A torchrun rank's shard [lo, hi) of a table during tier training: its files hold the
    shard's rows (file row i is table row lo + i); lookups are the ShardedTable's collective, the
    rows this rank serves come from its working set (which TierTables filled with every row of
    its shard the global batch reads), or from the files between steps.

    Its gradient is left as the in-memory shard's is (uncoalesced: scaled by 1/world, then
    coalesced by the torchrun clip with torch's coalesce), its row ids those of the working set: a
    map that keeps their order, so the sort in the coalesce puts the entries in the same order and
    the sums are the same floats (tested at world sizes 2 and 3). A coalesce before the scaling
    (as WorkingTable's) would round differently where 1/world is not a power of two."""

    coalesce = None

    def __init__(self, files, lid: int, num_rows: int, group=None):
        ShardedTable.__init__(self, num_rows, files.shapes[lid][1], group=group, empty=True)
        if files.shapes[lid][0] != self.hi - self.lo:
            raise ValueError(f"the tier's files hold {files.shapes[lid][0]} rows of layer {lid}, "
                             f"this rank's shard {self.hi - self.lo}")
        self._working(files, lid)

    def serve(self, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uniq is None:  # between steps (evaluation): the files' rows, no gradient
            return self.file_rows(asked), asked
        local = self.local(asked)
        return self.weight.detach().index_select(0, local), local

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tier=file"
