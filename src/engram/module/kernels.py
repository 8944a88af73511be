"""The numba kernels behind module/fused.py (see there): the gate, the short conv's norm, conv, SiLU
and residual, forward and backward, in a few parallel passes over positions.

Shape legend:
    n positions (b t), b batch, t positions per sequence, m residual branches, d hidden size,
    C = m d conv channels, K conv kernel, ctx = (K - 1) * dilation past positions of the conv.
    stats [n, m, 5]: per row rk, rh (key and hidden RMS scales), dot = <k, h w1 w2>, s (the scaled
    score), r (the conv input's RMS scale).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ..compute.jit import kernel, pow2

F32 = np.float32


@kernel()
def exp_neg(x):
    """exp(-x) in float32 to ~2 ulp, as multiply-adds (vectorises; numba's exp does not without
    Intel's SVML): Cephes' expf. Saturates: exp(-88) for x > 88 (NaN too), exp(87) for x < -87."""
    v = -x
    v = v if v > F32(-87.0) else F32(-87.0)  # a NaN fails the test: saturated, never bad bits
    v = v if v < F32(88.0) else F32(88.0)
    k = np.floor(v * F32(1.4426950408889634) + F32(0.5))  # exp(v) = 2^k exp(f), |f| <= ln(2)/2
    f = v - k * F32(0.693359375) - k * F32(-2.12194440e-4)  # ln(2) in two parts: f exact
    p = F32(1.9875691500e-4)
    p = p * f + F32(1.3981999507e-3)
    p = p * f + F32(8.3334519073e-3)
    p = p * f + F32(4.1665795894e-2)
    p = p * f + F32(1.6666665459e-1)
    p = p * f + F32(5.0000001201e-1)
    return (p * f * f + f + F32(1.0)) * pow2(np.int32(k))


@kernel()
def silu(y):
    return y / (F32(1.0) + exp_neg(y))


@kernel()
def gate_of(s, demo):
    """alpha from the score (gate.gate_fn) and d alpha / d s."""
    a_s = abs(s)
    if demo:  # signed square root (the demo), whose clamp passes no gradient below 1e-6
        z = math.sqrt(max(a_s, F32(1e-6))) * ((s > 0) - (s < 0))
    else:
        z = s
    a = F32(1.0) / (F32(1.0) + F32(math.exp(-z)))
    da = a * (F32(1.0) - a)
    if demo:
        da = da * F32(0.5) / math.sqrt(a_s) if a_s >= F32(1e-6) else F32(0.0)
    return a, da


@kernel(parallel=True)
def gate_forward(kv, h, w12, eps1, eps2, eps3, demo, conv, live, stats, alpha, out):
    """kv [n, (m+1) d] (value, keys), h [n, m, d], live [n] (0 at padding: V~ = alpha live v) ->
    stats [n, m, 5], alpha [n, m]; without the conv, out [n, m, d] = alpha live v."""
    for p in numba.prange(h.shape[0]):
        gate_row(p, kv, h, w12, eps1, eps2, eps3, demo, conv, live, stats, alpha, out)


@kernel()
def gate_row(p, kv, h, w12, eps1, eps2, eps3, demo, conv, live, stats, alpha, out):
    """gate_forward at position p (each parallel kernel calls a per-item function, which its
    serial twin calls too: the same operations in the same order, IEEE (jit.kernel), so the same
    bits, though numba compiles a copy into each caller)."""
    n, m, d = h.shape
    inv_d, inv_sqrt_d = F32(1.0 / d), F32(1.0 / math.sqrt(d))
    row, v = kv[p], kv[p, :d]  # 1-d views: numba vectorises loops over those, not over [p, c]
    sv = F32(0.0)
    for c in range(d):
        sv += v[c] * v[c]
    for i in range(m):
        k, x, w = row[(i + 1) * d:(i + 2) * d], h[p, i], w12[i]
        sk, sh, dot = F32(0.0), F32(0.0), F32(0.0)
        for c in range(d):
            sk += k[c] * k[c]
            sh += x[c] * x[c]
            dot += k[c] * x[c] * w[c]
        rk = F32(1.0) / math.sqrt(sk * inv_d + eps1)
        rh = F32(1.0) / math.sqrt(sh * inv_d + eps2)
        s = dot * rk * rh * inv_sqrt_d
        a, _ = gate_of(s, demo)
        alpha[p, i] = a
        st = stats[p, i]
        st[0], st[1], st[2], st[3] = rk, rh, dot, s
        a = a * live[p]  # V~ = alpha v, zero at padding
        # RMSNorm(alpha v) = alpha v / sqrt(alpha^2 mean(v^2) + eps): no pass of its own
        st[4] = F32(1.0) / math.sqrt(a * a * sv * inv_d + eps3) if conv else F32(0.0)
        if not conv:
            o = out[p, i]
            for c in range(d):
                o[c] = a * v[c]


@kernel()
def conv_input(kv, alpha, live, stats, nw, p, xn):
    """The conv's normalised input RMSNorm(alpha v) nw = v (alpha r) nw at flat position p into
    xn [C] (alpha times live[p]: zero at padding)."""
    m, d = nw.shape
    v = kv[p, :d]
    for i in range(m):
        ar, g, x = alpha[p, i] * live[p] * stats[p, i, 4], nw[i], xn[i * d:(i + 1) * d]
        for c in range(d):
            x[c] = v[c] * ar * g[c]


@kernel()
def pick(rows, slot, ok, zero):
    return rows[slot] if ok else zero


@kernel()
def input_row(ring, past, pos, ok, zero):
    """The conv input of sequence position pos: row pos % len(ring) of the ring, or for pos < 0
    the saved past (past [ctx, C]), read where it lies; the zero row where not ok (taps past K)."""
    if not ok:
        return zero
    return past[past.shape[0] + pos] if pos < 0 else ring[pos % ring.shape[0]]


@kernel()
def weight_rows(cw, flip, zero):
    """The conv weight's up-to-4 tap rows (cw [K, C], K <= 4), reversed with flip, zero rows
    past K: the conv's taps always sum 4 products, in registers."""
    k = cw.shape[0]
    return (pick(cw, k - 1 if flip else 0, k > 0, zero),
            pick(cw, k - 2 if flip else 1, k > 1, zero),
            pick(cw, k - 3 if flip else 2, k > 2, zero),
            pick(cw, k - 4 if flip else 3, k > 3, zero))


@kernel()
def conv_silu_grad(x0, x1, x2, x3, w0, w1, w2, w3, gout, gy):
    """gy = gout SiLU'(y), y = sum_j x_j w_j recomputed (rows [C]): the forward keeps no y."""
    for c in range(gy.shape[0]):
        y = x0[c] * w0[c] + x1[c] * w1[c] + x2[c] * w2[c] + x3[c] * w3[c]
        sg = F32(1.0) / (F32(1.0) + exp_neg(y))
        gy[c] = gout[c] * (sg * (F32(1.0) + y * (F32(1.0) - sg)))


@kernel()
def inputs_at(kv, alpha, live, stats, nw, past, base, u, ctx, dil, kernel_size, scratch, zero):
    """The conv inputs that output position u reads (positions u - ctx + j dil, j < K): computed
    into scratch [4, C], or the past's rows; zero rows past K. base: the sequence's first flat
    position."""
    rows = []
    for j in range(4):
        pos = u - ctx + j * dil
        if j < kernel_size and pos >= 0:
            conv_input(kv, alpha, live, stats, nw, base + pos, scratch[j])
            rows.append(scratch[j])
        else:
            rows.append(input_row(scratch, past, pos, j < kernel_size, zero))
    return rows[0], rows[1], rows[2], rows[3]


@kernel(parallel=True)
def conv_forward(kv, alpha, live, stats, nw, cw, past, dil, t, chunk, out, full):
    """out [n, m, d] = alpha v + SiLU(y), y the depthwise causal conv (cw [K, C], K <= 4) of the
    normalised input, past [b, ctx, C] before t = 0; full [b, ctx + t, C] (if it has b rows) gets
    every position's input behind the past (the caller copies the past in: numba's copy of a 2-d
    slice is element by element). y is not kept: the backward recomputes it.

    Work items are chunks of one sequence's positions; each keeps the last ctx + 1 inputs in a
    ring of rows and sums the taps in registers (a sum over taps through memory, one tap at a
    time, is ~4x slower: the rows fall out of L1)."""
    for item in numba.prange(out.shape[0] // t * ((t + chunk - 1) // chunk)):
        conv_item(item, kv, alpha, live, stats, nw, cw, past, dil, t, chunk, out, full)


@kernel()
def conv_item(item, kv, alpha, live, stats, nw, cw, past, dil, t, chunk, out, full):
    """conv_forward's work item."""
    n, m, d = out.shape
    b, kernel_size, ctx, ch = n // t, cw.shape[0], past.shape[1], m * d
    rows = ctx + 1
    per_seq = (t + chunk - 1) // chunk
    zero = np.zeros(ch, F32)
    w0, w1, w2, w3 = weight_rows(cw, False, zero)
    bi, s = item // per_seq, (item % per_seq) * chunk
    pb = past[bi]  # [ctx, C]: read in place, not copied into the ring (a decode step's cost)
    ring = np.empty((rows, ch), F32)  # the input at sequence position u >= 0 in row u % rows
    for u in range(max(0, s - ctx), s):
        conv_input(kv, alpha, live, stats, nw, bi * t + u, ring[u % rows])
    for ti in range(s, min(t, s + chunk)):
        p = bi * t + ti
        conv_input(kv, alpha, live, stats, nw, p, ring[ti % rows])
        if full.shape[0] == b:
            full[bi, ti + ctx] = ring[ti % rows]
        # tap j reads sequence position ti - ctx + j dil
        u0 = ti - ctx
        x0 = input_row(ring, pb, u0, kernel_size > 0, zero)
        x1 = input_row(ring, pb, u0 + dil, kernel_size > 1, zero)
        x2 = input_row(ring, pb, u0 + 2 * dil, kernel_size > 2, zero)
        x3 = input_row(ring, pb, u0 + 3 * dil, kernel_size > 3, zero)
        v = kv[p, :d]
        for i in range(m):
            lo, hi = i * d, (i + 1) * d
            a0, a1, a2, a3 = x0[lo:hi], x1[lo:hi], x2[lo:hi], x3[lo:hi]
            b0, b1, b2, b3 = w0[lo:hi], w1[lo:hi], w2[lo:hi], w3[lo:hi]
            o, a = out[p, i], alpha[p, i] * live[p]
            for c in range(d):
                y = a0[c] * b0[c] + a1[c] * b1[c] + a2[c] * b2[c] + a3[c] * b3[c]
                o[c] = a * v[c] + silu(y)


@kernel(parallel=True)
def backward(kv, h, w12, nw, cw, past, gout, galpha, stats, alpha, live, demo, conv, dil, t,
             chunk, gkv, gh, acc_w12, acc_nw, acc_cw):
    """The gradients of gate_forward + conv_forward (+ the residual) from gout [n, m, d] (and
    galpha [n, m]): gkv [n, (m+1) d], gh [n, m, d], and per work item the weight gradients'
    partial sums acc_w12 (of w1 w2), acc_nw [items, m, d], acc_cw [items, K, C] (zeroed by the
    caller). Work items as conv_forward's, walking their positions backwards: the input at tau fed
    the outputs at tau + (K-1-j) dil, so its gradient is the flipped kernel over a ring of SiLU'
    gout rows (zeros past t). Fixed items: the same bits on any thread count."""
    for item in numba.prange(acc_w12.shape[0]):
        backward_item(item, kv, h, w12, nw, cw, past, gout, galpha, stats, alpha, live, demo,
                      conv, dil, t, chunk, gkv, gh, acc_w12, acc_nw, acc_cw)


@kernel()
def backward_item(item, kv, h, w12, nw, cw, past, gout, galpha, stats, alpha, live, demo,
                  conv, dil, t, chunk, gkv, gh, acc_w12, acc_nw, acc_cw):
    """backward's work item."""
    n, m, d = h.shape
    kernel_size, ctx, ch = cw.shape[0], past.shape[1], m * d
    rows = ctx + 1
    per_seq = (t + chunk - 1) // chunk
    inv_d, inv_sqrt_d = F32(1.0 / d), F32(1.0 / math.sqrt(d))
    zero = np.zeros(ch, F32)
    w0, w1, w2, w3 = weight_rows(cw, False, zero)
    f0, f1, f2, f3 = weight_rows(cw, True, zero)
    bi, s = item // per_seq, (item % per_seq) * chunk
    e = min(t, s + chunk)
    ring = np.zeros((rows, ch), F32)  # SiLU' gout at position u in row u % rows
    xring = np.empty((rows, ch), F32)  # the conv inputs of positions ti - ctx .. ti, likewise
    gxn = np.empty(ch, F32)  # the conv input's gradient at this position
    gu = np.empty(d, F32)
    aw12, anw, acw = acc_w12[item], acc_nw[item], acc_cw[item]
    if conv:
        scratch = np.empty((4, ch), F32)
        for u in range(e, min(t, e + ctx)):  # the next item's first rows, recomputed
            x0, x1, x2, x3 = inputs_at(kv, alpha, live, stats, nw, past[bi], bi * t, u, ctx,
                                       dil, kernel_size, scratch, zero)
            conv_silu_grad(x0, x1, x2, x3, w0, w1, w2, w3, gout[bi * t + u].reshape(ch),
                           ring[u % rows])
        for u in range(max(0, e - ctx), e):
            conv_input(kv, alpha, live, stats, nw, bi * t + u, xring[u % rows])
    for ti in range(e - 1, s - 1, -1):
        p = bi * t + ti
        row, v, grow = kv[p], kv[p, :d], gkv[p]
        if conv:
            if ti >= ctx:
                conv_input(kv, alpha, live, stats, nw, p - ctx, xring[(ti - ctx) % rows])
            u0, pb = ti - ctx, past[bi]
            x0 = input_row(xring, pb, u0, kernel_size > 0, zero)
            x1 = input_row(xring, pb, u0 + dil, kernel_size > 1, zero)
            x2 = input_row(xring, pb, u0 + 2 * dil, kernel_size > 2, zero)
            x3 = input_row(xring, pb, u0 + 3 * dil, kernel_size > 3, zero)
            gy = ring[ti % rows]
            conv_silu_grad(x0, x1, x2, x3, w0, w1, w2, w3, gout[p].reshape(ch), gy)
            # the flipped kernel: position ti + k dil gets tap K-1-k's weight
            g0 = pick(ring, ti % rows, kernel_size > 0, zero)
            g1 = pick(ring, (ti + dil) % rows, kernel_size > 1, zero)
            g2 = pick(ring, (ti + 2 * dil) % rows, kernel_size > 2, zero)
            g3 = pick(ring, (ti + 3 * dil) % rows, kernel_size > 3, zero)
            for c in range(ch):
                gxn[c] = g0[c] * f0[c] + g1[c] * f1[c] + g2[c] * f2[c] + g3[c] * f3[c]
            for j in range(kernel_size):  # the weight's gradient: gy times the input tap j read
                aj, xn = acw[j], input_row(xring, pb, u0 + j * dil, True, zero)
                for c in range(ch):
                    aj[c] += gy[c] * xn[c]
        gv = grow[:d]  # the value's gradient, summed over branches (W_V is shared)
        gv[:] = 0
        for i in range(m):
            st = stats[p, i]
            rk, rh, dot, sc, r = st[0], st[1], st[2], st[3], st[4]
            a = alpha[p, i] * live[p]  # V~ = alpha live v
            _, da = gate_of(sc, demo)
            gav = F32(0.0)  # <dL/dV~, v>: alpha's gradient through V~, times live
            go = gout[p, i]
            if conv:
                # RMSNorm backward, x = alpha v, u = x r: gx = r gu' - r^3 <gu', x> x / d with
                # gu' = gxn nw
                gx, g_nw, a_nw = gxn[i * d:(i + 1) * d], nw[i], anw[i]
                dot_gx = F32(0.0)
                for c in range(d):
                    x = a * v[c]
                    a_nw[c] += r * gx[c] * x
                    gu[c] = gx[c] * g_nw[c]
                    dot_gx += gu[c] * x
                coef = r * r * r * dot_gx * inv_d
                for c in range(d):
                    g = r * gu[c] - coef * (a * v[c]) + go[c]  # + the residual
                    gv[c] += a * g
                    gav += g * v[c]
            else:
                for c in range(d):
                    gv[c] += a * go[c]
                    gav += go[c] * v[c]
            ga = galpha[p, i] + gav * live[p]
            # the gate: s = r_k r_h <k, h w1 w2> / sqrt(d)
            gs = ga * da * inv_sqrt_d
            gdot = gs * rk * rh
            ck = gs * dot * rh * rk * rk * rk * inv_d
            chh = gs * dot * rk * rh * rh * rh * inv_d
            k, x, w, a12 = row[(i + 1) * d:(i + 2) * d], h[p, i], w12[i], aw12[i]
            gk, ghi = grow[(i + 1) * d:(i + 2) * d], gh[p, i]
            for c in range(d):
                gk[c] = gdot * x[c] * w[c] - ck * k[c]
                ghi[c] = gdot * k[c] * w[c] - chh * x[c]
                a12[c] += gdot * k[c] * x[c]
