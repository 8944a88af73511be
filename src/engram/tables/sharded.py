"""A table sharded by row over torch.distributed: each rank holds a contiguous slice of the rows.

Paper (spec section 4): across devices the tables are sharded by row and only the active rows move,
with all-to-all. A lookup is a collective: every rank of the group calls ``lookup`` the same number
of times in the same order (a rank with nothing to read passes an empty tensor).

    forward   rows -> unique ids + inverse -> bucket by owner -> all-to-all counts, then ids
              -> owner gathers its local rows -> all-to-all rows back -> scatter via the inverse
    backward  sum the position grads per unique id -> all-to-all them to the owner -> the owner's
              shard weight gets a sparse COO grad over its local rows (the table optimiser, e.g.
              RowAdam, applies it unchanged)

Why contiguous ranges rather than row % world: hash ids are uniform inside each head's prime-sized
range and every head is read once per token, so equal-sized ranges already balance the traffic; in
exchange, (1) the sorted unique ids are already grouped by owner (no permutation), (2) a shard is
one slice of the table, so saving, resharding to another world size and loading from a file are
slice reads, not strided gathers.

The backward sums over ranks: the shard's grad is d(sum over ranks of each rank's loss). Data
parallel training (DDP) averages dense grads instead, so the trainer scales table grads by 1/world.

Shape legend: r rows in the table, e row width, w world size, n looked-up positions (flattened),
u unique ids on this rank, s ids other ranks (and this one) asked this rank for, l local rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..files import publish

_INIT_BLOCK = 4096  # rows per init block: shard inits do not depend on the world size


def shard_bounds(num_rows: int, world: int) -> list[int]:
    """Rank k owns rows [b[k], b[k+1]) of b = shard_bounds(...); range sizes differ by <= 1."""
    return [k * num_rows // world for k in range(world + 1)]


def init_rows(seed: int, lo: int, hi: int, dim: int, std: float,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(0, std) rows [lo, hi) of a table whose every block of rows has its own seeded generator.

    The same rows come out whatever the range, so a table initialised at world size 2 equals the
    one at world size 3, and no rank ever materialises the whole table.
    """
    out = torch.empty(hi - lo, dim, dtype=dtype)  # [l, e]
    for b in range(lo // _INIT_BLOCK, -(-hi // _INIT_BLOCK)):
        g = torch.Generator().manual_seed((seed * 1_000_003 + b) % (2**63))
        block = torch.randn(_INIT_BLOCK, dim, generator=g).mul_(std)  # [B, e]
        a, z = max(lo, b * _INIT_BLOCK), min(hi, (b + 1) * _INIT_BLOCK)
        out[a - lo:z - lo] = block[a - b * _INIT_BLOCK:z - b * _INIT_BLOCK]
    return out


class ShardedTable(nn.Module):
    """Rows [lo, hi) of an r x e table on this rank; ``lookup`` takes global ids from any rank.

    Implements ``engram.tables.store.TableStore``. ``group`` is the process group the rows are spread
    over (None: the default group, or a single-process table when torch.distributed is not
    initialised). Give it a group of its own when DDP shares the default one: DDP's asynchronous
    all-reduces and the lookups' all-to-alls then never interleave.
    ``sparse=True`` gives the shard weight a sparse row grad (for RowAdam), False a dense one.
    Serving works the same way under ``torch.no_grad()``: every rank runs its own batch (of any
    size, possibly empty) through the model in lockstep, and each lookup fetches across ranks.
    """

    def __init__(self, num_rows: int, dim: int, *, group=None, sparse: bool = True,
                 init_std: float = 1.0, seed: int = 0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, empty: bool = False):
        super().__init__()
        if num_rows <= 0 or dim <= 0:
            raise ValueError(f"a table needs positive rows and width, got {num_rows} x {dim}")
        self.num_rows, self.dim, self.sparse, self.group = int(num_rows), int(dim), sparse, group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        if self.world > self.num_rows:
            raise ValueError(f"{self.world} ranks cannot share a table of {self.num_rows} rows")
        self.bounds = shard_bounds(self.num_rows, self.world)
        self.lo, self.hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        # ``empty``: no rows here (a subclass holds them elsewhere: training/working_table.py)
        self.weight = nn.Parameter(torch.empty(0 if empty else self.hi - self.lo, self.dim,
                                               dtype=dtype, device=device))  # [l, e]
        # Start of each rank's range, for the owner search; kept off the state dict (derived).
        self.register_buffer("starts", torch.tensor(self.bounds[:-1], device=device),
                             persistent=False)  # [w]
        if not empty:
            self.reset_parameters(init_std, seed)

    @torch.no_grad()
    def reset_parameters(self, std: float = 1.0, seed: int = 0) -> None:
        self.weight.copy_(init_rows(seed, self.lo, self.hi, self.dim, std))

    @torch.no_grad()
    def load_rows_(self, table: torch.Tensor) -> ShardedTable:
        """Copy this rank's rows out of a full table [r, e] (e.g. a MemoryTable's weight)."""
        if tuple(table.shape) != (self.num_rows, self.dim):
            raise ValueError(f"expected a {self.num_rows} x {self.dim} table, "
                             f"got {tuple(table.shape)}")
        self.weight.copy_(table[self.lo:self.hi])
        return self

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Global row ids [...] (int64) -> rows [..., e]. Collective over the group."""
        if rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise TypeError(f"row ids must be an integer tensor, got {rows.dtype}")
        flat = rows.reshape(-1).to(self.weight.device, torch.long)  # [n]
        out = _ShardedLookup.apply(self.weight, flat, self)  # [n, e]
        return out.view(*rows.shape, self.dim)

    def serve(self, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local ids [s] other ranks asked for -> (their rows [s, e], no grad; the rows of
        ``weight`` they are, where the backward sends their grads [s])."""
        return self.weight.detach().index_select(0, asked), asked

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # resident: the shard is in this process's memory

    def extra_repr(self) -> str:
        return (f"rows={self.num_rows}, dim={self.dim}, shard=[{self.lo}, {self.hi}), "
                f"rank={self.rank}/{self.world}, sparse={self.sparse}")

    # -- the exchange ------------------------------------------------------------------------------
    def _route(self, uniq: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """Sorted unique ids [u] -> (send splits [w], receive splits [w], ids asked of us [s]).

        Raises on every rank when any rank passed an id out of range: a rank that raised alone
        would leave the others waiting in the next collective until the timeout.
        """
        bad = int(uniq.numel() > 0 and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_rows))
        owner = torch.searchsorted(self.starts, uniq, right=True) - 1  # [u] sorted, like uniq
        send = torch.zeros(self.world, 2, dtype=torch.long, device=uniq.device)  # [w, (count, bad)]
        send[:, 0] = torch.bincount(owner.clamp(0, self.world - 1), minlength=self.world)
        send[:, 1] = bad
        recv = self._all_to_all(send, [1] * self.world, [1] * self.world)  # [w, 2]
        if bool(recv[:, 1].any()):
            culprits = recv[:, 1].nonzero().flatten().tolist()
            raise IndexError(f"rank(s) {culprits} looked up row ids outside [0, {self.num_rows})")
        send_splits, recv_splits = send[:, 0].tolist(), recv[:, 0].tolist()
        asked = self._all_to_all(uniq, recv_splits, send_splits)  # [s] global ids we own
        return send_splits, recv_splits, asked - self.lo

    def _all_to_all(self, x: torch.Tensor, out_splits: list[int],
                    in_splits: list[int]) -> torch.Tensor:
        """Chunks of x [sum(in_splits), ...] go to ranks 0..w-1; returns [sum(out_splits), ...]."""
        if self.world == 1:
            return x.clone()  # the caller may write into it; keep it distinct from x
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.group)
        return out


