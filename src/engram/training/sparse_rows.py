"""Fused CPU kernels for the sparse table update: coalescing a row gradient and RowAdam's step.

A training step touches ~15k scattered rows of a table (compare's shapes). PyTorch's generic CPU
kernels for that work (sparse coalesce sorts, index_select / index_copy_ per element, ~10
elementwise passes over gathered rows) cost 12-16 ms a step there, more than the Engram module's
own forward and backward; one pass per row in a compiled loop costs ~2 ms (benchmarks/train.py).
The kernels are compiled by numba on first use (cached on disk) and run on the calling thread.

Each kernel has a torch twin in optim.py, used on other devices and dtypes and by the tests as the
reference: the same arithmetic in the same order, fused multiply-adds where torch's CPU kernels
fuse them (lerp, addcmul), so the moments are the twin's to the bit; the update differs in the last
bit now and then, as torch's vectorised square root (SLEEF, within 0.5001 ulp) and the hardware's
correctly rounded one do. Coalescing sums a row's repeats in the order they come; torch's coalesce
sorts unstably, so those sums may differ in the last bit too.

Shape legend:
    r rows in the table, e row width, n entries of an uncoalesced gradient (rows may repeat),
    k unique rows, c optimiser state capacity.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import torch

# A declared dependency; without it the torch twins run, only slower.
_HAVE_NUMBA = importlib.util.find_spec("numba") is not None

# The dense scan below costs O(r); it is used while the table has at most this many rows per
# gradient entry, past that a sort (O(n log n)) is cheaper.
DENSE_SCAN_ROWS_PER_ENTRY = 32
_warned = False


def available() -> bool:
    """Whether the compiled kernels can run (numba imports)."""
    global _warned
    if not _HAVE_NUMBA and not _warned:
        warnings.warn("numba is not installed: the table update runs on torch's generic kernels "
                      "(correct, 3-5x slower)", RuntimeWarning, stacklevel=3)
        _warned = True
    return _HAVE_NUMBA


def fits(t: torch.Tensor) -> bool:
    """A tensor the kernels take: on CPU, float32, outside autograd's graph."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad


_LOW = (torch.bfloat16, torch.float16)


def _summed_in_float32(grad: torch.Tensor, coalesce) -> torch.Tensor:
    """``coalesce`` of a bfloat16/float16 gradient summed in float32, rounded once at the end:
    torch sums the repeats in the values' own dtype, and a row read at a few hundred positions
    (a frequent n-gram) then stalls (1000 repeats of 1e-3 in bfloat16 sum to 0.5)."""
    wide = coalesce(torch.sparse_coo_tensor(grad._indices(), grad._values().float(), grad.shape,
                                            check_invariants=False))
    return torch.sparse_coo_tensor(wide._indices(), wide._values().to(grad.dtype), grad.shape,
                                   is_coalesced=True, check_invariants=False)


def coalesce(grad: torch.Tensor) -> torch.Tensor:
    """``grad.coalesce()``, with bfloat16/float16 repeats summed in float32."""
    if grad.dtype in _LOW and not grad.is_coalesced():
        return _summed_in_float32(grad, torch.Tensor.coalesce)
    return grad.coalesce()


def coalesce_rows(grad: torch.Tensor) -> torch.Tensor:
    """A row-sparse COO gradient [r, e] with each row once: sorted rows, duplicates summed in the
    order they appear (in float32 for bfloat16/float16 values), flagged coalesced. Same result as
    ``grad.coalesce()`` up to the order of the sums (torch's sort is not stable)."""
    if grad.is_coalesced():
        return grad
    if grad.dtype in _LOW:
        return _summed_in_float32(grad, coalesce_rows)
    idx, vals = grad._indices(), grad._values()  # [1, n], [n, e]
    n, r = vals.shape[0], grad.shape[0]
    if (grad.sparse_dim() != 1 or vals.dim() != 2 or not fits(vals) or n == 0
            or r > DENSE_SCAN_ROWS_PER_ENTRY * n or not available()):
        return grad.coalesce()
    idx, vals = idx[0].contiguous(), vals.contiguous()
    lo, hi = torch.aminmax(idx)
    if lo < 0 or hi >= r:  # the kernel writes where the ids point: refuse before it runs
        raise ValueError(f"sparse gradient has row ids in [{int(lo)}, {int(hi)}], outside the "
                         f"table's {r} rows")
    rows = torch.empty(n, dtype=torch.long)  # [n], first k used
    sums = torch.empty_like(vals)  # [n, e], first k used
    k = _kernels().coalesce(idx.numpy(), vals.numpy(), rows.numpy(), sums.numpy(), r)
    return torch.sparse_coo_tensor(rows[:k].unsqueeze(0), sums[:k], grad.shape, is_coalesced=True,
                                   check_invariants=False)  # sorted and unique by construction


def adam_rows(param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, slots: torch.Tensor,
              moments: torch.Tensor, steps: torch.Tensor, lr: float, beta1: float, beta2: float,
              eps: float, bias1_inv: torch.Tensor, bias2_sqrt: torch.Tensor) -> None:
    """RowAdam's update in place, one pass per row: param [r, e] rows [k] (unique) take grad [k, e]
    with state moments [c, 2, e] (exp_avg, exp_avg_sq) and steps [c] at slots [k].

    bias1_inv [T] float64 holds 1 / (1 - beta1^t) and bias2_sqrt [T] float32 sqrt(1 - beta2^t),
    computed by torch as the twin computes them; T must exceed every row's new step count.
    """
    _kernels().adam(param.numpy(), rows.numpy(), grad.numpy(), slots.numpy(), moments.numpy(),
                    steps.numpy(), float(lr), np.float32(1 - beta1), np.float32(beta2),
                    np.float32(1 - beta2), np.float32(eps), bias1_inv.numpy(), bias2_sqrt.numpy())


def _kernels():
    """The compiled kernels (training/row_kernels.py), imported on first use: importing numba and
    loading its cache costs ~1 s, which a run without tables should not pay."""
    from . import row_kernels

    return row_kernels
