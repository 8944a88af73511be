"""The table optimisers: lazy row-wise updates of Engram's tables (training/optim.py pairs them with
AdamW for everything else).

Paper recipe (spec section 4): the tables take Adam at 5x the base learning rate with no weight
decay; the dense parameters take AdamW. A step touches a tiny fraction of a table's rows, so the
table update and its optimiser state are row-wise: only touched rows are read, written and given
state, and step time follows the touched rows, not the table size.

The table optimiser (``optim.TABLE_OPTIMIZERS``, ``engram train --table_optimizer``):
    adam     ``RowAdam``, the paper's: two moments per element, 8e + 16 bytes a touched row
             (twice the row itself at float32).
    adagrad  ``RowAdagrad``, one accumulator per row (DLRM / TorchRec): 12 bytes a row.
    rmsprop  ``RowRMSprop``, Adam's second moment shared by the row, no first moment:
             20 bytes a row, whatever the width.
(Plus, for all three, 4 bytes a row of the table for the slot map.)

Shape legend:
    r rows in a table, e row width, k rows in one step's gradient (after coalescing),
    n rows touched so far (rows with optimiser state), c >= n allocated state capacity.
"""

from __future__ import annotations


import torch

from . import sparse_rows

_INT32_MAX = 2**31 - 1


