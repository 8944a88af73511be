"""The compiled sparse-row kernels against their torch twins: coalescing a row gradient, and
RowAdam's step (moments bit for bit; weights to the last bit: torch's vectorised sqrt is SLEEF's)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.training import sparse_rows
from engram.training.row_optim import RowAdam

pytestmark = pytest.mark.skipif(not sparse_rows.available(), reason="numba is not installed")


def row_grad(ids: torch.Tensor, e: int, rows: int, seed: int = 0) -> torch.Tensor:
    """The uncoalesced sparse gradient F.embedding(sparse=True) makes for ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.sparse_coo_tensor(ids.view(1, -1), torch.randn(ids.numel(), e, generator=g),
                                   (rows, e), check_invariants=False)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49), min_size=1, max_size=80), e=st.integers(1, 9))
def test_coalesce_rows_equals_torch_coalesce(ids, e):
    grad = row_grad(torch.tensor(ids), e, 50)
    ours, ref = sparse_rows.coalesce_rows(grad), grad.coalesce()
    assert ours.is_coalesced()
    assert torch.equal(ours.indices(), ref.indices())
    # torch sums a row's repeats in the order of an unstable sort, we in index order
    torch.testing.assert_close(ours.values(), ref.values(), rtol=1e-6, atol=1e-6)
    assert torch.equal(ours.to_dense(), torch.zeros(50, e).index_add_(0, torch.tensor(ids),
                                                                        grad._values()))


def test_coalesce_rows_falls_back_where_the_kernel_does_not_apply():
    ids = torch.tensor([5, 3, 5, 0])
    # a table far larger than the gradient (a sort beats the O(rows) scan), bfloat16, coalesced
    for grad in (row_grad(ids, 4, 10_000), row_grad(ids, 4, 10).bfloat16()):
        ours = sparse_rows.coalesce_rows(grad)
        assert ours.is_coalesced() and torch.equal(ours.to_dense(), grad.coalesce().to_dense())
    done = row_grad(ids, 4, 10).coalesce()
    assert sparse_rows.coalesce_rows(done) is done
    bad = torch.sparse_coo_tensor(torch.tensor([[3, 12]]), torch.ones(2, 4), (10, 4),
                                  check_invariants=False)  # F.embedding never makes these
    with pytest.raises(ValueError, match="outside the table's 10 rows"):
        sparse_rows.coalesce_rows(bad)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 4), (10, 4),
                                    check_invariants=False)
    assert sparse_rows.coalesce_rows(empty)._nnz() == 0


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.3, 0.999)])  # both branches of torch's lerp
def test_row_adam_kernel_equals_its_torch_twin(betas):
    torch.manual_seed(0)
    rows, e = 300, 16
    w0 = torch.randn(rows, e)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    fast = RowAdam([a], lr=0.01, betas=betas)
    twin = RowAdam([b], lr=0.01, betas=betas, kernels=False)
    for step in range(12):  # rows come and go; some rows' first step comes late
        ids = torch.randint(0, 40 + 20 * step, (200,))
        grad = row_grad(ids, e, rows, seed=step).coalesce()  # one coalesce for both
        for p, opt in ((a, fast), (b, twin)):
            p.grad = grad.clone()
            for group in opt.param_groups:
                group["lr"] = 0.01 * (1 + step) / 12  # a schedule, as training sets it
            opt.step()
    assert fast.kernel_steps == 12 and twin.kernel_steps == 0  # each took its own path
    ma, va, ta = fast.row_state(a, torch.arange(rows))
    mb, vb, tb = twin.row_state(b, torch.arange(rows))
    assert torch.equal(ma, mb) and torch.equal(va, vb) and torch.equal(ta, tb)
    assert not torch.equal(a, w0)
    # a last-bit difference in one step's update, never more
    torch.testing.assert_close(a, b, rtol=2e-7, atol=2e-7)


def test_row_adam_kernel_resumes_from_a_state_dict():
    """A loaded state knows its rows' step counts, so the kernel's bias tables cover them."""
    torch.manual_seed(1)
    w0 = torch.randn(50, 8)
    grads = [row_grad(torch.randint(0, 50, (30,)), 8, 50, seed=s).coalesce() for s in range(6)]
    full = torch.nn.Parameter(w0.clone())
    opt = RowAdam([full], lr=0.05)
    for g in grads:
        full.grad = g.clone()
        opt.step()
    first = torch.nn.Parameter(w0.clone())
    opt1 = RowAdam([first], lr=0.05)
    for g in grads[:3]:
        first.grad = g.clone()
        opt1.step()
    resumed = torch.nn.Parameter(first.detach().clone())
    opt2 = RowAdam([resumed], lr=0.05)
    opt2.load_state_dict(opt1.state_dict())
    for g in grads[3:]:
        resumed.grad = g.clone()
        opt2.step()
    assert opt2.kernel_steps == 3
    assert torch.equal(resumed, full)


def test_kernels_refuse_tensors_off_the_cpu():
    """A table on CUDA (meta here: no GPU in CI) must take the torch twin: the kernels read
    tensors through .numpy()."""
    for t in (torch.zeros(4, 2, device="meta"), torch.zeros(4, 2).bfloat16(),
              torch.zeros(4, 2, requires_grad=True)):
        assert not sparse_rows.fits(t)
    assert sparse_rows.fits(torch.zeros(4, 2))
