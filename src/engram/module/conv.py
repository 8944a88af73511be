"""The short causal conv of the Engram module (paper section 2.3): Y = SiLU(depthwise causal
Conv1D(RMSNorm(x))), with a hand-written backward, and the kernels it shares with the gate.

Shape legend:
    b batch, t positions, m residual branches (hyper-connections; 1 for a plain residual),
    d backbone hidden size, H hash heads per layer, e head dim, c = H * e = (N-1) * d_ngram (d_mem).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EngramState:
    """Per-sequence decode state: the conv's last ``(kernel-1)*dilation`` normalised inputs."""

    conv: torch.Tensor | None = None  # [b, (kernel-1)*dilation, m*d]
    # A serving engine that pages its own history (serving/slots.py) asks for the normalised
    # inputs of every new position, not only the last context: [b, t, m*d] after a forward.
    keep_inputs: bool = False
    inputs: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        if self.conv is not None:
            self.conv = self.conv.index_select(0, index.to(self.conv.device))


class ShortConv(nn.Module):
    """Y = SiLU(depthwise causal Conv1D(RMSNorm(x))) per branch, over all branches' channels."""

    def __init__(self, hidden_size: int, hc_mult: int = 1, kernel_size: int = 4, dilation: int = 1,
                 norm_eps: float = 1e-5):
        super().__init__()
        channels = hidden_size * hc_mult
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.kernel_size, self.dilation = kernel_size, dilation
        self.context = (kernel_size - 1) * dilation  # past positions one output depends on
        # nn.Conv1d only holds the weight [m*d, 1, kernel] (official name); padding is done by hand
        # on the left so decode can continue from a saved context.
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False,
                              dilation=dilation)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult)])

    def forward(self, x: torch.Tensor, state: EngramState | None = None,
                residual: bool = False) -> torch.Tensor:
        """x [b, t, m, d] -> Y [b, t, m, d] (x + Y with ``residual``)."""
        conv = conv_plain if torch.compiler.is_compiling() else ConvFn.apply
        y, full = conv(x, self.past(x, state), self.norm_weight(), self.conv.weight,
                       self.norms[0].eps, self.dilation, residual)
        self.remember(full, state)
        return y

    def norm_weight(self) -> torch.Tensor:
        return torch.stack([n.weight for n in self.norms])  # [m, d]: per-branch norm weights

    def past(self, x: torch.Tensor, state: EngramState | None) -> torch.Tensor:
        """The normalised inputs before x [b, t, m, d]: [b, ctx, ``m*d``], zeros at a sequence start
        (== causal padding)."""
        if state is None or state.conv is None:
            return x.new_zeros(x.shape[0], self.context, x.shape[2] * x.shape[3])
        return state.conv.to(x.dtype)

    def remember(self, full: torch.Tensor, state: EngramState | None) -> None:
        """Keep the tail of the conv's input buffer full [b, ctx + t, ``m*d``] as the decode state."""
        if state is not None and state.keep_inputs:
            state.inputs = full[:, self.context:]  # [b, t, m*d]
        if state is not None:
            state.conv = full[:, full.shape[1] - self.context:]


