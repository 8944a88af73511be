"""Prototype (not a library path): the Engram module's forward fused with numba, at the demo's
shapes, against the module and the demo port in the same run.

    python benchmarks/fused_forward.py [--json benchmarks/results/fused_forward.json]

What issue 16's forward goal (2x the demo port) would take: after the value/key GEMM, one parallel
pass per position computes the gate (key and hidden norms, the scaled dot, the demo's signed square
root and sigmoid) and the conv's normalised input (RMSNorm(alpha v) = alpha v / sqrt(alpha^2
mean(v^2) + eps), so the norm of alpha v needs no pass of its own), a second pass the dilated
depthwise conv as kernel-size multiply-adds, then torch's SiLU and the residual add. Reductions run
with fastmath (reassociated, so vectorised): results agree with the module to ~3e-5, not to the bit.
Forward only, no autograd; see the results README for what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numba as nb
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import module as module_bench  # noqa: E402  (benchmarks/module.py: shapes, demo port)
from engram.training.train import ALLOCATOR_ENV  # noqa: E402


@nb.njit(parallel=True, fastmath=True, error_model="numpy", cache=True)
def gate_and_norm(kv, h, w12, norm_w, eps1, eps2, eps3, full, vt, ctx):
    """kv [n, (m+1) d], h [n, m, d] (n = b t) -> vt [n, m, d] and the conv's normalised input,
    written behind ctx zeros into full [b, ctx + t, m d]."""
    n_pos, m, d = h.shape
    t = n_pos // full.shape[0]
    inv_sqrt_d = 1.0 / math.sqrt(d)
    for n in nb.prange(n_pos):
        bi, ti = n // t, n % t
        sv = np.float32(0.0)
        for c in range(d):
            sv += kv[n, c] * kv[n, c]
        for i in range(m):
            sk, sh, dot = np.float32(0.0), np.float32(0.0), np.float32(0.0)
            for c in range(d):
                k, x = kv[n, (i + 1) * d + c], h[n, i, c]
                sk += k * k
                sh += x * x
                dot += k * x * w12[i, c]
            s = dot / math.sqrt(sk / d + eps1) / math.sqrt(sh / d + eps2) * inv_sqrt_d
            s = math.copysign(math.sqrt(max(abs(s), 1e-6)), s)
            a = 1.0 / (1.0 + math.exp(-s))
            r = 1.0 / math.sqrt(a * a * sv / d + eps3)
            for c in range(d):
                x = a * kv[n, c]
                vt[n, i, c] = x
                full[bi, ctx + ti, i * d + c] = x * r * norm_w[i, c]


@nb.njit(parallel=True, fastmath=True, error_model="numpy", cache=True)
def conv(full, w, dil, y):
    """Valid depthwise conv along t: full [b, ctx + t, C], w [kernel, C] -> y [b, t, C]."""
    b, _, c_all = full.shape
    t, kernel = y.shape[1], w.shape[0]
    for n in nb.prange(b * t):
        bi, ti = n // t, n % t
        for c in range(c_all):
            y[bi, ti, c] = full[bi, ti, c] * w[0, c]
        for j in range(1, kernel):
            for c in range(c_all):
                y[bi, ti, c] += full[bi, ti + j * dil, c] * w[j, c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of 10 calls each")
    args = ap.parse_args()
    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    torch.set_num_threads(args.threads)
    nb.set_num_threads(args.threads)
    shapes = argparse.Namespace(table_size=64_000, max_ngram=3, d_ngram=512, heads=8, batch=4,
                                seq=512, hidden=1024, hc_mult=4)
    _, ids, mods = module_bench.build(shapes)
    ours, demo = mods["ours"], mods["demo"]
    b, t, m, d = shapes.batch, shapes.seq, shapes.hc_mult, shapes.hidden
    h = torch.randn(b, t, m, d)
    with torch.no_grad():
        w, bias = ours.kv_weights()
        sc = ours.short_conv
        w12 = torch.stack([n.weight for n in ours.norm1]) * torch.stack([n.weight for n in ours.norm2])
        norm_w = torch.stack([n.weight for n in sc.norms])
        conv_w = sc.conv.weight[:, 0].t().contiguous()  # [kernel, C]
        e = ours.read(ids)
    eps = torch.finfo(torch.float32).eps  # the demo's key/hidden norms: nn.RMSNorm's eps=None

    @torch.no_grad()
    def fused():
        kv = F.linear(ours.read(ids), w, bias).view(b * t, -1)
        full = torch.empty(b, sc.context + t, m * d)
        full[:, :sc.context] = 0
        vt, y = torch.empty(b, t, m, d), torch.empty(b, t, m * d)
        gate_and_norm(kv.numpy(), h.view(b * t, m, d).numpy(), w12.numpy(), norm_w.numpy(), eps,
                      eps, sc.norms[0].eps, full.numpy(), vt.view(b * t, m, d).numpy(),
                      sc.context)
        conv(full.numpy(), conv_w.numpy(), sc.dilation, y.numpy())
        return vt.add_(F.silu(y, inplace=True).view(b, t, m, d))

    fns = {"demo": lambda: demo(h, ids), "ours": lambda: ours(h, ids), "fused": fused,
           "gemm": lambda: F.linear(e, w, bias)}
    with torch.no_grad():
        diff = (fused() - ours(h, ids)).abs().max().item()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(args.rounds + 1):
            for k, f in fns.items():
                ts = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
                if r:  # the first round warms up (and compiles)
                    times[k].append(statistics.median(ts))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"config": vars(args), "load_avg": os.getloadavg(), "max_abs_diff_vs_ours": diff,
           "fwd_ms": {k: v * 1e3 for k, v in med.items()},
           "fwd_over_demo": {k: med["demo"] / med[k] for k in ("ours", "fused")},
           "fwd_time_over_gemm": {k: med[k] / med["gemm"] for k in ("ours", "fused")}}
    print(f"forward ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()))
    print(f"x the demo port: ours {res['fwd_over_demo']['ours']:.2f}, fused "
          f"{res['fwd_over_demo']['fused']:.2f} (goal 2); time / GEMM: ours "
          f"{res['fwd_time_over_gemm']['ours']:.2f}, fused {res['fwd_time_over_gemm']['fused']:.2f};"
          f" max |fused - ours| {diff:.1e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
