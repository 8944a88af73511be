"""ShardedTable against the oracle, the single-process MemoryTable (the in-memory store).

Real gloo process groups on loopback (2 and 3 processes). Upstream grads are small integers, so
sums are exact in float32 whatever order the ranks add them in, and "equal" means bit for bit.
"""

import pytest
import torch
import torch.distributed as dist

from engram.tables.sharded import ShardedTable, init_rows, read_shards, shard_bounds, write_shard
from engram.tables.store import MemoryTable, TableStore
from engram.training.row_optim import RowAdam
from engram.training.process_group import init_distributed, spawn_local

R, E = 101, 8  # prime rows: the shards are uneven (101 = 33 + 34 + 34)


def _rows(case: str, rank: int, world: int) -> torch.Tensor:
    """Each rank's row ids; every rank can rebuild every other rank's (for the oracle)."""
    g = torch.Generator().manual_seed(1000 * rank + len(case))
    if case == "random":  # duplicates within and across ranks
        return torch.randint(0, R, (2, 5, 3), generator=g)
    if case == "skewed":  # all traffic to rank 0's shard, repeated ids; the last rank asks nothing
        if rank == world - 1:
            return torch.zeros(0, 3, dtype=torch.long)
        return torch.randint(0, 6, (4, 3), generator=g)
    raise ValueError(case)


def _grad(rows: torch.Tensor, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(-4, 5, (*rows.shape, E), generator=g).float()


def _check_group(group, tmp: str) -> None:
    """Every check, over the ranks of ``group`` (all of them call this)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    full = MemoryTable(R, E, sparse=True)  # same rows on every rank
    for sparse in (True, False):
        for case in ("random", "skewed"):
            shard = ShardedTable(R, E, group=group, sparse=sparse).load_rows_(full.weight.detach())
            assert (shard.lo, shard.hi) == tuple(shard_bounds(R, world)[rank:rank + 2])
            rows = _rows(case, rank, world)
            out = shard.lookup(rows)
            assert torch.equal(out, full.weight.detach()[rows]), case
            out.backward(_grad(rows, rank))
            # Oracle: the whole table's grad from every rank's rows and upstream grads.
            oracle = torch.zeros(R, E)
            for k in range(world):
                rk = _rows(case, k, world)
                oracle.index_add_(0, rk.flatten(), _grad(rk, k).reshape(-1, E))
            grad = shard.weight.grad
            assert grad.is_sparse == sparse
            got = grad.coalesce().to_dense() if sparse else grad
            assert torch.equal(got, oracle[shard.lo:shard.hi]), (case, sparse)
    # RowAdam on the shard == RowAdam on the whole table, restricted to the shard's rows.
    shard = ShardedTable(R, E, group=group).load_rows_(full.weight.detach())
    whole = torch.nn.Parameter(full.weight.detach().clone())
    opt_s, opt_w = RowAdam([shard.weight], lr=0.1), RowAdam([whole], lr=0.1)
    for step in range(2):
        rows = _rows("random", rank, world) + step
        shard.lookup(rows.clamp_max(R - 1)).backward(_grad(rows, rank))
        acc = torch.zeros(R, E)
        for k in range(world):
            rk = (_rows("random", k, world) + step).clamp_max(R - 1)
            acc.index_add_(0, rk.flatten(), _grad(rk, k).reshape(-1, E))
        hit = acc.abs().sum(1) > 0
        idx = hit.nonzero().flatten()
        whole.grad = torch.sparse_coo_tensor(idx.unsqueeze(0), acc[idx], (R, E),
                                             check_invariants=True)
        opt_s.step(), opt_w.step()
        opt_s.zero_grad(), opt_w.zero_grad()
    assert torch.equal(shard.weight.detach(), whole.detach()[shard.lo:shard.hi])
    # Batched inference: no grad, ranks with different batch sizes, one with none.
    with torch.no_grad():
        rows = torch.randint(0, R, (rank * 3, 4))
        assert torch.equal(shard.lookup(rows), whole.detach()[rows])
    # A bad id on one rank raises on every rank (nobody is left waiting), and the group survives.
    bad = torch.tensor([R]) if rank == 1 else torch.tensor([0])
    with pytest.raises(IndexError, match=r"rank\(s\) \[1\]"):
        shard.lookup(bad)
    assert torch.equal(shard.lookup(torch.tensor([R - 1])), whole.detach()[[R - 1]])
    # Shard files written at this world size read back into one whole table (resharding to 1).
    write_shard(f"{tmp}/s{rank}.safetensors", {0: shard}, opt_s, {"rank": rank})
    dist.barrier(group=group)
    one = MemoryTable(R, E, sparse=True)
    opt_one = RowAdam([one.weight], lr=0.1)
    read_shards([f"{tmp}/s{k}.safetensors" for k in range(world)], {0: one}, opt_one)
    assert torch.equal(one.weight.detach(), whole.detach())
    assert torch.equal(opt_one.touched_rows(one.weight), opt_w.touched_rows(whole))
    every = torch.arange(R)
    for a, b in zip(opt_one.row_state(one.weight, every), opt_w.row_state(whole, every)):
        assert torch.equal(a, b)


def _check_worlds_2_and_3(tmp: str) -> None:
    d = init_distributed(timeout_s=30)
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1], backend="gloo")  # world size 2 inside the 3-process job
    if d.rank < 2:
        _check_group(pair, f"{tmp}/w2")
    _check_group(d.tables, f"{tmp}/w3")
    dist.destroy_process_group()


def test_sharded_lookup_backward_and_adam_equal_memory_table(tmp_path):
    """World sizes 2 and 3 in one 3-process job (processes are the slow part to start)."""
    (tmp_path / "w2").mkdir(), (tmp_path / "w3").mkdir()
    spawn_local(_check_worlds_2_and_3, 3, str(tmp_path))


def test_world_size_one_without_process_group():
    torch.manual_seed(0)
    full = MemoryTable(R, E, sparse=True)
    shard = ShardedTable(R, E).load_rows_(full.weight.detach())
    assert (shard.world, shard.lo, shard.hi) == (1, 0, R)
    assert isinstance(shard, TableStore)
    rows = torch.tensor([[3, 3, 100], [0, 5, 3]])
    a, b = full.lookup(rows), shard.lookup(rows)
    assert torch.equal(a, b)
    g = _grad(rows, 0)
    a.backward(g), b.backward(g)
    assert torch.equal(full.weight.grad.coalesce().to_dense(),
                       shard.weight.grad.coalesce().to_dense())
    assert shard.lookup(torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2, E)
    with pytest.raises(IndexError):
        shard.lookup(torch.tensor([-1]))
    with pytest.raises(TypeError):
        shard.lookup(torch.tensor([1.0]))


def test_shard_init_does_not_depend_on_world_size():
    whole = init_rows(5, 0, 10_000, 4, 0.02)
    for world in (2, 3, 7):
        b = shard_bounds(10_000, world)
        parts = [init_rows(5, b[k], b[k + 1], 4, 0.02) for k in range(world)]
        assert torch.equal(torch.cat(parts), whole)
    assert abs(float(whole.std()) - 0.02) < 1e-3
    assert not torch.equal(init_rows(6, 0, 10, 4, 1.0), init_rows(5, 0, 10, 4, 1.0))