class ConvFn(torch.autograd.Function):
    """SiLU(depthwise causal conv(RMSNorm(x) * w)) with a hand-written backward.

    The same numbers as nn.RMSNorm per branch + F.conv1d(groups=C) on the left-padded input, but:
    one norm over all branches at once; the conv as a depthwise conv2d over the channels-last
    [b, t, ``m*d``] buffer seen as [b, ``m*d``, 1, t] (no transpose copy; one fused pass, 5x faster than
    kernel-size shifted multiply-adds on CPU, same bits); the normalised input written straight
    behind the saved context (no cat); a backward whose input gradient is the same conv with the
    kernel flipped over the right-padded output gradient (the depthwise conv's own backward is slow
    on CPU), and that reuses buffers where autograd would allocate (and on CPU page-fault) a fresh
    full-size tensor per op.
    Inputs: x [b, t, m, d], past [b, ctx, ``m*d``] (no grad), norm weight [m, d], conv weight
    [``m*d``, 1, kernel]. Outputs: y [b, t, m, d] and full [b, ctx + t, ``m*d``] (no grad; the caller keeps
    its last ctx positions as the decode state).
    """

    @staticmethod
    def forward(ctx, x, past, norm_w, conv_w, eps, dilation, residual=False):
        b, t, m, d = x.shape
        c, c0 = m * d, past.shape[1]
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [b, t, m, 1]
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        r = r.square_().div_(d).add_(eps).rsqrt_()
        full = x.new_empty(b, c0 + t, c)  # [b, ctx + t, m*d]
        full[:, :c0] = past
        xn = full[:, c0:].view(b, t, m, d)
        torch.mul(x, r, out=xn)
        xn.mul_(norm_w)
        y = _depthwise(full, conv_w, dilation)  # [b, t, m*d]; tap j reads t - (kernel-1-j)*dil
        ctx.mark_non_differentiable(full)
        if not any(ctx.needs_input_grad):  # inference: the pre-activation is not kept
            out = F.silu(y, inplace=True).view(b, t, m, d)
        else:
            ctx.save_for_backward(x, r, full, y, norm_w, conv_w)
            ctx.dilation, ctx.residual = dilation, residual
            out = F.silu(y.view(b, t, m, d))  # a fresh tensor, so the caller may add in place
        # With the residual added here, its gradient joins in place in the backward (autograd
        # would add the two paths' gradients into a fresh full-size tensor).
        return (out.add_(x) if residual else out), full

    @staticmethod
    def backward(ctx, gout, _):
        x, r, full, y, norm_w, conv_w = ctx.saved_tensors
        b, t, m, d = x.shape
        kernel, dil, c0 = conv_w.shape[-1], ctx.dilation, full.shape[1] - x.shape[1]
        # The output gradient with c0 zeros behind it: position tau feeds y[tau + (kernel-1-j)*dil],
        # so the input gradient is the conv of this buffer with the kernel flipped.
        gpad = x.new_empty(b, t + c0, m * d)  # [b, t + ctx, m*d]
        gpad[:, t:] = 0
        gy = gpad[:, :t]  # [b, t, m*d]
        torch.ops.aten.silu_backward.grad_input(gout.reshape(b, t, m * d), y, grad_input=gy)
        gw = _tap_grads(gy, full, kernel, dil)  # [kernel, m*d]
        gxn = _depthwise(gpad, conv_w.flip(-1), dil).view(b, t, m, d)
        # RMSNorm backward with u = x r: gx = r (gu - u <gu, u> / d), gu = gxn w. The per-row scale
        # r is taken out of the products, so one product P = gxn x serves the weight gradient and
        # the dot, both as batched matrix products (one read each, no temporaries).
        p = torch.mul(gxn, x, out=y.view(b, t, m, d))  # [b, t, m, d]; y is spent: its buffer
        rr = r.squeeze(-1)  # [b, t, m]
        gnw = _colsum(p, rr)  # [m, d]: sum over b, t of r gxn x
        dot = torch.einsum("btmd,md->btm", p, norm_w).mul_(rr).unsqueeze(-1).div_(d)  # <gu, u>/d
        gx = gxn.mul_(norm_w).addcmul_(x, dot.mul_(r).neg_()).mul_(r)
        if ctx.residual:
            gx.add_(gout)
        return gx, None, gnw, gw.t().unsqueeze(1), None, None, None


