"""A layer's table while it trains from the file tier (training/tier_tables.py): the step's rows
as a small dense parameter, looked up through remapped ids; outside a step, the file's rows.

Shape legend: r rows of the table, e row width, u distinct rows of the step, n row ids of a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tables.store import MemoryTable
from . import sparse_rows


class WorkingTable(MemoryTable):
    """A layer's table during tier training: ``weight`` [u, e] holds the step's rows (global ids
    ``uniq`` [u], sorted); outside a step (evaluation) rows are read from the file. A MemoryTable
    to build_optimizers and clipping; its rows are not in the model's state dict (they are files)."""

    def __init__(self, files, lid: int):
        nn.Module.__init__(self)
        self.num_rows, self.dim = files.shapes[lid]
        self.sparse, self.init_std, self.deferred = True, 0.0, False
        self.files, self.lid = files, lid  # the tier's files (tier_files.TierFiles)
        self.weight = nn.Parameter(torch.empty(0, self.dim))
        self.uniq: torch.Tensor | None = None
        self.last_micro = False  # set while the step's last micro-batch runs (TierBatches)
        self.before_read = None  # called before rows are read from the file (TierTables.wait)
        self.weight.register_post_accumulate_grad_hook(self._coalesce)

    def reset_parameters(self) -> None:
        pass

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.uniq is None:  # between steps (evaluation): the file's rows, no gradient
            if self.before_read is not None:
                self.before_read()
            u, inv = torch.unique(rows.reshape(-1), return_inverse=True)
            got = self.files.read(self.lid, u, names=["rows"])["rows"]  # [u, e]
            return got[inv].view(*rows.shape, self.dim)
        local = torch.searchsorted(self.uniq, rows).clamp_(max=self.uniq.numel() - 1)
        if not bool((self.uniq[local] == rows).all()):
            raise RuntimeError("a row outside the step's working set was looked up")
        return F.embedding(local, self.weight, sparse=True)

    def _coalesce(self, p: torch.Tensor) -> None:
        # Duplicates summed exactly as the whole table's gradient is (same function, same shape,
        # same entries in the same order), so the clip and the optimiser see the same floats.
        # Only after the last micro-batch: autograd adds micro-batches' gradients by concatenation,
        # and a sum coalesced early would be added in another order.
        g = p.grad
        if g is None or g.is_coalesced() or not self.last_micro:
            return
        idx = self.uniq[g._indices()[0]]
        full = sparse_rows.coalesce_rows(torch.sparse_coo_tensor(
            idx.unsqueeze(0), g._values(), (self.num_rows, self.dim), check_invariants=False))
        local = torch.searchsorted(self.uniq, full._indices()[0])
        p.grad = torch.sparse_coo_tensor(local.unsqueeze(0), full._values(), p.shape,
                                         is_coalesced=True, check_invariants=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass  # the rows live in the tier's files

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        pass

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, tier=file"
