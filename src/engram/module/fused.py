"""The Engram module after its value/key GEMM (gate, the short conv's norm, conv, SiLU, residual)
as compiled CPU kernels, forward and backward.

Eager torch makes ~10 passes each way over [b, t, m, d] tensors here (the norms' reductions, the
gate's products, the conv, SiLU, the residual, each backward op), which cost the demo-shaped module
~0.45x of its GEMM time (benchmarks/module.py). The kernels (module/kernels.py, numba) make two
passes forward (the gate; then the conv's input norm, conv, SiLU and residual) and one backward,
threaded over chunks of positions, each chunk walking its positions with the conv's last inputs in
a ring of rows that stays in cache. The conv's output is not kept: the backward recomputes it from
the ring (4 multiply-adds a value) instead of writing and reading back a [b, t, m d] tensor.
Same mathematics as GateFn + ConvFn; reductions are reassociated (vectorised) and SiLU's exp is a
polynomial (~2 ulp), so results agree with the torch path to ~1e-6 relative, not to the bit. The
weight gradients are summed per chunk, then over chunks: the bits do not depend on the thread
count. CPU float32 and a conv of at most 4 taps only; other devices, dtypes and kernels take the
torch path, as does a module whose short conv has hooks (they must see its input).

Shape legend:
    b batch, t positions, m residual branches, d hidden size, n = b t, C = m d conv channels,
    K conv kernel, ctx = (K - 1) * dilation.
"""

from __future__ import annotations

import importlib.util
import threading

import torch

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
# Work items: each sequence's positions in ceil(ITEMS / b) chunks. The weight gradients are summed
# per item, then over items: a fixed split, so the same bits on any thread count.
ITEMS = 16
MAX_KERNEL = 4  # the conv's taps are summed 4 at a time in registers (kernels.weight_rows)


def fits(*tensors: torch.Tensor | None, kernel_size: int = 0) -> bool:
    """Whether the kernels take these tensors: numba installed, CPU, float32, a conv of at most
    MAX_KERNEL taps."""
    return _HAVE_NUMBA and kernel_size <= MAX_KERNEL and all(
        x is None or (x.device.type == "cpu" and x.dtype == torch.float32) for x in tensors)


