"""The numba kernels behind training/sparse_rows.py (see there); compiled on first call, cached on
disk next to this file (or in numba's user cache where that is read-only; with neither, compiled
again in each process, ~1 s).

Shape legend:
    r rows in the table, e row width, n entries of an uncoalesced gradient (rows may repeat),
    k unique rows, c optimiser state capacity.
"""

from __future__ import annotations

import numpy as np

from ..compute.jit import fma, kernel


@kernel()
def coalesce(idx, vals, rows, sums, r):
    """idx [n] in [0, r), vals [n, e] -> sorted unique rows into rows[:k], their summed values into
    sums[:k]; returns k. O(n e + r): a scan over the table's rows does the sorting."""
    n, e = vals.shape
    pos = np.full(r, -1, np.int64)  # [r]: row -> its place among the sorted unique rows
    for i in range(n):
        pos[idx[i]] = 0
    k = 0
    for row in range(r):
        if pos[row] == 0:
            pos[row] = k
            rows[k] = row
            k += 1
    sums[:k] = 0
    for i in range(n):  # in index order, so the sums are deterministic
        j = pos[idx[i]]
        for c in range(e):
            sums[j, c] += vals[i, c]
    return k


@kernel()
def adam(p, rows, g, slots, mom, steps, lr, w1, b2, c2, eps, bias1_inv, bias2_sqrt):
    """RowAdam's step for rows [k] of p [r, e] with grads g [k, e], state mom [c, 2, e], steps [c]
    at slots [k]: the torch twin's ops (row_optim.RowAdam._update) fused into one pass per row."""
    k, e = g.shape
    # torch's lerp, exact at both ends of the weight: start + w (end - start) for w < 0.5,
    # else end + (w - 1)(end - start)
    small = w1 < 0.5
    coeff = w1 if small else w1 - np.float32(1.0)
    for j in range(k):
        s, row = slots[j], rows[j]
        t = steps[s] + 1
        steps[s] = t
        # lr / (1 - beta1^t) in float64, then float32; torch computes float / tensor as
        # tensor.reciprocal() * float
        step_size = np.float32(bias1_inv[t] * lr)
        bc2 = bias2_sqrt[t]
        m, v, w, gj = mom[s, 0], mom[s, 1], p[row], g[j]
        for c in range(e):
            m[c] = fma(coeff, gj[c] - m[c], m[c] if small else gj[c])  # m.lerp_(g, 1 - beta1)
            v[c] = fma(c2 * gj[c], gj[c], v[c] * b2)  # v.mul_(beta2).addcmul_(g, g, 1 - beta2)
            w[c] = w[c] - (m[c] * step_size) / (np.sqrt(v[c]) / bc2 + eps)