class _ShardedLookup(torch.autograd.Function):
    """weight [l, e] (this rank's shard), flat ids [n] -> rows [n, e]; grads go to the owners."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, flat: torch.Tensor, table: ShardedTable):
        # Each distinct row crosses the wire once per rank, however often the batch repeats it
        # (n-gram traffic is Zipfian, spec section 4).
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # [u], [n]
        send_splits, recv_splits, asked = table._route(uniq)
        served, asked = table.serve(asked)  # [s, e], [s] rows of weight
        got = table._all_to_all(served, send_splits, recv_splits)  # [u, e]
        ctx.table, ctx.splits, ctx.shape = table, (send_splits, recv_splits), tuple(weight.shape)
        ctx.save_for_backward(inverse, asked)
        ctx.n_uniq = uniq.numel()
        return got.index_select(0, inverse)  # [n, e]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, asked = ctx.saved_tensors
        table, (send_splits, recv_splits) = ctx.table, ctx.splits
        # Sum per unique id before sending: one row of gradient per distinct row, as in forward.
        per_id = grad.new_zeros(ctx.n_uniq, grad.shape[1]).index_add_(0, inverse, grad)  # [u, e]
        mine = table._all_to_all(per_id, recv_splits, send_splits)  # [s, e] for rows we own
        shape = ctx.shape  # [l, e]
        if table.sparse:
            # Uncoalesced: a row asked for by several ranks appears once per rank; RowAdam and
            # clip_grad_norm_ coalesce (sum) them, as they do F.embedding's per-position grads.
            g = torch.sparse_coo_tensor(asked.unsqueeze(0), mine, shape, check_invariants=False)
        else:
            g = mine.new_zeros(shape).index_add_(0, asked, mine)  # [l, e]
        return g, None, None


# -- shard files: one safetensors file per rank, readable at any other world size -----------------

def row_range(table: nn.Module) -> tuple[int, int]:
    """Global rows [lo, hi) a table module holds: a shard's slice, or all of an unsharded one."""
    if isinstance(table, ShardedTable):
        return table.lo, table.hi
    return 0, int(table.num_rows)  # a MemoryTable: the whole table, rank 0 of 1


