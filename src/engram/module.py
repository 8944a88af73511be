"""The Engram module: lookup -> context-aware gate -> short causal conv (paper section 2.3).

Shape legend:
    b batch, t positions, m residual branches (hyper-connections; 1 for a plain residual),
    d backbone hidden size, H hash heads per layer, e head dim, c = H * e = (N-1) * d_ngram (d_mem).

The module returns the residual Y; the caller adds it (H <- H + Y) before attention and FFN.
Row ids come in from outside (computed from token ids by :class:`engram.NgramHasher`), or the caller
passes the gathered memory vectors directly, so the table itself can live anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .retrieval.config import EngramConfig
from .retrieval.primes import head_offsets, prime_table_sizes
from .tables.store import MemoryTable, TableStore

GATES = ("paper", "demo")


def gate_fn(score: torch.Tensor, kind: str) -> torch.Tensor:
    """alpha from the scaled dot product s (spec 2.7)."""
    if kind == "demo":
        # The official demo compresses the score with a signed square root before the sigmoid.
        score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
    return score.sigmoid()


@dataclass
class EngramState:
    """Per-sequence decode state: the conv's last (kernel-1)*dilation normalised inputs."""

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
        b, t, m, d = x.shape
        if state is None or state.conv is None:
            past = x.new_zeros(b, self.context, m * d)  # zeros == causal padding at the start
        else:
            past = state.conv
        w = torch.stack([n.weight for n in self.norms])  # [m, d]: per-branch norm weights
        y, full = ConvFn.apply(x, past.to(x.dtype), w, self.conv.weight, self.norms[0].eps,
                               self.dilation, residual)
        if state is not None and state.keep_inputs:
            state.inputs = full[:, self.context:]  # [b, t, m*d]
        if state is not None:
            state.conv = full[:, full.shape[1] - self.context:]
        return y


