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
count, nor on whether a call runs the parallel kernels or their serial twins. How they run (numba's
threads, the size under which a call stays serial) is a ``Plan`` made once per process
(``resolve`` at a job's start, else at the first call), never changed by a forward. CPU
float32 and a conv of at most 4 taps only; other devices, dtypes and kernels take the torch path,
as does a module whose short conv has hooks (they must see its input).

Shape legend:
    b batch, t positions, m residual branches, d hidden size, n = b t, C = m d conv channels,
    K conv kernel, ctx = (K - 1) * dilation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
# Work items: each sequence's positions in ceil(ITEMS / b) chunks. The weight gradients are summed
# per item, then over items: a fixed split, so the same bits on any thread count.
ITEMS = 16
MAX_KERNEL = 4  # the conv's taps are summed 4 at a time in registers (kernels.weight_rows)
# Values ([n, m, d]) under which a call stays on one thread (a decode step: waking the pool costs
# more than the work). Machine-dependent, but not timed (unlike engram/compute/gemm.py's route): a call's
# bits are the same either way, and a threshold off by 4x costs ~0.15 ms a call near it (65536
# values of the compare module ran 0.50 ms serial, 0.36 ms on 2 threads).
SERIAL_BELOW = 1 << 16


def fits(*tensors: torch.Tensor | None, kernel_size: int = 0) -> bool:
    """Whether the kernels take these tensors: numba installed, CPU, float32, a conv of at most
    MAX_KERNEL taps."""
    return _HAVE_NUMBA and kernel_size <= MAX_KERNEL and all(
        x is None or (x.device.type == "cpu" and x.dtype == torch.float32) for x in tensors)


def _chunk(b: int, t: int) -> int:
    """Positions per work item."""
    per_seq = max(1, -(-ITEMS // b))
    return max(1, -(-t // per_seq))


class _Kernels:
    """module/kernels.py's parallel kernels, or their serial twins (no numba thread pool is
    started then; see jit.kernel): the same compiled loops, so the same bits either way."""

    def __init__(self, serial: bool):
        from . import kernels
        for name in ("gate_forward", "conv_forward", "backward"):
            fn = getattr(kernels, name)
            setattr(self, name, fn.serial if serial else fn)


_BY_MODE: dict[bool, _Kernels] = {}
# numba's fallback thread pool (workqueue, where no OpenMP or TBB library is found) aborts the
# process when two threads launch parallel loops at once: a plan on it lets one caller at a time
# into the pool; another runs the serial twins meanwhile (the same bits) instead of waiting.
_POOL = threading.Lock()


def _kernels(serial: bool) -> _Kernels:
    if serial not in _BY_MODE:
        _BY_MODE[serial] = _Kernels(serial)
    return _BY_MODE[serial]


@dataclass(frozen=True)
class Plan:
    """How the kernels run, fixed once (``make_plan``), not looked up per call."""

    threads: int  # numba threads for the parallel kernels; 1: the serial twins only (no pool)
    serial_below: int = SERIAL_BELOW  # values [n, m, d] under which a call runs serially anyway
    exclusive: bool = False  # numba's pool takes one caller at a time (the workqueue layer)

    @contextlib.contextmanager
    def kernels(self, values: int):
        """The kernels for a call over this many values: parallel, or the serial twins for a
        one-thread plan, a small call (a decode step), or while another thread holds an
        exclusive pool."""
        if self.threads == 1 or values < self.serial_below:
            yield _kernels(True)
        elif not self.exclusive:
            yield _kernels(False)
        elif _POOL.acquire(blocking=False):
            try:
                yield _kernels(False)
            finally:
                _POOL.release()
        else:
            yield _kernels(True)


def make_plan(threads: int | None = None, serial_below: int = SERIAL_BELOW) -> Plan:
    """A plan for ``threads`` numba threads (None: torch's thread count now), at most numba's pool
    (NUMBA_NUM_THREADS, the cores). More than one starts the pool and sets its thread count for
    the calling thread (numba's count is per thread: call this from the thread that runs the
    model; another thread's parallel calls use the whole pool)."""
    n = torch.get_num_threads() if threads is None else threads
    if n <= 1:  # numba not even imported (~0.5 s)
        return Plan(1, serial_below)
    import numba
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if n == 1:
        return Plan(1, serial_below)
    numba.set_num_threads(n)
    return Plan(n, serial_below, exclusive=numba.threading_layer() == "workqueue")


_PLAN: Plan | None = None


def resolve(threads: int | None = None, serial_below: int = SERIAL_BELOW) -> Plan:
    """The process's plan, made now (at a job's start, after torch's thread count is set); the
    Engram modules use it unless given their own."""
    global _PLAN
    _PLAN = make_plan(threads, serial_below)
    return _PLAN


def plan() -> Plan:
    """The process's plan: ``resolve``'s, else made on the first kernel call and kept."""
    return _PLAN if _PLAN is not None else resolve()


def _f32(eps: float | None) -> float:
    """An RMSNorm eps as the kernels' float32 (None: float32's machine eps, as nn.RMSNorm)."""
    import numpy as np
    return np.float32(torch.finfo(torch.float32).eps if eps is None else eps)


class Conv(NamedTuple):
    """The short conv's tensors: its RMSNorm weight [m, d], its depthwise weight [C, 1, K] and the
    past [b, ctx, C] (its normalised inputs before t = 0; zeros at a sequence start)."""

    norm_weight: torch.Tensor
    weight: torch.Tensor
    past: torch.Tensor


@dataclass(frozen=True)
class Options:
    """What a call computes besides its tensors."""

    gate: str  # "paper" or "demo" (module/gate.py)
    eps: tuple[float | None, float | None, float | None]  # key, hidden, conv norms (None: fp32's)
    dilation: int = 1  # the conv's
    keep_inputs: bool = False  # also return the conv's input buffer (the caller's decode state)
    plan: Plan | None = None  # how the kernels run; None: the process's (plan())


def gate_conv(kv: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              live: torch.Tensor, conv: Conv | None, opts: Options):
    """kv [b, t, (m+1) d] (value, then each branch's key), h [b, t, m, d], the key and hidden
    norms' weights w1, w2 [m, d], live [b, t] (1, or 0 at padding: V~ = alpha live v, so padding
    feeds zeros to the conv), the conv's tensors (None: no conv)
    -> Y = V~ + SiLU(conv(RMSNorm(V~) nw)) [b, t, m, d], alpha [b, t, m], and with
    ``opts.keep_inputs`` the conv's input buffer [b, ctx + t, C] (no grad; the caller keeps its
    tail as the decode state; else an empty tensor)."""
    opts = opts if opts.plan is not None else dataclasses.replace(opts, plan=plan())
    nw, cw, past = conv if conv is not None else (None, None, None)
    return FusedFn.apply(kv, h, w1, w2, live, nw, cw, past, opts)


class FusedFn(torch.autograd.Function):
    """``gate_conv``'s autograd node: the tensors positional (autograd tracks only those),
    nw, cw, past None without the conv."""

    @staticmethod
    def forward(ctx, kv, h, w1, w2, live, nw, cw, past, opts: Options):
        b, t, m, d = h.shape
        n, conv = b * t, cw is not None
        kv2 = kv.detach().reshape(n, (m + 1) * d).contiguous()  # [n, (m+1) d]
        h3 = h.detach().reshape(n, m, d).contiguous()  # [n, m, d]
        w12 = (w1 * w2).detach().contiguous()
        live = live.detach().reshape(n).to(torch.float32).contiguous()  # [n]
        stats, alpha = kv.new_empty(n, m, 5), kv.new_empty(b, t, m)
        out = kv.new_empty(b, t, m, d)
        grad = any(ctx.needs_input_grad)
        eps1, eps2, eps3 = (_f32(e) for e in opts.eps)
        full = kv.new_empty(0, 0, 0)
        with opts.plan.kernels(h.numel()) as kern:
            kern.gate_forward(kv2.numpy(), h3.numpy(), w12.numpy(), eps1, eps2, eps3,
                              opts.gate == "demo", conv, live.numpy(), stats.numpy(),
                              alpha.view(n, m).numpy(), out.view(n, m, d).numpy())
            if conv:
                cwt = cw.detach()[:, 0].t().contiguous()  # [K, C]
                nw, past = nw.detach().contiguous(), past.detach().contiguous()
                if opts.keep_inputs:
                    full = kv.new_empty(b, past.shape[1] + t, m * d)  # [b, ctx + t, C]
                    full[:, :past.shape[1]] = past
                kern.conv_forward(kv2.numpy(), alpha.view(n, m).numpy(), live.numpy(),
                                  stats.numpy(), nw.numpy(), cwt.numpy(), past.numpy(),
                                  opts.dilation, t, _chunk(b, t), out.view(n, m, d).numpy(),
                                  full.numpy())
            else:  # the backward's conv part sees no taps
                cwt, past, nw = kv.new_empty(0, m * d), kv.new_empty(b, 0, m * d), w12
        ctx.mark_non_differentiable(full)
        if grad:
            ctx.save_for_backward(kv2, h3, w1, w2, w12, nw, cwt, past, stats, alpha, live)
            ctx.conv, ctx.opts, ctx.shape, ctx.kv_shape = conv, opts, (b, t, m, d), kv.shape
        ctx.set_materialize_grads(False)
        return out, alpha, full

    @staticmethod
    def backward(ctx, gout, galpha, _):
        kv2, h3, w1, w2, w12, nw, cwt, past, stats, alpha, live = ctx.saved_tensors
        b, t, m, d = ctx.shape
        n, conv, opts = b * t, ctx.conv, ctx.opts
        gout = (kv2.new_zeros(n, m, d) if gout is None
                else gout.reshape(n, m, d).contiguous())  # [n, m, d]
        galpha = (kv2.new_zeros(n, m) if galpha is None
                  else galpha.reshape(n, m).contiguous())  # [n, m]
        chunk = _chunk(b, t)
        items = b * -(-t // chunk)
        gkv, gh = torch.empty_like(kv2), torch.empty_like(h3)
        acc_w12, acc_nw = kv2.new_zeros(items, m, d), kv2.new_zeros(items, m, d)
        acc_cw = kv2.new_zeros(items, *cwt.shape)  # [items, K, C]
        with opts.plan.kernels(h3.numel()) as kern:
            kern.backward(kv2.numpy(), h3.numpy(), w12.numpy(), nw.numpy(), cwt.numpy(),
                          past.numpy(), gout.numpy(), galpha.numpy(), stats.numpy(),
                          alpha.view(n, m).numpy(), live.numpy(), opts.gate == "demo", conv,
                          opts.dilation, t, chunk, gkv.numpy(), gh.numpy(), acc_w12.numpy(),
                          acc_nw.numpy(), acc_cw.numpy())
        gnw = acc_nw.sum(0) if conv else None
        gcw = acc_cw.sum(0).t().unsqueeze(1) if conv else None  # [C, 1, K]
        gw12 = acc_w12.sum(0)  # [m, d]
        return (gkv.view(ctx.kv_shape), gh.view(b, t, m, d), gw12 * w2, gw12 * w1, None, gnw,
                gcw, None, None)