class RowOptimizer(torch.optim.Optimizer):
    """What every lazy table optimiser shares: sparse row gradients in, a slot per touched row.

    A row gets its state (and a slot in compact buffers) from the first step that touches it; a
    step reads and writes only the rows in its gradient. State per table: ``slot`` [r] int32 (-1 =
    never touched; index into the compact buffers), ``rows`` [c] int64 (slot -> row), one buffer
    per ``ROW_STATE`` key of c rows, ``n`` touched rows. Buffers double when full (never past the
    table's rows), so growth is amortised O(1) per new row. Parameters may be float32 or
    bfloat16/float16; the state and the update are float32.

    ``ROW_STATE``: the per-row tensors a checkpoint keeps (and table shard files, tables/sharded.py),
    name -> (dtype, whether it has a value per element [n, e] or one per row [n]).
    """

    ROW_STATE: dict[str, tuple[torch.dtype, bool]] = {}

    def __init__(self, params, defaults: dict, kernels: bool = True):
        super().__init__(params, defaults)
        self.kernels = kernels
        for group in self.param_groups:
            _check_group(group, type(self).__name__)

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            _check_group(group, type(self).__name__)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = self._row_grad(p)
                rows = g.indices()[0]  # [k]
                if not rows.numel():
                    continue
                st = self.state[p]
                if not st:
                    self._start(st, p, rows.numel())
                slots = self._assign_slots(st, rows)  # [k] int64
                self._update(p, group, st, rows, slots, g.values().float())  # grad [k, e]
        return loss

    def _update(self, p: torch.Tensor, group: dict, st: dict, rows: torch.Tensor,
                slots: torch.Tensor, grad: torch.Tensor) -> None:
        """Rows [k] of p (their state slots [k]) take one step on their gradient [k, e]."""
        raise NotImplementedError

    def _row_grad(self, p: torch.Tensor) -> torch.Tensor:
        """p's gradient as a coalesced row-sparse tensor (each row once, repeats summed)."""
        name = type(self).__name__
        if not p.grad.is_sparse:
            raise TypeError(
                f"{name} needs a sparse row gradient, got a dense one for a {tuple(p.shape)} "
                "parameter: build the table with sparse=True (MemoryTable(..., sparse=True) or "
                "build_engram(..., sparse=True)), or give this parameter to a dense optimiser")
        if p.grad.sparse_dim() != 1:
            raise ValueError(f"{name} needs a row-sparse gradient (sparse_dim 1, as F.embedding "
                             f"makes), got sparse_dim {p.grad.sparse_dim()}")
        # Duplicate row ids in one batch must be summed before the state sees them.
        return sparse_rows.coalesce_rows(p.grad) if self.kernels else sparse_rows.coalesce(p.grad)

    def _start(self, st: dict, p: torch.Tensor, k: int) -> None:
        """A table's first step (k rows): the slot map and the first buffers."""
        st.update(slot=_slot_map(p), n=0, t_max=0, dim=p.shape[1])
        self._resize(st, p.shape[1], min(max(1024, 2 * k), p.shape[0]), p.device)

    def _resize(self, st: dict, dim: int, capacity: int, device) -> None:
        """(Re)allocate the compact buffers at ``capacity`` slots, keeping the first n."""
        # Slots past n must be zero: a fresh row starts from zero state.
        new = {"rows": torch.zeros(capacity, dtype=torch.long, device=device)}  # [c]
        for key, (dtype, per_element) in self.ROW_STATE.items():
            shape = (capacity, dim) if per_element else (capacity,)
            new[key] = torch.zeros(shape, dtype=dtype, device=device)  # [c, e] or [c]
        n = st.get("n", 0)
        for key, t in new.items():
            if key in st:
                t[:n] = st[key][:n]
            st[key] = t

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
                self._resize(st, st["dim"], min(max(2 * st["rows"].shape[0], n + n_new),
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

    def state_bytes(self, param: torch.Tensor) -> dict[str, int]:
        """Bytes of ``param``'s optimiser state: ``rows`` touched, ``saved`` (what a checkpoint
        keeps: per-row state and row ids of the touched rows), ``held`` (every buffer, spare
        capacity and the slot map included)."""
        st = self.state.get(param)
        if not st:
            return {"rows": 0, "saved": 0, "held": 0}
        n = st["n"]
        saved = sum(t.nbytes for t in self._packed(st).values())
        held = sum(st[k].nbytes for k in ("slot", "rows", *self._buffers()))
        return {"rows": n, "saved": saved, "held": held}

    def _buffers(self) -> tuple[str, ...]:
        """The names of the compact state buffers (their storage, not views)."""
        return tuple(self.ROW_STATE)

    @classmethod
    def empty_state(cls, dim: int) -> dict[str, torch.Tensor]:
        """A table's saved state when no row has been touched (shard files stay uniform)."""
        out = {"rows": torch.zeros(0, dtype=torch.long)}
        for key, (dtype, per_element) in cls.ROW_STATE.items():
            out[key] = torch.zeros((0, dim) if per_element else (0,), dtype=dtype)
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def _packed(self, st: dict) -> dict[str, torch.Tensor]:
        n = st["n"]
        # clone: a slice would drag the whole capacity-sized storage into torch.save.
        return {k: st[k][:n].clone() for k in ("rows", *self.ROW_STATE)}

    def state_dict(self) -> dict:
        """Torch's layout; each table's state is compact tensors of its n touched rows only:
        ``rows`` [n] int64 and the ``ROW_STATE`` tensors (plain contiguous tensors, so they also
        fit a safetensors file). No slot map: it is rebuilt on load from ``rows``."""
        sd = super().state_dict()
        # an empty entry is one left by a read of the defaultdict
        sd["state"] = {i: self._packed(st) for i, st in sd["state"].items() if st}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        # Let torch restore the groups but not the state: its loader would cast our float32 state
        # to a bfloat16 table's dtype.
        super().load_state_dict({**state_dict, "state": {}})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved:
                keys, want = set(saved[i]), {"rows", *self.ROW_STATE}
                if keys != want:
                    raise ValueError(
                        f"saved table optimiser state holds {sorted(keys - {'rows'})}, "
                        f"{type(self).__name__} keeps {sorted(want - {'rows'})}: it was written "
                        "by another table optimiser (--table_optimizer)")
                self.state[p] = self._unpack(p, saved[i])

    def _unpack(self, p: torch.Tensor, s: dict) -> dict:
        rows = s["rows"].to(p.device, torch.long, copy=True)  # [n]
        n = rows.numel()
        for key, (dtype, per_element) in self.ROW_STATE.items():
            if tuple(s[key].shape) != ((n, p.shape[1]) if per_element else (n,)) or (
                    n and int(rows.max()) >= p.shape[0]):
                raise ValueError(f"saved {type(self).__name__} state ({n} rows, {key} "
                                 f"{tuple(s[key].shape)}) does not fit a {tuple(p.shape)} table")
        st = {"slot": _slot_map(p), "n": n, "rows": rows, "dim": p.shape[1]}
        for key, (dtype, _) in self.ROW_STATE.items():
            st[key] = s[key].to(p.device, dtype, copy=True)
        st["slot"][rows] = torch.arange(n, dtype=torch.int32, device=p.device)
        return st


class RowAdam(RowOptimizer):
    """Lazy Adam for tables whose gradient is a sparse COO tensor over rows.

    A row's moments and step count exist from the first step that touches it; a step updates only
    the rows in its gradient. Bias correction uses each row's *own* step count, so a row first seen
    at step 1000 takes the same first update as a fresh Adam (lr * sign(g)). Alternatives:

    - dense Adam (and ``torch.optim.SparseAdam``, whose state is table-shaped): moments of table
      shape, 2x the table in memory, O(r) per step; untouched rows keep drifting on momentum.
    - lazy Adam with a global step (TF LazyAdam): a late row's first update is damped by stale bias
      correction (about 0.45 lr at betas (0.9, 0.95)) instead of lr.
    - row-wise Adagrad (DLRM/TorchRec) or a row-scalar second moment: one scalar per row, the
      smallest state (``RowAdagrad``, ``RowRMSprop``, the ``--table_optimizer``
      options), but no momentum; the paper trains tables with Adam, so Adam is the default.

    When every row is touched on every step, this is exactly ``torch.optim.Adam``.

    State per table (``RowOptimizer``'s, with): ``moments`` [c, 2, e] float32 with
    ``exp_avg`` / ``exp_avg_sq`` [c, e] its two views, ``steps`` [c] int64.

    ``kernels``: float32 tables on CPU are updated by one compiled pass per row
    (training/sparse_rows.py, 5x faster); False, other devices and bfloat16 run the torch twin
    below (the reference the kernel is tested against).
    """

    ROW_STATE = {"exp_avg": (torch.float32, True), "exp_avg_sq": (torch.float32, True),
                 "steps": (torch.int64, False)}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, kernels: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid RowAdam hyper-parameters lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay), kernels)
        self.kernel_steps = 0  # table updates done by the compiled kernel (inspection)

    # -- the step ---------------------------------------------------------------------------------
    def _update(self, p: torch.Tensor, group: dict, st: dict, rows: torch.Tensor,
                slots: torch.Tensor, grad: torch.Tensor) -> None:
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

    def _resize(self, st: dict, dim: int, capacity: int, device) -> None:
        # one [c, 2, e] buffer whose two views are the moments (one gather and one write a step)
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

    def _buffers(self) -> tuple[str, ...]:
        return ("moments", "steps")

    # -- inspection (tests, debugging) ------------------------------------------------------------
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
              "t_max": int(steps.max()) if n else 0, "dim": p.shape[1]}
        st["slot"][rows] = torch.arange(n, dtype=torch.int32, device=p.device)
        return st


