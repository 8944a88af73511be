"""Building blocks of the reference LM: RoPE attention, SwiGLU, MoE, hyper-connections, the block.

The block is written once: the attention proper (``Attend``) and the Engram read (``Memory``) come
in as arguments, so a full forward, a cached decode and a paged serving engine share everything else
(the structure of nano-vllm, whose models call an attention layer that owns the KV cache).

Shape legend:
    b batch, t new positions (all of them in a full forward, the new ones in a cached decode),
    s cached positions so far + t, d model width, h attention heads, e head dim (d / h),
    m residual branches (hyper-connections), n = ``b*t`` tokens, E routed experts, k experts per token,
    f expert / FFN hidden width.

Modules take plain arguments and leave initialisation to ``EngramLM.init_weights`` (one place);
parameters created here with ``torch.empty`` are meaningless until it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..compute.gemm import Linear, adopt, linear
from ..module import Engram, EngramState


# -- rotary position embedding ---------------------------------------------------------------------
def rope_tables(max_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, e/2] for the half-split (rotate-half) RoPE layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [max_len, e/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, t, h, e] rotated by the angles of its absolute positions; cos, sin [t, e/2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [b, t, h, e/2] each
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [t, 1, e/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attend(Protocol):
    """The attention proper, bound to one layer and one step by whoever keeps the keys and values:
    q, k, v [b, t, h, e] (projected, RoPE applied) -> [b, t, h, e]. ``causal_attention`` for a
    full forward, ``CacheAttention`` for a contiguous decode cache, a paged engine's own
    (serving/paged.py); the block around it (norms, projections, RoPE, residuals) is shared."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention over the t positions given, nothing cached: [b, t, h, e] -> same."""
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, h, t, e]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # [b, t, h, e]


@dataclass
class CacheAttention:
    """Causal attention continuing a preallocated cache: ``keys``, ``values`` [b, h, max_len, e]
    hold positions < pos; the new ones are written in place at pos..pos+t-1."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos, t = self.pos, q.shape[1]
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, h, t, e]
        self.keys[:, :, pos:pos + t] = k
        self.values[:, :, pos:pos + t] = v
        k, v = self.keys[:, :, :pos + t], self.values[:, :, :pos + t]  # [b, h, s, e]
        mask = None
        if t > 1:
            # New query i sits at pos+i and may see every key up to and including itself.
            qpos = torch.arange(pos, pos + t, device=q.device)[:, None]
            mask = qpos >= torch.arange(pos + t, device=q.device)[None, :]  # [t, s]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)  # [b,t,h,e]


class Attention(nn.Module):
    """Multi-head self-attention with RoPE; the attention proper (and any KV cache) is passed in."""

    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.dim, self.n_head, self.head_dim = dim, n_head, dim // n_head
        self.qkv = Linear(dim, 3 * dim, bias=False)
        self.proj = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend = causal_attention) -> torch.Tensor:
        """x [b, t, d] at the positions of cos, sin [t, e/2] -> [b, t, d]."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.head_dim).unbind(2)  # [b, t, h, e]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v)  # [b, t, h, e]
        return self.proj(y.reshape(b, t, self.dim))  # [b, t, d]