class ConvFn(torch.autograd.Function):
    """SiLU(depthwise causal conv(RMSNorm(x) * w)) with a hand-written backward.

    The same numbers as nn.RMSNorm per branch + F.conv1d(groups=C) on the left-padded input, but:
    one norm over all branches at once; the conv as a depthwise conv2d over the channels-last
    [b, t, m*d] buffer seen as [b, m*d, 1, t] (no transpose copy; one fused pass, 5x faster than
    kernel-size shifted multiply-adds on CPU, same bits); the normalised input written straight
    behind the saved context (no cat); a backward whose input gradient is the same conv with the
    kernel flipped over the right-padded output gradient (the depthwise conv's own backward is slow
    on CPU), and that reuses buffers where autograd would allocate (and on CPU page-fault) a fresh
    full-size tensor per op.
    Inputs: x [b, t, m, d], past [b, ctx, m*d] (no grad), norm weight [m, d], conv weight
    [m*d, 1, kernel]. Outputs: y [b, t, m, d] and full [b, ctx + t, m*d] (no grad; the caller keeps
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

    Per-tap products accumulate chunk by chunk of positions into cache-sized buffers (about 512 KiB
    each), then one sum: a full-size product per tap is written and read back from memory instead
    (2.7x the time at the demo's shapes on CPU).
    """
    b, t, c = gy.shape
    step = step or max(1, min(t, (1 << 17) // max(1, b * c)))  # positions per chunk
    low = gy.dtype in (torch.bfloat16, torch.float16)  # accumulate those in float32, like sum()
    acc = gy.new_empty(kernel, b, step, c, dtype=torch.float32 if low else gy.dtype)
    for j in range(kernel):  # the first chunk (a full one) initialises the buffers
        torch.mul(gy[:, :step], full[:, j * dil: j * dil + step], out=acc[j])
    for a in range(step, t, step):
        n = min(step, t - a)
        for j in range(kernel):
            acc[j, :, :n].addcmul_(gy[:, a:a + n], full[:, a + j * dil: a + j * dil + n])
    return acc.sum((1, 2)).to(gy.dtype)  # [kernel, C]


def _colsum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over b, t of w x: x [b, t, m, d], w [b, t, m] -> [m, d], as m batched (1 x bt) @ (bt x d)
    products (one read of x; (x * w).sum((0, 1)) writes and reads a full temporary)."""
    m, d = x.shape[-2:]
    return torch.bmm(w.reshape(-1, m).t().unsqueeze(1), x.reshape(-1, m, d).transpose(0, 1))[:, 0]


def _rms_scale(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim (nn.RMSNorm's eps=None: dtype eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


class GateFn(torch.autograd.Function):
    """kv [b, t, (m+1)*d] (value, then each branch's key), h [b, t, m, d], norm weights w1 (keys)
    and w2 (hidden) [m, d] -> alpha * v [b, t, m, d] and alpha [b, t, m] (spec 2.7).

    s = <RMSNorm(k) w1, RMSNorm(h) w2> / sqrt(d) = r_k r_h <k, h w1 w2> / sqrt(d): the norms enter
    as per-row scales, so no normalised copy of k or h is made, and the backward writes the value
    and key gradients straight into one [b, t, (m+1)*d] tensor (autograd would fill and add a
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


class Engram(nn.Module):
    """One Engram layer: memory e[t] -> k, v -> gate alpha per branch -> alpha*v + conv(alpha*v).

    Args:
        table: where the rows live (a :class:`TableStore`); None if callers always pass ``memory``.
        head_sizes: per-head table sizes when row ids arrive local per head (demo-v1); None when they
            arrive global (v4.1).
        d_mem: width c of the concatenated memory vector.
        hidden_size: backbone width d.
        hc_mult: residual branches m; each has its own key projection and norms (spec section 2).
        gate: "paper" (sigmoid) or "demo" (signed square root, then sigmoid).
        kernel_size: short conv kernel; 0 drops the conv (v4.1).
        dilation: conv dilation (the paper uses N, the max n-gram order).
        fused: one bias-free projection for value and keys (v4.1) instead of biased nn.Linear's.
        conv_init: "zero" so a new module starts as a pure gated lookup, or "default" (demo).
    """

    def __init__(self, table: TableStore | None, head_sizes: list[int] | None, d_mem: int,
                 hidden_size: int, hc_mult: int = 1, gate: str = "paper", kernel_size: int = 4,
                 dilation: int = 3, fused: bool = False, conv_init: str = "zero"):
        super().__init__()
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if conv_init not in ("zero", "default"):
            raise ValueError(f"conv_init must be 'zero' or 'default', got {conv_init!r}")
        for name, v in (("d_mem", d_mem), ("hidden_size", hidden_size), ("hc_mult", hc_mult)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self.table = table
        self.d_mem, self.hidden_size, self.hc_mult = d_mem, hidden_size, hc_mult
        self.gate, self.fused, self.conv_init = gate, fused, conv_init
        self.head_sizes = list(head_sizes) if head_sizes is not None else None
        if self.head_sizes is not None:
            self.register_buffer("offsets", torch.tensor(head_offsets(self.head_sizes)),
                                 persistent=False)
            self.register_buffer("sizes", torch.tensor(self.head_sizes), persistent=False)
        if fused:
            self.kv_proj = nn.Linear(d_mem, (hc_mult + 1) * hidden_size, bias=False)
        else:
            self.value_proj = nn.Linear(d_mem, hidden_size)
            self.key_projs = nn.ModuleList([nn.Linear(d_mem, hidden_size) for _ in range(hc_mult)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])  # keys
        self.norm2 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])  # hidden
        self.short_conv = (ShortConv(hidden_size, hc_mult, kernel_size, dilation)
                           if kernel_size > 0 else None)
        self._kv_cache: tuple | None = None  # (weights' identity, concatenated W and bias)
        # alpha fixed at this value when set (models/surgery.py: the "w/o gating" ablation and the
        # suppression analyses); the keys and the gate are then skipped.
        self.gate_value: float | None = None
        self.init_weights()

    def init_weights(self) -> None:
        """All initialisation in one place."""
        if self.short_conv is not None and self.conv_init == "zero":
            # Zero conv: Y = alpha * v at the start, so training begins from the plain gated lookup.
            nn.init.zeros_(self.short_conv.conv.weight)

    # -- retrieval --------------------------------------------------------------------------------
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Hash ids [b, t, H] (local or global, as constructed) -> global row ids [b, t, H]."""
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"hash ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() != 3:
            raise ValueError(f"hash ids must have shape [batch, seq, heads], got {tuple(ids.shape)}")
        if self.head_sizes is None:
            return ids.long()
        if ids.shape[-1] != len(self.head_sizes):
            raise ValueError(f"hash ids have {ids.shape[-1]} heads, the table has "
                             f"{len(self.head_sizes)}")
        if ids.numel() and (bool((ids < 0).any()) or bool((ids >= self.sizes).any())):
            raise ValueError("hash ids out of range for their head's table size")
        return ids.long() + self.offsets

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Gather and concatenate the memory vectors: [b, t, H] -> e [b, t, c]."""
        if self.table is None:
            raise RuntimeError("this Engram module has no table: pass memory= instead of ids")
        emb = self.table.lookup(self.rows(ids))  # [b, t, H, e]
        return emb.flatten(-2)  # [b, t, c]

    # -- fusion -----------------------------------------------------------------------------------
    def value_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_V [d, c] (and bias): the value rows alone."""
        if self.fused:
            bias = self.kv_proj.bias
            return (self.kv_proj.weight[: self.hidden_size],
                    None if bias is None else bias[: self.hidden_size])
        return self.value_proj.weight, self.value_proj.bias

    def kv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_V and every branch's W_K as one matrix [(m+1)*d, c] (and bias), value rows first.

        The paper fuses them into one GEMM; the demo profile keeps its official separate
        nn.Linear's (so its checkpoints load as they are) and is concatenated here, per call.
        """
        if self.fused:
            return self.kv_proj.weight, self.kv_proj.bias
        projs = [self.value_proj, *self.key_projs]
        params = [p.weight for p in projs] + [p.bias for p in projs]
        # Without autograd (decode, eval) the concatenation is kept until a weight changes: a decode
        # step would otherwise copy all of W_V and W_K for a handful of tokens.
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        if not torch.is_grad_enabled() and self._kv_cache is not None and self._kv_cache[0] == key:
            return self._kv_cache[1]
        out = (torch.cat(params[:len(projs)]), torch.cat(params[len(projs):]))
        self._kv_cache = (key, tuple(x.detach() for x in out)) if not torch.is_grad_enabled() else None
        return out

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor | None = None, *,
                memory: torch.Tensor | None = None, state: EngramState | None = None,
                return_gate: bool = False):
        """hidden [b, t, d] or [b, t, m, d] -> Y of the same shape (and alpha [b, t, m])."""
        flat = hidden.dim() == 3
        if flat and self.hc_mult != 1:
            raise ValueError(f"hc_mult={self.hc_mult}: pass hidden as [b, t, m, d]")
        h = hidden.unsqueeze(2) if flat else hidden  # [b, t, m, d]
        if h.dim() != 4 or h.shape[2] != self.hc_mult or h.shape[3] != self.hidden_size:
            raise ValueError(f"hidden must be [b, t, {self.hidden_size}] or "
                             f"[b, t, {self.hc_mult}, {self.hidden_size}], got {tuple(hidden.shape)}")
        e = self.read(ids) if memory is None else memory  # [b, t, c]
        if e.shape != (*h.shape[:2], self.d_mem):
            raise ValueError(f"memory must be {(*h.shape[:2], self.d_mem)}, got {tuple(e.shape)}")
        e = e.to(h.dtype)
        if self.gate_value is not None:
            v = F.linear(e, *self.value_weights())  # [b, t, d]
            alpha = v.new_full(h.shape[:3], self.gate_value)  # [b, t, m]
            vt = alpha.unsqueeze(-1) * v.unsqueeze(2)  # [b, t, m, d]
        else:
            kv = F.linear(e, *self.kv_weights())  # [b, t, (m+1)*d]: value and all keys, one GEMM
            # Context-aware gate (paper eq. 4): the hidden state, which has seen the whole
            # context, decides whether the static n-gram memory fits here; a collided or off-topic
            # row is damped.
            w1 = torch.stack([n.weight for n in self.norm1])  # [m, d]: each branch its own norms
            w2 = torch.stack([n.weight for n in self.norm2])  # [m, d]
            vt, alpha = GateFn.apply(kv, h, w1, w2, self.norm1[0].eps, self.norm2[0].eps,
                                     self.gate)
        y = vt if self.short_conv is None else self.short_conv(vt, state, residual=True)  # V~ + conv
        y = y.squeeze(2) if flat else y
        return (y, alpha) if return_gate else y

    def extra_repr(self) -> str:
        return (f"d_mem={self.d_mem}, hidden={self.hidden_size}, hc_mult={self.hc_mult}, "
                f"gate={self.gate}, fused={self.fused}, local_ids={self.head_sizes is not None}")


def build_engram(config: EngramConfig, layer_id: int, hidden_size: int, hc_mult: int = 1, *,
                 gate: str | None = None, conv: bool | None = None, conv_init: str = "zero",
                 table: TableStore | None | str = "memory", sparse: bool = False,
                 init_std: float = 1.0) -> Engram:
    """Map a config to the module for one layer, with the profile's defaults.

    ``table="memory"`` allocates an in-memory table of the layer's full size; pass a store to put
    the rows elsewhere, or None to always feed ``memory=`` yourself.
    """
    sizes = prime_table_sizes(config)
    if layer_id not in sizes:
        raise KeyError(f"layer {layer_id} is not in layer_ids={config.layer_ids}")
    heads = [p for order in sizes[layer_id] for p in order]
    v41 = config.profile == "v4.1"
    if isinstance(table, str):
        if table != "memory":
            raise ValueError(f"table must be 'memory', a TableStore or None, got {table!r}")
        table = MemoryTable(sum(heads), config.head_dim, sparse=sparse, init_std=init_std)
    elif table is not None and (table.num_rows != sum(heads) or table.dim != config.head_dim):
        raise ValueError(f"store is {table.num_rows} x {table.dim}, layer {layer_id} needs "
                         f"{sum(heads)} x {config.head_dim}")
    use_conv = (not v41) if conv is None else conv
    return Engram(
        table, None if config.global_row_ids else heads, config.d_mem, hidden_size, hc_mult,
        gate=gate or ("paper" if v41 else "demo"),
        kernel_size=config.kernel_size if use_conv else 0, dilation=config.max_ngram_size,
        fused=v41, conv_init=conv_init)