class RowAdagrad(RowOptimizer):
    """Row-wise Adagrad for tables: one float32 accumulator per row, O(1) state whatever the width.

    DLRM's and TorchRec's embedding optimiser (fbgemm ``EXACT_ROWWISE_ADAGRAD``): a row keeps
    ``sum_sq``, the running sum over its steps of the *mean* squared gradient over the row, and
    steps ``w -= lr * g / (sqrt(sum_sq) + eps)``. Why one scalar per row is enough: a table row is
    read as a whole (one n-gram head), so its elements see the same tokens and gradients of one
    scale; what differs by orders of magnitude is how often rows are read (Zipfian n-grams), and a
    per-row scale captures exactly that. This is Adafactor's factoring of the second moment
    (Shazeer & Stern 2018, section 3) kept to its row factor: the column factor would be O(e) per
    table but not lazy (every step would change every row's estimate).

    Lazy and exact: an untouched row's accumulator and weights do not change, which is also what
    dense Adagrad does with a zero gradient, so this equals dense row-wise Adagrad bit for bit.
    The step size decays as 1 / sqrt(times read): frequent rows settle, rare rows keep learning.
    State: ``sum_sq`` [c] float32 (plus the slot map and ``rows``), 12 bytes a touched row.
    """

    ROW_STATE = {"sum_sq": (torch.float32, False)}

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-8, weight_decay: float = 0.0,
                 kernels: bool = True):
        if lr < 0 or eps <= 0:
            raise ValueError(f"invalid {type(self).__name__} hyper-parameters lr={lr}, eps={eps}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), kernels)

    def _update(self, p: torch.Tensor, group: dict, st: dict, rows: torch.Tensor,
                slots: torch.Tensor, grad: torch.Tensor) -> None:
        g2 = grad.square().mean(1)  # [k]
        denom = self._denominator(st, slots, g2, group)  # [k]
        mult = torch.div(group["lr"], denom).unsqueeze(1)  # [k, 1]
        w = p.index_select(0, rows)  # [k, e]
        w = (w.float() if p.dtype != torch.float32 else w).addcmul_(grad, mult, value=-1)
        p.index_copy_(0, rows, w.to(p.dtype))

    def _denominator(self, st: dict, slots: torch.Tensor, g2: torch.Tensor,
                     group: dict) -> torch.Tensor:
        """sqrt(second moment) + eps [k] of the rows at ``slots`` after this step's g2 [k]."""
        acc = st["sum_sq"].index_select(0, slots).add_(g2)  # [k]
        st["sum_sq"].index_copy_(0, slots, acc)
        return acc.sqrt_().add_(group["eps"])

    def row_state(self, param: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each ``ROW_STATE`` tensor [k] of rows [k]; zeros for untouched rows."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=param.device)
        st = self.state.get(param)
        out = {k: torch.zeros(rows.numel(), dtype=dt, device=param.device)
               for k, (dt, _) in self.ROW_STATE.items()}
        if st:
            slots = st["slot"].index_select(0, rows).long()
            hit = slots >= 0
            for k in out:
                out[k][hit] = st[k][slots[hit]]
        return out


class RowRMSprop(RowAdagrad):
    """Adam's second moment with one scalar per row and no first moment: O(1) state a row.

    A row keeps ``exp_avg_sq``, an exponential average (``beta2``) of the mean squared gradient
    over the row, and its own step count for Adam's bias correction, and steps
    ``w -= lr * g / (sqrt(exp_avg_sq / (1 - beta2^t)) + eps)``. This is Adam with beta1 = 0 and
    the row factor of Adafactor's second moment (Shazeer & Stern 2018, sections 3 and 6, which
    also drop the first moment): the step size stays about lr instead of decaying as Adagrad's
    does, as RowAdam's does. A first moment would be one value per element, O(e) a row, so there
    is none. As RowAdam, bias correction counts each row's own steps, so a row first read late
    takes a full-size first step (lr * g / rms(g)).
    State: ``exp_avg_sq`` [c] float32 and ``steps`` [c] int64, 20 bytes a touched row.
    """

    ROW_STATE = {"exp_avg_sq": (torch.float32, False), "steps": (torch.int64, False)}

    def __init__(self, params, lr: float = 1e-3, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0, kernels: bool = True):
        if not 0 <= beta2 < 1:
            raise ValueError(f"invalid RowRMSprop beta2={beta2}")
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, kernels=kernels)
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
        self.defaults["beta2"] = beta2

    def _denominator(self, st: dict, slots: torch.Tensor, g2: torch.Tensor,
                     group: dict) -> torch.Tensor:
        beta2 = group["beta2"]
        v = st["exp_avg_sq"].index_select(0, slots).mul_(beta2).add_(g2, alpha=1 - beta2)  # [k]
        t = st["steps"].index_select(0, slots) + 1  # [k]
        st["exp_avg_sq"].index_copy_(0, slots, v)
        st["steps"].index_copy_(0, slots, t)
        bc2_sqrt = (1 - beta2 ** t.double()).sqrt().float()  # [k], as RowAdam's
        return v.sqrt().div_(bc2_sqrt).add_(group["eps"])


def _check_group(group: dict, name: str = "RowAdam") -> None:
    if group.get("weight_decay", 0.0) != 0:
        raise ValueError(f"{name} takes no weight decay (paper: tables train without it), got "
                         f"weight_decay={group['weight_decay']}")


def _slot_map(p: torch.Tensor) -> torch.Tensor:
    if p.dim() != 2:
        raise ValueError(f"table optimisers update rows of a 2-D table, got shape "
                         f"{tuple(p.shape)}")
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