# -- feed-forward ----------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    """w2(SiLU(w1 x) * w3 x) (Shazeer 2020), the FFN of LLaMA/DeepSeek."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """DeepSeekMoE: always-on shared experts plus top-k routed SwiGLU experts.

    Gate: softmax over all routed experts, then top-k; with k > 1 the chosen weights are
    renormalised to sum to 1 (DeepSeek-V2/V3), with k = 1 the raw probability is kept so the router
    still gets a gradient (Switch Transformer). The load-balancing loss is DeepSeek's expert-level
    one, ``coef * sum_i f_i P_i`` with ``f_i = E/(k n) * #tokens routed to i`` and ``P_i`` the mean
    router probability; it equals ``coef`` when the load is perfectly balanced.

    The n_shared shared experts are one SwiGLU of width n_shared * f (the same function and count).
    Routed experts are stacked tensors so the dispatch sorts token slots by expert and runs one
    matmul per expert, never a loop over tokens.
    """

    def __init__(self, dim: int, n_routed: int, n_shared: int, top_k: int, d_expert: int,
                 aux_loss_coef: float = 0.0):
        super().__init__()
        self.dim, self.n_routed, self.n_shared, self.top_k = dim, n_routed, n_shared, top_k
        self.d_expert, self.aux_loss_coef = d_expert, aux_loss_coef
        self.router = Linear(dim, n_routed, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_routed, d_expert, dim))  # [E, f, d] gate
        self.w3 = nn.Parameter(torch.empty(n_routed, d_expert, dim))  # [E, f, d] up
        self.w2 = nn.Parameter(torch.empty(n_routed, dim, d_expert))  # [E, d, f] down
        self.shared = SwiGLU(dim, n_shared * d_expert) if n_shared > 0 else None

    @property
    def params_per_expert(self) -> int:
        return 3 * self.dim * self.d_expert

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, d] -> probabilities [n, E], top-k weights [n, k], top-k expert ids [n, k]."""
        probs = self.router(x).float().softmax(dim=-1)  # [n, E]; fp32 so routing is stable
        weights, idx = probs.topk(self.top_k, dim=-1)  # [n, k]
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, idx

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, t, d] -> (y [b, t, d], scaled load-balancing loss, a scalar)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)  # [n, d]
        n, k = x.shape[0], self.top_k
        probs, weights, idx = self.route(x)
        flat = idx.flatten()  # [n*k] expert of each (token, slot)
        order = flat.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_routed)  # [E]
        token = order // k  # [n*k] token of each sorted slot
        chunks = x[token].split(counts.tolist())  # E pieces [c_i, d]
        # unbind, not w1[i]: each w1[i]'s backward would fill and add a whole [E, f, d] zero tensor
        # (E times per step); unbind's backward stacks the E expert grads once.
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        out = [linear(F.silu(linear(c, w1[i])) * linear(c, w3[i]), w2[i])
               for i, c in enumerate(chunks)]
        ys = torch.cat(out) * weights.flatten()[order].unsqueeze(-1).to(x.dtype)  # [n*k, d]
        y = x.new_zeros(n, self.dim).index_add_(0, token, ys)  # [n, d]
        if self.shared is not None:
            y = y + self.shared(x)
        load = counts.to(probs.dtype) * (self.n_routed / max(1, n * k))  # f_i [E]
        aux = self.aux_loss_coef * (load * probs.mean(dim=0)).sum()
        return y.view(shape), aux.to(x.dtype)


# -- hyper-connections -----------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """Static hyper-connection around one sublayer (Zhu et al. 2024, "Hyper-Connections", SHC).

    The residual stream is m branches H [b, t, m, d]. The sublayer reads a learned mix of them,
    ``x = sum_i a_i H_i``, and each branch is updated as ``H'_j = sum_i R_ij H_i + w_j T(x)``:
    R mixes the branches (width connections), w writes the output back (depth connections). The
    dynamic (input-dependent) variant and the manifold constraint of the paper's mHC are left out.

    Initialised as in the HC paper: a = one-hot(index mod m), R = I, w = 1. With the stream started
    as m copies of the embedding every branch then equals the plain residual stream.
    """

    def __init__(self, hc_mult: int, index: int):
        super().__init__()
        self.hc_mult, self.index = hc_mult, index  # index: the sublayer's position in the network
        self.mix = nn.Parameter(torch.empty(hc_mult))  # a [m]
        self.res = nn.Parameter(torch.empty(hc_mult, hc_mult))  # R [m, m]
        self.out = nn.Parameter(torch.empty(hc_mult))  # w [m]

    # Both in the residual stream's dtype even under autocast (bf16/fp16 runs), as a plain
    # residual's "+" is: autocast would round the branches to bf16 in the einsum's product.
    def read(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return torch.einsum("btmd,m->btd", h, self.mix.to(h.dtype))  # [b, t, m, d] -> [b, t, d]

    def write(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """h [b, t, m, d], sublayer output y [b, t, d] -> [b, t, m, d]."""
        with torch.autocast(h.device.type, enabled=False):
            mixed = torch.einsum("btmd,mn->btnd", h, self.res.to(h.dtype))
            return mixed + y.to(h.dtype).unsqueeze(2) * self.out.to(h.dtype)[:, None]

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, index={self.index}"


# -- the block -------------------------------------------------------------------------------------
class Memory(Protocol):
    """How a block's Engram layer reads, bound to one layer and one step: (engram, h [b, t, (m,) d])
    -> (Y like h, alpha [b, t, m] or None). The reference model reads a batch from hash ids and its
    decode state (``engram_memory``); a paged engine per request, from its slots."""

    def __call__(self, engram: Engram, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...


def engram_memory(ids: torch.Tensor, state: EngramState | None = None,
                  return_gate: bool = False, alive: torch.Tensor | None = None) -> Memory:
    """Read a layer's rows for hash ids [b, t, H], continuing ``state`` (a cached decode);
    ``alive`` [b, t]: Engram's token mask (False: no residual there, Engram.forward)."""
    def read(engram: Engram, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = engram(h, ids, state=state, return_gate=return_gate, alive=alive)
        return y if return_gate else (y, None)
    return read


class Block(nn.Module):
    """[Engram ->] attention -> FFN/MoE, each added to the residual stream (or its m branches).

    The one forward of a block: the full forward, a cached decode and a paged serving engine all run
    it, each passing the attention proper (``Attend``) and the Engram read (``Memory``)
    that fit how it keeps its history."""

    def __init__(self, dim: int, n_head: int, ffn: nn.Module, *, norm_eps: float = 1e-5,
                 engram: Engram | None = None, hc_mult: int = 1, index: int = 0):
        super().__init__()
        self.engram = engram
        self.attn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, n_head)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn = ffn
        # HC counts attention and FFN as separate layers (2 per block) for its one-hot init.
        self.attn_hc = HyperConnection(hc_mult, 2 * index) if hc_mult > 1 else None
        self.ffn_hc = HyperConnection(hc_mult, 2 * index + 1) if hc_mult > 1 else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend = causal_attention, memory: Memory | None = None):
        """h [b, t, d] (or [b, t, m, d]) at the positions of cos, sin [t, e/2]
        -> (h, aux loss or None, alpha [b, t, m] or None)."""
        gate = None
        if self.engram is not None:
            if memory is None:
                raise ValueError("this block has an Engram layer: pass memory= (how it reads its "
                                 "rows, e.g. engram_memory(hash_ids))")
            # Paper 2.1: H <- H + Y, before attention and FFN; with m branches (2.4) Y is [b,t,m,d].
            y, gate = memory(self.engram, h)
            h = h + y
        x = h if self.attn_hc is None else self.attn_hc.read(h)  # [b, t, d]
        y = self.attn(self.attn_norm(x), cos, sin, attend)
        h = h + y if self.attn_hc is None else self.attn_hc.write(h, y)
        x = h if self.ffn_hc is None else self.ffn_hc.read(h)  # [b, t, d]
        aux = None
        if isinstance(self.ffn, MoE):
            y, aux = self.ffn(self.ffn_norm(x))
        else:
            y = self.ffn(self.ffn_norm(x))
        h = h + y if self.ffn_hc is None else self.ffn_hc.write(h, y)
        return h, aux, gate


