"""Training from a file tier (``engram train --table_tier file``): each Engram table and its row
optimiser's state live in files, read and written by row ids (artifacts/tier_files.py); a step
holds only its own rows in memory.

Row ids are known from token ids before the forward (paper section 2.5), so per step:

1. ``TierBatches.batch`` (the run's BatchSource, wrapped) starts step k: the distinct rows [u] each
   table's layer reads in the step's micro-batches, with their optimiser state, become a small
   dense working set (a ``working_table.WorkingTable``, which the layer looks up through
   remapped ids), and step k+1's rows start loading on the tier's worker thread (when the budget
   holds two working sets; else they are read when step k+1 starts);
2. the forward, backward, clip and table optimiser run on the working set as on a whole table:
   the same floats (the gradient is coalesced in global row ids, as the in-memory table's is; the
   optimiser's per-row state is the same, in other slots), so losses equal in-memory training's;
3. ``Optimizers.after_step`` writes the rows and state back, sparse, journaled
   (artifacts/tier_files.py); with a read-ahead the write runs on the worker, queued after step
   k+1's read, so rows of step k+1 that step k updated are patched from step k's result (not the
   file read), and step k+2's read comes after the write. Evaluation (which reads the files) and
   checkpoints wait for it.

The budget (``--table_budget_mb``) bounds the working sets (rows, state, ids) and the journal's
marks (a byte a table row); the gradient and activations are the model's, as in memory. The files
are never mapped (positional reads and writes of the step's rows), and a fresh run writes its
initial rows to them a chunk at a time (``store.deferred_rows``: the model is built without its
tables), so resident memory and address space stay the model's plus the budget, whatever the
tables' size (benchmarks/train_tier.py ``--beyond``: a table twice a process's RLIMIT_AS).

Under torchrun (training/tier_shards.py) each rank runs this on its shard of every table, in its
own folder: the global batch is hashed here (``_micro``), ``rows_of`` keeps its shard's rows, the
forward takes this rank's slice of those ids (distributed.local_batch: not hashed twice), the
working tables are ``WorkingShard`` (the owner side of the all-to-all serves them), and a
checkpoint records every rank's tier.

Shape legend: r rows of a table, e row width, n row ids of a step (repeats), u distinct rows.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..artifacts.checkpoint import CheckpointError
from ..artifacts.tier_files import JOURNAL, Journal, TierFiles, roll_back

if TYPE_CHECKING:
    from .tier_shards import Shard

# Bytes a working-set row holds beside its values and state: its global id, its optimiser slot
# and its row id there (int64, int32, int64).
WS_INDEX = 20


class TierTables:
    """The run's tables on the file tier: working sets, prefetch, write-back, checkpoints' part."""

    def __init__(self, cfg: Any, engrams: dict[int, nn.Module], files: TierFiles, budget: int,
                 shard: Shard | None = None):
        self.cfg, self.engrams, self.files, self.budget = cfg, engrams, files, budget
        self.shard = shard  # under torchrun: this rank's rows, records gathered over ranks
        self.hash = None  # under torchrun: hashes a global batch (its batches come unhashed)
        self.tables = {lid: e.table for lid, e in engrams.items()}
        for t in self.tables.values():
            t.before_read = self.wait
        self.journal = Journal.open(files.folder / JOURNAL, files.run_id)
        self.journaled = {lid: np.zeros(files.shapes[lid][0], dtype=bool) for lid in engrams}
        self.fixed = sum(j.nbytes for j in self.journaled.values())  # resident whatever the step
        self.optim = None  # the run's Optimizers (set by attach)
        self.t_max = {lid: 0 for lid in engrams}
        self.step: int | None = None
        self.ws: dict[int, dict[str, torch.Tensor]] | None = None  # the step's working set
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engram-tier")
        self._next: tuple[int, Future] | None = None
        self._batches: dict[int, list] = {}
        self._last: dict | None = None  # the last step's working set, written back
        self._writing: Future | None = None  # its write, on the worker thread
        self.peak = 0  # most bytes held in working sets at once (inspection, the benchmark)
        # seconds the training thread spent reading rows (or waiting for the read-ahead) and
        # writing them back, and steps whose rows were read ahead (the benchmark)
        self.read_s = self.write_s = 0.0
        self.read_ahead = 0

    # -- one step ---------------------------------------------------------------------------------
    def rows_of(self, batches: list) -> dict[int, torch.Tensor]:
        """Each table's distinct rows [u] (sorted file row ids) of a step's micro-batches; under
        torchrun those of this rank's shard, of the global batch every rank reads: the rows the
        lookups' all-to-all will ask this rank for."""
        ids = [b.hash_ids for b in batches]
        out = {}
        for lid, e in self.engrams.items():
            u = torch.unique(torch.cat([e.rows(h[lid]).reshape(-1) for h in ids]))
            if self.shard is not None:
                lo, hi = self.shard.span(lid)
                u = u[int(torch.searchsorted(u, lo)):int(torch.searchsorted(u, hi))] - lo
            out[lid] = u
        return out

    def load(self, uniq: dict[int, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        """Rows and state of ``uniq`` from the files, in the optimiser's buffer layout."""
        out = {}
        for lid, u in uniq.items():
            st: dict = {}
            self.optim.tables._resize(st, self.files.shapes[lid][1], u.numel(), u.device)
            # the state straight into the optimiser's buffers ("rows" there: its row ids)
            got = self.files.read(lid, u, {k: st[k] for k in self.files.names(lid) if k != "rows"})
            st.update({k: v for k, v in got.items() if k != "rows"})
            st["uniq"], st["weight"] = u, got["rows"]
            out[lid] = st
        return out

    def _bytes(self, ws: dict) -> int:
        return sum(s["uniq"].numel() * (self.files.row_bytes(lid) + WS_INDEX)
                   for lid, s in ws.items())

    def begin(self, step: int, batches) -> list:
        """Make step ``step``'s working set current (from the prefetch, patched, or read now);
        start reading step+1's. Returns the step's micro-batches."""
        t0 = time.perf_counter()
        mine = self._take(step, batches)
        self.read_s += time.perf_counter() - t0
        self.ws, self.step = mine, step
        opt = self.optim.tables
        for lid, t in self.tables.items():
            s = mine[lid]
            t.uniq, t.weight.data = s["uniq"], s["weight"]
            u = s["uniq"].numel()
            st = {k: v for k, v in s.items() if k not in ("uniq", "weight")}
            st.update(slot=torch.arange(u, dtype=torch.int32), n=u, dim=t.dim,
                      t_max=self.t_max[lid])
            st["rows"] = torch.arange(u)
            opt.state[t.weight] = st
        nxt = step + 1
        if nxt < self.cfg.steps and self._bytes(mine) * 2 + self.fixed <= self.budget:
            self._next = (nxt, self._pool.submit(self._prefetch, nxt, batches))
        self.peak = max(self.peak, self._bytes(mine))
        return self._batches.pop(step)

    def _micro(self, step: int, batches) -> list:
        """Step ``step``'s micro-batches, hashed. Under torchrun they come unhashed and are hashed
        whole here (every rank needs the global batch's rows of its shard); the forward then takes
        this rank's slice of these very ids (distributed.local_batch) instead of hashing its rows
        again: a row's ids depend on its tokens alone. On the read-ahead this runs on the worker,
        and the step's forward uses the batches it made only after ``_take`` waited for it."""
        bs = [batches.batch(step * self.cfg.grad_accum + m) for m in range(self.cfg.grad_accum)]
        if self.hash is not None:
            bs = [dataclasses.replace(b, hash_ids=self.hash(b.raw)) for b in bs]
        return bs

    def _prefetch(self, step: int, batches) -> dict:
        bs = self._micro(step, batches)
        self._batches[step] = bs
        uniq = self.rows_of(bs)
        need = sum(u.numel() * (self.files.row_bytes(lid) + WS_INDEX) for lid, u in uniq.items())
        if need + self._bytes(self.ws or {}) + self.fixed > self.budget:
            return None  # over the budget beside this step's: read after the write-back instead
        return self.load(uniq)

    def _take(self, step: int, batches) -> dict:
        if self._next is not None:
            want, fut = self._next
            self._next = None
            ws = fut.result()  # the read of step-1's write-back overlap is patched below
            if want == step and ws is not None:
                self.read_ahead += 1
                self.peak = max(self.peak, self._bytes(ws) + self._bytes(self._last or {}))
                self._patch(ws)
                return ws
        self.wait()  # read now, after the last write (its working set then freed)
        self._last = None
        bs = self._batches.get(step) or self._micro(step, batches)
        self._batches[step] = bs
        return self.load(self.rows_of(bs))

    def _patch(self, ws: dict) -> None:
        """Rows the last step wrote back take its values (the prefetch may have read them before
        the write)."""
        last = self._last
        if last is None:
            return
        for lid, s in ws.items():
            old = last[lid]
            _, a, b = np.intersect1d(s["uniq"].numpy(), old["uniq"].numpy(), assume_unique=True,
                                     return_indices=True)
            if a.size:
                a, b = torch.from_numpy(a), torch.from_numpy(b)
                for k in ("weight", *self.files.names(lid)):
                    if k != "rows":
                        s[k].index_copy_(0, a, old[k].index_select(0, b))
        self._last = None

    def write_back(self) -> None:
        """After the optimiser's step: the rows and their state to the files, old values first to
        the journal (once per row per checkpoint). With a read-ahead running the write runs on its
        thread, after that read (one worker, in order: the next read-ahead sees this write)."""
        if self.ws is None:
            return
        t0 = time.perf_counter()
        opt, ws = self.optim.tables, self.ws
        for lid, t in self.tables.items():
            st = opt.state.pop(t.weight, None) or {}
            self.t_max[lid] = st.get("t_max", self.t_max[lid])
            ws[lid].update({k: st[k] for k in self.files.names(lid) if k in st})
            t.uniq, t.weight.data = None, t.weight.data.new_empty(0, t.dim)
            t.weight.grad = None
        self.ws = None
        if self._next is not None:
            # kept while the read-ahead may have read these rows before this write (patched from
            # here); no more memory than the budget's two working sets: this one and the next
            self._last = ws
            self._writing = self._pool.submit(self._write, ws)
        else:
            self._last = None
            self._write(ws)
        self.write_s += time.perf_counter() - t0

    def _write(self, ws: dict) -> None:
        entries, fresh = [], {}
        for lid, s in ws.items():
            u = s["uniq"]
            fresh[lid] = ~self.journaled[lid][u.numpy()]
            if fresh[lid].any():
                rows = u[torch.from_numpy(fresh[lid])]
                entries.append((lid, rows, list(self.files.read(lid, rows).values())))
        self.journal.append(entries)  # durable before any table byte changes
        for lid, s in ws.items():
            self.journaled[lid][s["uniq"].numpy()[fresh[lid]]] = True
            self.files.write(lid, s["uniq"], {k: s["weight" if k == "rows" else k]
                                              for k in self.files.names(lid)})

    def wait(self) -> None:
        """Until the last write-back is in the files (before reading them, or a checkpoint)."""
        if self._writing is not None:
            t0 = time.perf_counter()
            fut, self._writing = self._writing, None
            fut.result()  # a failed write (a full disk) is raised here
            self.write_s += time.perf_counter() - t0

    # -- checkpoints ------------------------------------------------------------------------------
    def saved(self, step: int) -> dict[str, Any]:
        """Before the dense checkpoint of ``step``: tables durable; what it records of them
        (under torchrun every rank's, gathered: a collective)."""
        self.wait()
        self.files.sync()
        record = {"run": self.files.run_id, "step": step}
        return record if self.shard is None else self.shard.gather(record)

    def checkpointed(self, step: int) -> None:
        """After it: the journal undoes to ``step`` now."""
        self.journal.reset(step)
        for j in self.journaled.values():
            j[:] = False

    def recover(self, step: int, record: dict | None, where: Any) -> None:
        """The tables put back to checkpoint ``step``'s (refused in one line where they cannot be)."""
        if self.shard is not None:
            record = self.shard.pick(record, where)
        if record is None or record.get("run") != self.files.run_id:
            raise CheckpointError(f"{self.files.folder} holds the tables of another run than "
                                  f"checkpoint {where}; use that run's --table_dir")
        base = self.journal.base
        if base > step:
            raise CheckpointError(f"{self.files.folder}'s journal undoes to step {base}, the "
                                  f"newest checkpoint is step {step}: the tables cannot be put "
                                  "back to it (use another --out_dir)")
        if base == step:
            roll_back(self.files, self.journal)
        # base < step: killed between checkpoint ``step`` and the journal's reset; its tables
        # were synced before it was written and nothing has changed them since.
        self.checkpointed(step)
        self.t_max = {lid: self.files.max_of(lid, "steps") if "steps" in self.files.names(lid)
                      else 0 for lid in self.files.shapes}

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        self.journal.close()


class TierBatches:
    """The run's BatchSource with the tier's step boundaries: the first micro-batch of a step
    makes its working set current."""

    def __init__(self, inner, tier: TierTables):
        self.inner, self.tier, self.hasher = inner, tier, inner.hasher
        self._step, self._micro = None, []

    def batch(self, i: int):
        step, m = divmod(i, self.tier.cfg.grad_accum)
        if step != self._step:
            self._micro, self._step = self.tier.begin(step, self.inner), step
        for t in self.tier.tables.values():
            t.last_micro = m == len(self._micro) - 1
        return self._micro[m]


class TierCheckpoints:
    """``loop.Checkpoints`` of a tier run: the dense checkpoint between the tables' sync and
    the journal's reset; on load, the tables rolled back to it."""

    def __init__(self, inner, tier: TierTables):
        self.inner, self.tier = inner, tier

    def latest(self):
        return self.inner.latest()

    def load(self, run, found) -> None:
        self.inner.load(run, found)
        self.tier.recover(run.step, run.hook_state.get("table_tier"), found)

    def save(self, run):
        run.hook_state["table_tier"] = self.tier.saved(run.step)
        out = self.inner.save(run)
        self.tier.checkpointed(run.step)
        return out
