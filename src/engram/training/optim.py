"""Optimisers for Engram: lazy row-wise Adam for the tables, AdamW for everything else.

Paper recipe (spec section 4): the tables take Adam at 5x the base learning rate with no weight
decay; the dense parameters take AdamW. A step touches a tiny fraction of a table's rows, so the
table update and its optimiser state are row-wise: only touched rows are read, written and given
state, and step time follows the touched rows, not the table size.

Shape legend:
    r rows in a table, e row width, k rows in one step's gradient (after coalescing),
    n rows touched so far (rows with optimiser state), c >= n allocated state capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..tables.store import MemoryTable
from . import sparse_rows
from .precision import LossScaler

_INT32_MAX = 2**31 - 1


class RowAdam(torch.optim.Optimizer):
    """Lazy Adam for tables whose gradient is a sparse COO tensor over rows.

    A row's moments and step count exist from the first step that touches it; a step updates only
    the rows in its gradient. Bias correction uses each row's *own* step count, so a row first seen
    at step 1000 takes the same first update as a fresh Adam (lr * sign(g)). Alternatives:

    - dense Adam (and ``torch.optim.SparseAdam``, whose state is table-shaped): moments of table
      shape, 2x the table in memory, O(r) per step; untouched rows keep drifting on momentum.
    - lazy Adam with a global step (TF LazyAdam): a late row's first update is damped by stale bias
      correction (about 0.45 lr at betas (0.9, 0.95)) instead of lr.
    - row-wise Adagrad (DLRM/TorchRec): one scalar per row, the smallest state, but no momentum and
      a decaying step size; the paper trains tables with Adam, so we keep Adam.

    When every row is touched on every step, this is exactly ``torch.optim.Adam``.

    State per table: ``slot`` [r] int32 (-1 = never touched; index into the compact buffers),
    ``rows`` [c] int64 (slot -> row), ``moments`` [c, 2, e] float32 with ``exp_avg`` /
    ``exp_avg_sq`` [c, e] its two views, ``steps`` [c] int64, ``n`` touched rows. Buffers double
    when full (never past the table's rows), so growth is amortised O(1) per new row.
    Parameters may be float32 or bfloat16; the state and the update are float32.

    ``kernels``: float32 tables on CPU are updated by one compiled pass per row
    (training/sparse_rows.py, 5x faster); False, other devices and bfloat16 run the torch twin
    below (the reference the kernel is tested against).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, kernels: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid RowAdam hyper-parameters lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.kernels = kernels
        self.kernel_steps = 0  # table updates done by the compiled kernel (inspection)
        for group in self.param_groups:
            _check_group(group)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            _check_group(group)
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        if not p.grad.is_sparse:
            raise TypeError(
                f"RowAdam needs a sparse row gradient, got a dense one for a {tuple(p.shape)} "
                "parameter: build the table with sparse=True (MemoryTable(..., sparse=True) or "
                "build_engram(..., sparse=True)), or give this parameter to a dense optimiser")
        if p.grad.sparse_dim() != 1:
            raise ValueError(f"RowAdam needs a row-sparse gradient (sparse_dim 1, as F.embedding "
                             f"makes), got sparse_dim {p.grad.sparse_dim()}")
        # Duplicate row ids in one batch must be summed before the moments see them.
        g = sparse_rows.coalesce_rows(p.grad) if self.kernels else sparse_rows.coalesce(p.grad)
        rows = g.indices()[0]  # [k]
        if not rows.numel():
            return
        grad = g.values().float()  # [k, e]
        st = self.state[p]
        if not st:
            st.update(slot=_slot_map(p), n=0, t_max=0)
            _resize(st, p.shape[1], min(max(1024, 2 * rows.numel()), p.shape[0]), p.device)
        slots = self._assign_slots(st, rows)  # [k] int64
        beta1, beta2 = group["betas"]
        st["t_max"] += 1  # no row's step count can pass the number of updates
        if (self.kernels and sparse_rows.fits(p.detach()) and sparse_rows.fits(grad)
                and p.is_contiguous() and sparse_rows.available()):
            self.kernel_steps += 1
            bias1_inv, bias2_sqrt = _bias_tables(st, beta1, beta2)
            sparse_rows.adam_rows(p.detach(), rows, grad.contiguous(), slots, st["moments"],
                                  st["steps"], group["lr"], beta1, beta2, group["eps"], bias1_inv,
                                  bias2_sqrt)
            return
        # Both moments of a row sit side by side: one gather and one write-back, and one cache
        # miss per row instead of two (the touched rows are scattered over the state).
        mv = st["moments"].index_select(0, slots)  # [k, 2, e]
        m, v = mv[:, 0], mv[:, 1]  # [k, e] each
        t = st["steps"].index_select(0, slots) + 1  # [k]
        # Same arithmetic as torch.optim.Adam (single-tensor path), with per-row bias corrections
        # computed in float64 like Adam's Python-float scalars.
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        td = t.double()
        step_size = (group["lr"] / (1 - beta1 ** td)).float().unsqueeze(1)  # [k, 1]
        bc2_sqrt = (1 - beta2 ** td).sqrt().float().unsqueeze(1)  # [k, 1]
        denom = v.sqrt().div_(bc2_sqrt).add_(group["eps"])
        update = torch.mul(m, step_size).div_(denom)  # [k, e], same rounding as (lr_t * m) / denom
        # Rows are unique after coalescing: gather, subtract, write back (on CPU, index_add_ along
        # dim 0 is one small kernel per row: twice the time of the three passes).
        w = p.index_select(0, rows)  # [k, e]
        w = w.sub_(update) if p.dtype == torch.float32 else w.float().sub_(update).to(p.dtype)
        p.index_copy_(0, rows, w)
        st["moments"].index_copy_(0, slots, mv)
        st["steps"].index_copy_(0, slots, t)

    def _assign_slots(self, st: dict, rows: torch.Tensor) -> torch.Tensor:
        """Slots of rows [k] (unique), giving new rows the next free slots."""
        slots = st["slot"].index_select(0, rows).long()  # [k]
        new = slots < 0
        n_new = int(new.sum())
        if n_new:
            n = st["n"]
            if n + n_new > st["rows"].shape[0]:
                # Doubling: amortised O(1) copies per new row.
                # (Never past the table's rows: there is no more to hold.)
                _resize(st, st["exp_avg"].shape[1], min(max(2 * st["rows"].shape[0], n + n_new),
                                                        st["slot"].shape[0]), rows.device)
            fresh = torch.arange(n, n + n_new, device=rows.device)  # [k_new]
            new_rows = rows[new]
            st["slot"].index_copy_(0, new_rows, fresh.int())
            st["rows"][n:n + n_new] = new_rows
            slots[new] = fresh
            st["n"] = n + n_new
        return slots

    # -- inspection (tests, debugging) ------------------------------------------------------------
    def touched_rows(self, param: torch.Tensor) -> torch.Tensor:
        """Sorted ids of the rows that have optimiser state (every row ever in a gradient)."""
        st = self.state.get(param)
        if not st:
            return torch.empty(0, dtype=torch.long, device=param.device)
        return st["rows"][:st["n"]].sort().values

    def row_state(self, param: torch.Tensor, rows: torch.Tensor):
        """(exp_avg [k, e], exp_avg_sq [k, e], steps [k]) of rows [k]; zeros for untouched rows."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=param.device)
        k, e = rows.numel(), param.shape[1]
        st = self.state.get(param)
        m = torch.zeros(k, e, device=param.device)
        v, t = torch.zeros_like(m), torch.zeros(k, dtype=torch.long, device=param.device)
        if st:
            slots = st["slot"].index_select(0, rows).long()
            hit = slots >= 0
            m[hit] = st["exp_avg"][slots[hit]]
            v[hit] = st["exp_avg_sq"][slots[hit]]
            t[hit] = st["steps"][slots[hit]]
        return m, v, t

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Torch's layout; each table's state is compact tensors of its n touched rows only.

        Per table: ``rows`` [n] int64, ``exp_avg`` / ``exp_avg_sq`` [n, e] float32, ``steps`` [n]
        int64 (plain contiguous tensors, so they also fit a safetensors file). No slot map: it is
        rebuilt on load from ``rows``.
        """
        sd = super().state_dict()
        packed = {}
        for i, st in sd["state"].items():
            if not st:  # an empty entry left by a read of the defaultdict
                continue
            n = st["n"]
            # clone: a slice would drag the whole capacity-sized storage into torch.save.
            packed[i] = {k: st[k][:n].clone() for k in ("rows", "exp_avg", "exp_avg_sq", "steps")}
        sd["state"] = packed
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        # Let torch restore the groups but not the state: its loader would cast our float32 moments
        # to a bfloat16 table's dtype.
        super().load_state_dict({**state_dict, "state": {}})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved:
                self.state[p] = self._unpack(p, saved[i])

    def _unpack(self, p: torch.Tensor, s: dict) -> dict:
        rows = s["rows"].to(p.device, torch.long, copy=True)  # [n]
        n = rows.numel()
        if s["exp_avg"].shape != (n, p.shape[1]) or (n and int(rows.max()) >= p.shape[0]):
            raise ValueError(f"saved RowAdam state ({n} rows, moments {tuple(s['exp_avg'].shape)})"
                             f" does not fit a {tuple(p.shape)} table")
        moments = torch.stack([s["exp_avg"], s["exp_avg_sq"]], 1).to(p.device, torch.float32)
        steps = s["steps"].to(p.device, torch.long, copy=True)
        st = {"slot": _slot_map(p), "n": n, "rows": rows, "moments": moments,
              "exp_avg": moments[:, 0], "exp_avg_sq": moments[:, 1], "steps": steps,
              "t_max": int(steps.max()) if n else 0}
        st["slot"][rows] = torch.arange(n, dtype=torch.int32, device=p.device)
        return st


def _check_group(group: dict) -> None:
    if group.get("weight_decay", 0.0) != 0:
        raise ValueError(f"RowAdam takes no weight decay (paper: tables train without it), got "
                         f"weight_decay={group['weight_decay']}")


def _slot_map(p: torch.Tensor) -> torch.Tensor:
    if p.dim() != 2:
        raise ValueError(f"RowAdam updates rows of a 2-D table, got shape {tuple(p.shape)}")
    if p.shape[0] > _INT32_MAX:
        raise ValueError(f"a table of {p.shape[0]} rows overflows the int32 slot map")
    # The only O(r) allocation, once per table: 4 bytes a row, where dense moments cost 8 bytes a
    # row *per element*.
    return torch.full((p.shape[0],), -1, dtype=torch.int32, device=p.device)  # [r]


def _bias_tables(st: dict, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1 / (1 - beta1^t) [T] float64 and sqrt(1 - beta2^t) [T] float32 for t < T, T > every row's
    step: the twin's per-row bias corrections by the same torch ops (``lr / x`` is
    ``x.reciprocal() * lr`` in torch), computed once per doubling of T."""
    cached = st.get("bias")
    if cached is None or cached[0] != (beta1, beta2) or cached[1].shape[0] <= st["t_max"]:
        td = torch.arange(2 * st["t_max"] + 64, dtype=torch.float64)  # [T]
        cached = ((beta1, beta2), (1 - beta1 ** td).reciprocal(), (1 - beta2 ** td).sqrt().float())
        st["bias"] = cached
    return cached[1], cached[2]


def _resize(st: dict, dim: int, capacity: int, device) -> None:
    """(Re)allocate the compact buffers at ``capacity`` slots, keeping the first n."""
    # Slots past n must be zero: a fresh row starts as a fresh Adam (zero moments, zero steps).
    new = {"rows": torch.zeros(capacity, dtype=torch.long, device=device),  # [c]
           "moments": torch.zeros(capacity, 2, dim, device=device),  # [c, 2, e] float32
           "steps": torch.zeros(capacity, dtype=torch.long, device=device)}  # [c]
    n = st.get("n", 0)
    for key, t in new.items():
        if key in st:
            t[:n] = st[key][:n]
        st[key] = t
    st["exp_avg"], st["exp_avg_sq"] = st["moments"][:, 0], st["moments"][:, 1]  # [c, e] views


def clip_grad_norm_(params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, sharded: Iterable[torch.Tensor] = (),
                    sum_ranks: Callable[[list[float]], list[float]] | None = None
                    ) -> torch.Tensor | float:
    """Clip the global gradient norm over dense and sparse grads together; returns the norm.

    Sparse grads are coalesced first (a row repeated in one batch counts once, as the sum) and
    written back coalesced. On dense-only input this matches ``torch.nn.utils.clip_grad_norm_``.

    Data parallel (``sum_ranks``, a collective summing floats over the ranks; 2-norm only): the
    grads of ``sharded`` parameters are this rank's rows of a table, so their squared norm is summed
    over the ranks; the others are replicated (equal on every rank after DDP's average). The
    squares are float64 scalars there, so one all-reduce of one number serves the whole clip.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if sum_ranks is not None:
        return _clip_across_ranks(params, max_norm, {id(p) for p in sharded}, sum_ranks)
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = sparse_rows.coalesce_rows(p.grad)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g.values() if g.is_sparse else g, norm_type) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([x.to(grads[0].device) for x in norms]), norm_type)
    # Same 1e-6 guard and clamp as torch, so dense results agree bit for bit.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        # A sparse grad's values are scaled in place, so it stays flagged coalesced and RowAdam's
        # coalesce() is free (Tensor.mul_ on a sparse tensor drops the flag: a second sort).
        (g._values() if g.is_sparse else g).mul_(coef.to(g.device))
    return total