def conv_plain(x: torch.Tensor, past: torch.Tensor, norm_w: torch.Tensor, conv_w: torch.Tensor,
               eps: float | None, dilation: int, residual: bool = False):
    """``ConvFn``'s mathematics as plain differentiable ops, for torch.compile: ConvFn's
    writes into views of its buffers (``out=``) are a graph break there, and the compiler fuses
    these elementwise ops itself. Same inputs and outputs."""
    b, t, m, d = x.shape
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    xn = x * x.square().mean(-1, keepdim=True).add(eps).rsqrt() * norm_w  # [b, t, m, d]
    full = torch.cat([past.to(x.dtype), xn.reshape(b, t, m * d)], 1)  # [b, ctx + t, m*d]
    y = F.conv1d(full.transpose(1, 2), conv_w, None, 1, 0, dilation, m * d)  # [b, m*d, t]
    out = F.silu(y.transpose(1, 2)).reshape(b, t, m, d)
    return (out + x if residual else out), full.detach()


def _depthwise(full: torch.Tensor, w: torch.Tensor, dilation: int) -> torch.Tensor:
    """Valid depthwise conv along t of full [b, T, C] with w [C, 1, kernel] -> [b, T - ctx, C]."""
    b, n, c = full.shape
    kernel = w.shape[-1]
    t = n - (kernel - 1) * dilation
    if b * t <= 64:  # a decode step: kernel multiply-adds cost less than the conv's set-up
        wt = w[:, 0].t()  # [kernel, C]
        y = full[:, :t] * wt[0]  # the conv's order of taps, so the same bits
        for j in range(1, kernel):
            y.addcmul_(full[:, j * dilation: j * dilation + t], wt[j])
        return y
    # [b, T, C] contiguous is [b, C, 1, T] in channels-last: the conv reads it in place and writes
    # its output channels-last too, i.e. [b, t, C] contiguous again.
    y = F.conv2d(full.permute(0, 2, 1).unsqueeze(2), w.unsqueeze(2), None, 1, 0, (1, dilation), c)
    return y.squeeze(2).permute(0, 2, 1).contiguous()  # no copy when already channels-last


def _tap_grads(gy: torch.Tensor, full: torch.Tensor, kernel: int, dil: int,
               step: int | None = None) -> torch.Tensor:
    """Conv weight gradient: sum over b, t of gy [b, t, C] times each tap's input -> [kernel, C].

    Products accumulate chunk by chunk of positions into a cache-sized buffer (about 512 KiB a
    tap), all taps in one op through a strided view of full, then one sum: a full-size product per
    tap is written and read back from memory instead (2.7x the time at the demo's shapes on CPU).
    """
    b, t, c = gy.shape
    if not full.is_contiguous():
        full = full.contiguous()
    n_full = full.shape[1]
    step = step or max(1, min(t, (1 << 17) // max(1, b * c)))  # positions per chunk
    low = gy.dtype in (torch.bfloat16, torch.float16)  # accumulate those in float32, like sum()
    acc = gy.new_empty(kernel, b, step, c, dtype=torch.float32 if low else gy.dtype)

    def taps(a: int, n: int) -> torch.Tensor:  # [kernel, b, n, C]: tap j reads full[:, a + j dil:]
        return full.as_strided((kernel, b, n, c), (dil * c, n_full * c, c, 1),
                               full.storage_offset() + a * c)

    torch.mul(gy[:, :step].unsqueeze(0), taps(0, step), out=acc)  # a full first chunk initialises
    for a in range(step, t, step):
        n = min(step, t - a)
        acc[:, :, :n].addcmul_(gy[:, a:a + n].unsqueeze(0), taps(a, n))
    return acc.sum((1, 2)).to(gy.dtype)  # [kernel, C]


def _colsum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over b, t of w x: x [b, t, m, d], w [b, t, m] -> [m, d], as m batched (1 x bt) @ (bt x d)
    products (one read of x; (x * w).sum((0, 1)) writes and reads a full temporary)."""
    m, d = x.shape[-2:]
    return torch.bmm(w.reshape(-1, m).t().unsqueeze(1), x.reshape(-1, m, d).transpose(0, 1))[:, 0]