# -- adaptive softmax head -------------------------------------------------------------------------
class AdaptiveHead(nn.Module):
    """Adaptive softmax (Grave et al. 2017) over the model vocabulary, for CPU-sized training.

    A full softmax over a 38k-id vocabulary is ~85% of a small model's FLOPs on CPU. The adaptive
    head keeps a full-width softmax for the ``cutoffs[0]`` most frequent ids plus one entry per tail
    cluster; a tail cluster's ids get a softmax at width d / div^i, computed only for the tokens
    whose target lies in it. It is still an exact distribution over every id, so losses stay
    comparable nats. ``rank`` maps model ids to frequency rank (the class order the cutoffs refer
    to); it is a buffer, saved with the model, set from training-set counts by ``set_frequencies``.
    """

    def __init__(self, dim: int, vocab_size: int, cutoffs: tuple[int, ...], div_value: float):
        super().__init__()
        # adopt: its head and tail projections take the package's GEMM path (engram/compute/gemm.py)
        self.asm = adopt(nn.AdaptiveLogSoftmaxWithLoss(dim, vocab_size, list(cutoffs),
                                                       div_value=div_value, head_bias=False))
        self.register_buffer("rank", torch.arange(vocab_size))  # [V] model id -> class index

    @torch.no_grad()
    def set_frequencies(self, counts: torch.Tensor) -> None:
        """counts [V] (how often each model id occurs in the training text) -> ``rank``."""
        if counts.shape != self.rank.shape:
            raise ValueError(f"counts must have shape {tuple(self.rank.shape)}, got "
                             f"{tuple(counts.shape)}")
        order = torch.argsort(-counts.double(), stable=True)  # [V] class index -> model id
        self.rank[order] = torch.arange(len(order), device=self.rank.device)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> log-probabilities [..., V] in model-id order."""
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):  # see token_nll
                return self.log_probs(x.float())
        lp = self.asm.log_prob(x.reshape(-1, x.shape[-1]))  # [n, V] in class order
        return lp.index_select(1, self.rank).view(*x.shape[:-1], -1)

    def token_nll(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """x [n, d], targets [n] model ids -> negative log-likelihood [n]."""
        if torch.is_autocast_enabled(x.device.type):
            # In float32 under autocast (bf16/fp16 runs), as autocast keeps every loss: torch's
            # adaptive softmax also writes its low-precision cluster outputs into a float32 buffer
            # (index_copy_), which refuses mixed dtypes.
            with torch.autocast(x.device.type, enabled=False):
                return self.token_nll(x.float(), targets)
        return -self.asm(x, self.rank[targets]).output
