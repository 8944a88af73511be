"""Dense float32 matrix multiplies on CPU through oneDNN, where torch's default BLAS is slow.

torch's CPU wheel multiplies float32 matrices with MKL, which dispatches its fast kernels by CPU
vendor: on an AMD EPYC (Zen 5, AVX-512, 2 cores) oneDNN, which ships in the same wheel, ran
1.45-2.5x faster on one thread at every shape this package trains with (benchmarks/
gemm_backends.py; benchmarks/results/gemm_backends.json). ``linear`` sends a float32 CPU product
to oneDNN when the backend says so, forward and backward, and to ``F.linear`` otherwise.

Backends (``ENGRAM_GEMM`` or :func:`set_backend`): ``torch`` (always ``F.linear``), ``onednn``
(oneDNN for every product of at least ``MIN_MACS`` multiply-adds), ``auto`` (the default: oneDNN
on AMD x86 processors, ``torch`` elsewhere: MKL's dispatch favours Intel's, and oneDNN was not
measured on one here). The choice is deterministic per machine, never timed at run time.
Results agree with MKL's to float32 rounding (summation order differs), not to the bit; oneDNN's
are bit-identical from call to call, and on 1 or 2 threads on the AMD EPYC measured (tested).

Shape legend:
    n rows (tokens: every leading dimension of x flattened), i in features, o out features.
"""

from __future__ import annotations

import os
import platform
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("auto", "torch", "onednn")
# Under ~2M multiply-adds (a decode step's few rows) oneDNN's per-call cost outweighs its faster
# loops: 8 x 128 x 384 ran at 0.66x MKL's speed, 64 x 128 x 384 at 1.3-1.6x.
MIN_MACS = 1 << 21

_chosen: str | None = None  # set_backend's choice; None: ENGRAM_GEMM, else "auto"
_resolved: dict[str, str] = {}


def _cpuinfo(field: str, text: str | None = None) -> str:
    """The first value of ``field`` in /proc/cpuinfo's text (or ``text``), or ''."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read(1 << 16)
        except OSError:
            return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 vendor id ('AuthenticAMD', 'GenuineIntel', ...), or ''."""
    return _cpuinfo("vendor_id", cpuinfo)


def cpu_model() -> str:
    """The processor's model name (recorded beside timings and results), or ''."""
    return _cpuinfo("model name") or platform.processor()


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve(name: str, vendor: str | None = None, machine: str | None = None) -> str:
    """A backend name -> the backend it means here: 'torch' or 'onednn'."""
    if name not in BACKENDS:
        raise ValueError(f"GEMM backend must be one of {BACKENDS}, got {name!r} "
                         "(set by ENGRAM_GEMM or engram.gemm.set_backend)")
    if name == "torch":
        return "torch"
    if not _onednn_available():
        if name == "onednn":
            raise RuntimeError("GEMM backend 'onednn': this torch build has no oneDNN "
                               "(torch.backends.mkldnn.is_available() is False)")
        return "torch"
    if name == "onednn":
        return "onednn"
    machine = (machine or platform.machine()).lower()
    amd = (vendor if vendor is not None else cpu_vendor()) == "AuthenticAMD"
    return "onednn" if amd and machine in ("x86_64", "amd64") else "torch"


def backend() -> str:
    """The backend in force: 'torch' or 'onednn' (recorded with runs and benchmarks)."""
    name = _chosen or os.environ.get("ENGRAM_GEMM", "auto")
    if name not in _resolved:
        _resolved[name] = resolve(name)
    return _resolved[name]


def set_backend(name: str | None) -> str | None:
    """Choose the backend for this process ('auto', 'torch', 'onednn'; None: ENGRAM_GEMM again);
    returns the previous choice."""
    global _chosen
    if name is not None:
        resolve(name)  # refuse a bad name now, not at the next product
    previous, _chosen = _chosen, name
    return previous


@contextmanager
def using(name: str | None):
    """The backend ``name`` inside the block (benchmarks and tests compare the two); None leaves
    the backend as it is."""
    if name is None:
        yield
        return
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _routes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False  # F.linear handles (or refuses) the rest
    if not all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
               for t in (x, weight, bias)):
        return False
    if x.shape[:-1].numel() * weight.shape[0] * weight.shape[1] < MIN_MACS:
        return False
    return backend() == "onednn" and not torch.is_autocast_enabled("cpu")


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [r, k] @ b_t.T [k, c] (+ bias [c]) by oneDNN; any strides."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with all three products (forward, dx, dW) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])  # [n, i]
        ctx.save_for_backward(x2, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return _mm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])  # [..., o]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g2 = gy.reshape(-1, weight.shape[0])  # [n, o]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(g2, weight.t()).view(ctx.x_shape)  # [n, o] @ [o, i]
        if ctx.needs_input_grad[1]:
            gw = _mm(g2.t(), x2.t())  # [o, n] @ [n, i] -> [o, i]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)  # [o]
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN where the backend says so (see the module's docstring)."""
    if _routes(x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose product goes through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def adopt(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear inside ``module`` (torch's own modules included, e.g. the adaptive
    softmax's) becomes a :class:`Linear` in place: only the forward changes, not the parameters."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
    return module