def _chunk(b: int, t: int) -> int:
    """Positions per work item."""
    per_seq = max(1, -(-ITEMS // b))
    return max(1, -(-t // per_seq))


# numba's fallback thread pool (workqueue, where no OpenMP or TBB library is found) aborts the
# process on concurrent calls: one call at a time (an uncontended lock costs ~0.1 us).
_LOCK = threading.Lock()


SERIAL_BELOW = 1 << 16  # values ([n, m, d]) under which one thread beats waking the pool (decode)


class _Kernels:
    """module/kernels.py's parallel kernels, or their serial twins (no numba thread pool is
    started then; see jit.kernel): the same compiled loops, so the same bits either way."""

    def __init__(self, serial: bool):
        from . import kernels
        for name in ("gate_forward", "conv_forward", "backward"):
            fn = getattr(kernels, name)
            setattr(self, name, fn.serial if serial else fn)


_BY_MODE: dict[bool, _Kernels] = {}


def _kernels(values: int) -> _Kernels:
    """The kernels (module/kernels.py, imported on first use) for a call over this many values on
    torch's thread count: serial on one thread or for a few values (a decode step)."""
    import numba
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    serial = threads == 1 or values < SERIAL_BELOW
    if not serial:
        numba.set_num_threads(threads)
    if serial not in _BY_MODE:
        _BY_MODE[serial] = _Kernels(serial)
    return _BY_MODE[serial]


def _f32(eps: float | None) -> float:
    """An RMSNorm eps as the kernels' float32 (None: float32's machine eps, as nn.RMSNorm)."""
    import numpy as np
    return np.float32(torch.finfo(torch.float32).eps if eps is None else eps)


class FusedFn(torch.autograd.Function):
    """kv [b, t, (m+1) d] (value, then each branch's key), h [b, t, m, d], key/hidden norm weights
    w1, w2 [m, d], conv norm weight nw [m, d] and conv weight cw [C, 1, K] (both None without the
    conv), past [b, ctx, C] (the conv's normalised inputs before t = 0; zeros at a sequence start)
    and live [b, t] (1, or 0 at padding: V~ = alpha live v, so padding feeds zeros to the conv);
    eps1-3 the key, hidden and conv norms' eps (None: float32's, as nn.RMSNorm's eps=None)
    -> Y = V~ + SiLU(conv(RMSNorm(V~) nw)) [b, t, m, d], alpha [b, t, m], and, with
    ``keep_full``, the conv's input buffer full [b, ctx + t, C] (no grad; the caller keeps its tail
    as the decode state; else an empty tensor).
    """

    @staticmethod
    def forward(ctx, kv, h, w1, w2, nw, cw, past, live, eps1, eps2, eps3, dilation, kind,
                keep_full):
        with _LOCK:
            return FusedFn._forward(ctx, kv, h, w1, w2, nw, cw, past, live, eps1, eps2, eps3,
                                    dilation, kind, keep_full)

    @staticmethod
    def _forward(ctx, kv, h, w1, w2, nw, cw, past, live, eps1, eps2, eps3, dilation, kind,
                 keep_full):
        b, t, m, d = h.shape
        kern = _kernels(h.numel())
        n, conv = b * t, cw is not None
        kv2 = kv.detach().reshape(n, (m + 1) * d).contiguous()  # [n, (m+1) d]
        h3 = h.detach().reshape(n, m, d).contiguous()  # [n, m, d]
        w12 = (w1 * w2).detach().contiguous()
        live = live.detach().reshape(n).to(torch.float32).contiguous()  # [n]
        stats, alpha = kv.new_empty(n, m, 5), kv.new_empty(b, t, m)
        out = kv.new_empty(b, t, m, d)
        grad = any(ctx.needs_input_grad)
        kern.gate_forward(kv2.numpy(), h3.numpy(), w12.numpy(), _f32(eps1), _f32(eps2),
                          _f32(eps3), kind == "demo", conv, live.numpy(), stats.numpy(),
                          alpha.view(n, m).numpy(), out.view(n, m, d).numpy())
        full = kv.new_empty(0, 0, 0)
        if conv:
            cwt = cw.detach()[:, 0].t().contiguous()  # [K, C]
            nw, past = nw.detach().contiguous(), past.detach().contiguous()
            if keep_full:
                full = kv.new_empty(b, past.shape[1] + t, m * d)  # [b, ctx + t, C]
                full[:, :past.shape[1]] = past
            kern.conv_forward(kv2.numpy(), alpha.view(n, m).numpy(), live.numpy(),
                              stats.numpy(), nw.numpy(), cwt.numpy(), past.numpy(), dilation, t,
                              _chunk(b, t), out.view(n, m, d).numpy(), full.numpy())
        else:  # the backward's conv part sees no taps
            cwt, past, nw = kv.new_empty(0, m * d), kv.new_empty(b, 0, m * d), w12
        ctx.mark_non_differentiable(full)
        if grad:
            ctx.save_for_backward(kv2, h3, w1, w2, w12, nw, cwt, past, stats, alpha, live)
            ctx.conv, ctx.dilation, ctx.kind, ctx.shape = conv, dilation, kind, (b, t, m, d)
            ctx.kv_shape = kv.shape
        ctx.set_materialize_grads(False)
        return out, alpha, full

    @staticmethod
    def backward(ctx, gout, galpha, _):
        with _LOCK:
            return FusedFn._backward(ctx, gout, galpha)

    @staticmethod
    def _backward(ctx, gout, galpha):
        kv2, h3, w1, w2, w12, nw, cwt, past, stats, alpha, live = ctx.saved_tensors
        kern = _kernels(h3.numel())
        b, t, m, d = ctx.shape
        n, conv = b * t, ctx.conv
        gout = (kv2.new_zeros(n, m, d) if gout is None
                else gout.reshape(n, m, d).contiguous())  # [n, m, d]
        galpha = (kv2.new_zeros(n, m) if galpha is None
                  else galpha.reshape(n, m).contiguous())  # [n, m]
        chunk = _chunk(b, t)
        items = b * -(-t // chunk)
        gkv, gh = torch.empty_like(kv2), torch.empty_like(h3)
        acc_w12, acc_nw = kv2.new_zeros(items, m, d), kv2.new_zeros(items, m, d)
        acc_cw = kv2.new_zeros(items, *cwt.shape)  # [items, K, C]
        kern.backward(kv2.numpy(), h3.numpy(), w12.numpy(), nw.numpy(),
                      cwt.numpy(), past.numpy(), gout.numpy(), galpha.numpy(), stats.numpy(),
                      alpha.view(n, m).numpy(), live.numpy(), ctx.kind == "demo", conv,
                      ctx.dilation, t, chunk, gkv.numpy(), gh.numpy(), acc_w12.numpy(),
                      acc_nw.numpy(), acc_cw.numpy())
        gnw = acc_nw.sum(0) if conv else None
        gcw = acc_cw.sum(0).t().unsqueeze(1) if conv else None  # [C, 1, K]
        gw12 = acc_w12.sum(0)  # [m, d]
        return (gkv.view(ctx.kv_shape), gh.view(b, t, m, d), gw12 * w2, gw12 * w1, gnw, gcw,
                None, None, None, None, None, None, None, None)