def _clip_across_ranks(params: list[torch.Tensor], max_norm: float, sharded: set[int],
                       sum_ranks: Callable[[list[float]], list[float]]) -> float:
    dense_sq = shard_sq = 0.0
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = sparse_rows.coalesce(p.grad)  # a row asked for by several ranks: summed
        g = p.grad.values() if p.grad.is_sparse else p.grad
        sq = float(torch.linalg.vector_norm(g.float()) ** 2)
        if id(p) in sharded:
            shard_sq += sq
        else:
            dense_sq += sq
        grads.append(p.grad)
    total = (dense_sq + sum_ranks([shard_sq])[0]) ** 0.5
    coef = min(max_norm / (total + 1e-6), 1.0)  # the same guard and clamp as torch
    for g in grads:
        g.mul_(coef)
    return total


class Optimizers:
    """AdamW for the dense parameters and RowAdam for the tables, stepped together; ``scaler``:
    fp16's loss scale (training/precision.py), None otherwise."""

    def __init__(self, dense: torch.optim.Optimizer | None, tables: RowAdam | None,
                 table_lr_mult: float = 5.0, scaler: LossScaler | None = None):
        self.dense, self.tables, self.table_lr_mult = dense, tables, float(table_lr_mult)
        self.scaler = scaler

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimisers that exist (a model may have no tables, or only tables)."""
        return [o for o in (self.dense, self.tables) if o is not None]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def set_lr(self, base_lr: float) -> None:
        """Dense groups take base_lr; table groups take table_lr_mult * base_lr (paper: 5x)."""
        for g in self.dense.param_groups if self.dense is not None else []:
            g["lr"] = base_lr
        for g in self.tables.param_groups if self.tables is not None else []:
            g["lr"] = base_lr * self.table_lr_mult

    def state_dict(self) -> dict:
        sd = {"dense": self.dense.state_dict() if self.dense is not None else None,
              "tables": self.tables.state_dict() if self.tables is not None else None,
              "table_lr_mult": self.table_lr_mult}
        if self.scaler is not None:  # fp16 only: other runs' checkpoints stay as they were
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for name in ("dense", "tables"):
            if (getattr(self, name) is None) != (sd[name] is None):
                raise ValueError(f"checkpoint and optimiser disagree on having {name} parameters")
            if sd[name] is not None:
                getattr(self, name).load_state_dict(sd[name])
        self.table_lr_mult = float(sd["table_lr_mult"])
        # A run resumed in fp16 from a bf16/fp32 checkpoint starts a fresh scale; one resumed in
        # another precision drops the saved scale.
        if self.scaler is not None and "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])


def build_optimizers(model: nn.Module, lr: float, weight_decay: float = 0.1,
                     betas: tuple[float, float] = (0.9, 0.95), table_lr_mult: float = 5.0,
                     eps: float = 1e-8) -> Optimizers:
    """Split a model's trainable parameters between AdamW and RowAdam.

    - Every ``MemoryTable.weight`` -> RowAdam at ``table_lr_mult * lr``, no weight decay. The table
      must be built with ``sparse=True``.
    - Other parameters -> AdamW at ``lr``. Weight decay applies to matrices and conv kernels
      (dim >= 2) only; vectors (biases, norm gains) and ``nn.Embedding`` weights get none, as in
      GPT-2/nanoGPT practice: decaying a gain or a token row pulls it to zero, not to a prior.
      A weight tied to an embedding counts as an embedding.
    """
    tables, no_decay_ids = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, MemoryTable):
            if not mod.sparse:
                raise ValueError(f"MemoryTable {name or '<root>'!r} was built with sparse=False; "
                                 "RowAdam needs sparse row gradients: build it with sparse=True "
                                 "(build_engram(..., sparse=True))")
            if mod.weight.requires_grad and all(mod.weight is not t for t in tables):
                tables.append(mod.weight)
        elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            no_decay_ids.add(id(mod.weight))
    table_ids = {id(t) for t in tables}
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicated, so tied weights appear once
        if not p.requires_grad or id(p) in table_ids:
            continue
        (decay if p.dim() >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # fused: one kernel per step instead of ~10 elementwise passes (5x faster on CPU here).
    dense = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True) if groups else None
    row = RowAdam(tables, lr=lr * table_lr_mult, betas=betas, eps=eps) if tables else None
    return Optimizers(dense, row, table_lr_mult)