def _param_index(opt: torch.optim.Optimizer | None, p: torch.Tensor) -> int | None:
    params = [] if opt is None else [q for g in opt.param_groups for q in g["params"]]
    return next((i for i, q in enumerate(params) if q is p), None)


def write_shard(path, tables: dict[int, nn.Module], opt: torch.optim.Optimizer | None,
                meta: dict) -> None:
    """Write this rank's rows of every table and their optimiser state to ``path``, atomically.

    Per layer L: ``L.weight`` [l, e] (rows lo..hi), and the optimiser state of the touched rows,
    sorted by *global* row id so a reader at another world size can binary-search its range:
    ``L.rows`` [k] int64 and one ``L.<key>`` [k, ...] per key of the table optimiser's
    ``ROW_STATE`` (RowAdam: ``exp_avg`` / ``exp_avg_sq`` [k, e] float32, ``steps`` [k] int64).
    """
    path = Path(path)
    tensors, ranges = {}, {}
    packed = opt.state_dict()["state"] if opt is not None else {}
    for layer, table in tables.items():
        lo, hi = row_range(table)
        ranges[str(layer)] = [lo, hi, int(table.num_rows), int(table.dim)]
        tensors[f"{layer}.weight"] = table.weight.detach().cpu().contiguous()
        if opt is None:
            continue
        st = packed.get(_param_index(opt, table.weight))
        if st is None:  # no state yet: empty arrays keep the reader uniform
            st = opt.empty_state(table.dim)
        order = (st["rows"] + lo).argsort()  # [k]
        tensors[f"{layer}.rows"] = (st["rows"] + lo)[order].cpu().contiguous()
        for key in opt.ROW_STATE:
            tensors[f"{layer}.{key}"] = st[key][order].cpu().contiguous()
    # readers see the old file or the whole new one, never a torn one
    publish(path, lambda tmp: save_file(tensors, tmp, metadata={"ranges": json.dumps(ranges),
                                                                "meta": json.dumps(meta)}))


@torch.no_grad()
def read_shards(paths: list, tables: dict[int, nn.Module],
                opt: torch.optim.Optimizer | None) -> None:
    """Fill each table's rows [lo, hi) (and their optimiser state) from shard files of any world
    size.

    Only the overlapping slices are read (safetensors slices are lazy), so a rank reads about its
    own share of the checkpoint whatever the old and new world sizes.
    """
    keys = tuple(opt.ROW_STATE) if opt is not None else ()
    pieces: dict[int, dict[str, list]] = {L: {k: [] for k in ("rows", *keys)} for L in tables}
    covered = {L: 0 for L in tables}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            ranges = json.loads(f.metadata()["ranges"])
            for layer, table in tables.items():
                if str(layer) not in ranges:
                    raise ValueError(f"{path} holds no table for Engram layer {layer}")
                lo, hi = row_range(table)
                s_lo, s_hi, rows, dim = ranges[str(layer)]
                if (rows, dim) != (table.num_rows, table.dim):
                    raise ValueError(f"{path}: layer {layer} table is {rows} x {dim}, the model's "
                                     f"is {table.num_rows} x {table.dim}")
                a, z = max(lo, s_lo), min(hi, s_hi)
                if a >= z:
                    continue
                w = f.get_slice(f"{layer}.weight")[a - s_lo:z - s_lo]  # [z-a, e]
                table.weight[a - lo:z - lo] = w.to(table.weight.dtype)
                covered[layer] += z - a
                if opt is None or f"{layer}.rows" not in f.keys():  # written with no optimiser
                    continue
                missing = [k for k in keys if f"{layer}.{k}" not in f.keys()]
                if missing:
                    raise ValueError(f"{path} holds no {'/'.join(missing)} optimiser state for "
                                     f"layer {layer}: it was written by another table optimiser")
                saved = f.get_tensor(f"{layer}.rows")  # [k] sorted global ids
                i0, i1 = (int(torch.searchsorted(saved, torch.tensor(v))) for v in (a, z))
                pieces[layer]["rows"].append(saved[i0:i1] - lo)
                for key in keys:
                    pieces[layer][key].append(f.get_slice(f"{layer}.{key}")[i0:i1])
    for layer, table in tables.items():
        lo, hi = row_range(table)
        if covered[layer] != hi - lo:
            raise ValueError(f"the shard files cover {covered[layer]} of rows [{lo}, {hi}) of "
                             f"layer {layer}'s table: a shard is missing")
    if opt is None:
        return
    sd = opt.state_dict()
    sd["state"] = {}
    for layer, table in tables.items():
        i = _param_index(opt, table.weight)
        if i is not None and sum(len(r) for r in pieces[layer]["rows"]):  # else: a fresh table
            sd["state"][i] = {k: torch.cat(v) for k, v in pieces[layer].items()}
    opt.load_state_dict(sd)
