"""The context-aware gate of the Engram module (paper section 2.3, spec 2.7): alpha from the
scaled dot product of the normalised key and hidden state, applied to the value.

Shape legend:
    b batch, t positions, m residual branches (hyper-connections; 1 for a plain residual),
    d backbone hidden size, H hash heads per layer, e head dim, c = H * e = (N-1) * d_ngram (d_mem).
"""

from __future__ import annotations

import math

import torch

from .conv import _colsum

GATES = ("paper", "demo")


def gate_fn(score: torch.Tensor, kind: str) -> torch.Tensor:
    """alpha from the scaled dot product s (spec 2.7)."""
    if kind == "demo":
        # The official demo compresses the score with a signed square root before the sigmoid.
        score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
    return score.sigmoid()


def _rms_scale(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim (nn.RMSNorm's eps=None: dtype eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def gate_plain(kv: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               eps1: float | None, eps2: float | None, kind: str):
    """``GateFn``'s mathematics as plain differentiable ops, for torch.compile (GateFn's
    writes into views, ``out=``, are a graph break there; the compiler fuses these itself)."""
    b, t, m, d = h.shape
    v, k = kv[..., :d], kv[..., d:].unflatten(-1, (m, d))  # [b, t, d], [b, t, m, d]
    kn = k * _rms(k, eps1) * w1  # [b, t, m, d]
    hn = h * _rms(h, eps2) * w2
    alpha = gate_fn((kn * hn).sum(-1) / math.sqrt(d), kind)  # [b, t, m]
    return alpha.unsqueeze(-1) * v.unsqueeze(2), alpha  # [b, t, m, d], [b, t, m]


def _rms(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """``_rms_scale`` without in-place ops (autograd differentiates it)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return x.square().mean(-1, keepdim=True).add(eps).rsqrt()


class GateFn(torch.autograd.Function):
    """kv [b, t, ``(m+1)*d``] (value, then each branch's key), h [b, t, m, d], norm weights w1 (keys)
    and w2 (hidden) [m, d] -> alpha * v [b, t, m, d] and alpha [b, t, m] (spec 2.7).

    s = <RMSNorm(k) w1, RMSNorm(h) w2> / sqrt(d) = r_k r_h <k, h w1 w2> / sqrt(d): the norms enter
    as per-row scales, so no normalised copy of k or h is made, and the backward writes the value
    and key gradients straight into one [b, t, ``(m+1)*d``] tensor (autograd would fill and add a
    zero tensor per slice).
    """

    @staticmethod
    def forward(ctx, kv, h, w1, w2, eps1, eps2, kind):
        b, t, m, d = h.shape
        v, k = kv[..., :d], kv[..., d:].unflatten(-1, (m, d))  # [b, t, d], [b, t, m, d]
        rk, rh = _rms_scale(k, eps1), _rms_scale(h, eps2)  # [b, t, m, 1]
        kh = k * h  # [b, t, m, d]; kept: the norm weights' gradient is sum_bt gdot k h
        # One read of k h as a batched product; a decode step's few rows take the plain sum (a
        # batched product starts the BLAS threads, which costs more than it saves there).
        w12 = w1 * w2
        dot = (torch.einsum("btmd,md->btm", kh, w12) if kh.numel() > 1 << 16
               else (kh * w12).sum(-1)).unsqueeze(-1)  # [b, t, m, 1]
        s = (dot * rk * rh).squeeze(-1) / math.sqrt(d)  # [b, t, m]
        alpha = gate_fn(s, kind)
        grad = any(ctx.needs_input_grad)
        # [b, t, m, d]; W_V shared by branches. Inference writes it over k h, no longer needed.
        vt = torch.mul(alpha.unsqueeze(-1), v.unsqueeze(2), out=None if grad else kh)
        if grad:
            ctx.save_for_backward(kv, h, w1, w2, kh, rk, rh, dot, s, alpha)
        ctx.kind = kind
        ctx.set_materialize_grads(False)
        return vt, alpha

    @staticmethod
    def backward(ctx, gvt, galpha):
        kv, h, w1, w2, kh, rk, rh, dot, s, alpha = ctx.saved_tensors
        b, t, m, d = h.shape
        v, k = kv[..., :d], kv[..., d:].unflatten(-1, (m, d))
        gkv = kv.new_zeros(kv.shape) if gvt is None else torch.empty_like(kv)
        ga = torch.zeros_like(alpha) if galpha is None else galpha.clone()  # [b, t, m]
        if gvt is not None:
            # Sums over branches (W_V is shared) and over d as batched products: one read of gvt.
            if m == 1:  # a plain residual: one product, written in place (einsum's result is a
                # fresh tensor copied over, 0.6 ms of a 2 ms backward at compare's shapes)
                torch.mul(gvt[:, :, 0], alpha, out=gkv[..., :d])
            else:
                gkv[..., :d] = torch.einsum("btmd,btm->btd", gvt, alpha)
            ga += torch.einsum("btmd,btd->btm", gvt, v)
        with torch.enable_grad():  # the gate's own curve on [b, t, m] only: exact, and cheap
            s_ = s.detach().requires_grad_()
            (gs,) = torch.autograd.grad(gate_fn(s_, ctx.kind), s_, ga)
        gs = gs.unsqueeze(-1) / math.sqrt(d)  # [b, t, m, 1]
        gdot = gs * rk * rh
        # d r / d x = -r^3 x / d for r = (mean(x^2) + eps)^-1/2
        w12 = w1 * w2
        gk = gkv[..., d:].unflatten(-1, (m, d))  # written in place: the keys' part of gkv
        torch.mul(h, w12, out=gk).mul_(gdot)
        gk.addcmul_(k, gs * dot * rh * rk.pow(3) / -d)
        gw12 = _colsum(kh, gdot.squeeze(-1))  # [m, d]
        gh = torch.mul(k, w12, out=kh)  # k h is spent: its buffer
        gh.mul_(gdot).addcmul_(h, gs * dot * rk * rh.pow(3) / -d)

        return gkv, gh, gw12 * w2, gw12 * w1, None, None, None
