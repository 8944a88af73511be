"""The Engram module: lookup -> context-aware gate -> short causal conv (paper section 2.3).

Shape legend:
    b batch, t positions, m residual branches (hyper-connections; 1 for a plain residual),
    d backbone hidden size, H hash heads per layer, e head dim, c = H * e = (N-1) * d_ngram (d_mem).

The module returns the residual Y; the caller adds it (H <- H + Y) before attention and FFN.
Row ids come in from outside (computed from token ids by ``engram.NgramHasher``), or the caller
passes the gathered memory vectors directly, so the table itself can live anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compute.gemm import linear
from ..retrieval.config import EngramConfig
from ..retrieval.primes import head_offsets, prime_table_sizes
from ..tables.store import MemoryTable, TableStore
from . import fused as fused_kernels
from .conv import EngramState, ShortConv
from .gate import GATES, GateFn, gate_plain

# Each profile's gate and gate-norm eps (spec section 3). v4.1 follows vLLM 0.32.0's DeepSeek-V4.1
# Engram: the signed square root before the sigmoid ("matching the training kernel") and both norms
# at the model's rms_norm_eps (1e-6 in DeepSeek-V4's config). demo-v1: the official demo's gate and
# nn.RMSNorm's default eps (None: the dtype's machine eps).
PROFILE_GATE = {"demo-v1": "demo", "v4.1": "demo"}
PROFILE_NORM_EPS: dict[str, float | None] = {"demo-v1": None, "v4.1": 1e-6}
# What the v4.1 profile was before it matched the engine (the plain sigmoid, the dtype's eps): a
# saved model config without a recorded gate and eps was trained with these (models/model_config).
LEGACY_V41_GATE, LEGACY_V41_NORM_EPS = "paper", float(torch.finfo(torch.float32).eps)


class Engram(nn.Module):
    """One Engram layer: memory e[t] -> k, v -> gate alpha per branch -> ``alpha*v`` + ``conv(alpha*v)``.

    Its arguments:

    - ``table``: where the rows live (a ``TableStore``); None if callers always pass ``memory``.
    - ``head_sizes``: per-head table sizes when row ids arrive local per head (demo-v1); None when they
      arrive global (v4.1).
    - ``d_mem``: width c of the concatenated memory vector.
    - ``hidden_size``: backbone width d.
    - ``hc_mult``: residual branches m; each has its own key projection and norms (spec section 2).
    - ``gate``: "paper" (sigmoid) or "demo" (signed square root, then sigmoid).
    - ``norm_eps``: eps of the gate's key and hidden RMSNorms (None: the dtype's, as nn.RMSNorm).
    - ``kernel_size``: short conv kernel; 0 drops the conv (v4.1).
    - ``dilation``: conv dilation (the paper uses N, the max n-gram order).
    - ``fused``: one bias-free projection for value and keys (v4.1) instead of biased nn.Linear's.
    - ``conv_init``: "zero" so a new module starts as a pure gated lookup, or "default" (demo).
    - ``kernels``: on CPU in float32, run the gate and conv as compiled kernels (module/fused.py;
      equal to the torch path to ~1e-6, not to the bit) as the process's fused.plan() says,
      or as a given fused.Plan says; False: always the torch path.
    - ``head_gain``: a learned gain per hash head on the rows read (starts at 1); a control for
      frozen tables (studies/compare.py "frozen-scaled"), so that fixed random rows are not
      handicapped by their init scale. Needs per-head table sizes.
    """

    def __init__(self, table: TableStore | None, head_sizes: list[int] | None, d_mem: int,
                 hidden_size: int, hc_mult: int = 1, gate: str = "paper", kernel_size: int = 4,
                 dilation: int = 3, fused: bool = False, conv_init: str = "zero",
                 kernels: bool = True, norm_eps: float | None = None, head_gain: bool = False):
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
        self.gate, self.fused, self.conv_init, self.kernels = gate, fused, conv_init, kernels
        self.head_sizes = list(head_sizes) if head_sizes is not None else None
        self.make_head_buffers()
        if fused:
            self.kv_proj = nn.Linear(d_mem, (hc_mult + 1) * hidden_size, bias=False)
        else:
            self.value_proj = nn.Linear(d_mem, hidden_size)
            self.key_projs = nn.ModuleList([nn.Linear(d_mem, hidden_size) for _ in range(hc_mult)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps)
                                    for _ in range(hc_mult)])  # keys
        self.norm2 = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps)
                                    for _ in range(hc_mult)])  # hidden
        self.short_conv = (ShortConv(hidden_size, hc_mult, kernel_size, dilation)
                           if kernel_size > 0 else None)
        if head_gain and self.head_sizes is None:
            raise ValueError("head_gain needs per-head table sizes (head_sizes)")
        # [H]: counted with the tables (EngramLM.param_counts): it rescales rows, no product
        self.head_gain = nn.Parameter(torch.ones(len(self.head_sizes))) if head_gain else None
        self._kv_cache: tuple | None = None  # (weights' identity, concatenated W and bias)
        # alpha fixed at this value when set (models/surgery.py: the "w/o gating" ablation and the
        # suppression analyses); the keys and the gate are then skipped.
        self.gate_value: float | None = None
        self.init_weights()

    def make_head_buffers(self) -> None:
        """The per-head row offsets and sizes (from ``head_sizes``; no state holds them): made
        here, and again by a model built on meta once its state is loaded (models/model.py)."""
        if self.head_sizes is not None:
            self.register_buffer("offsets", torch.tensor(head_offsets(self.head_sizes)),
                                 persistent=False)
            self.register_buffer("sizes", torch.tensor(self.head_sizes), persistent=False)

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
        if ids.numel() and not torch.compiler.is_compiling() and (  # eager only: a graph break
                bool((ids < 0).any()) or bool((ids >= self.sizes).any())):
            raise ValueError("hash ids out of range for their head's table size")
        return ids.long() + self.offsets

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Gather and concatenate the memory vectors: [b, t, H] -> e [b, t, c]."""
        if torch.compiler.is_compiling():
            # Outside torch.compile's graph: it takes neither a sparse row gradient nor a store
            # on another tier (file reads, collectives); the compiled code resumes after it.
            return (_EAGER_READ or torch.compiler.disable(Engram._read))(self, ids)
        return self._read(ids)

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
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
        """W_V and every branch's W_K as one matrix [``(m+1)*d``, c] (and bias), value rows first.

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
                return_gate: bool = False, alive: torch.Tensor | None = None):
        """hidden [b, t, d] or [b, t, m, d] -> Y of the same shape (and alpha [b, t, m]).

        ``alive`` [b, t] (bool or 0/1): positions outside the sequence (padding, a trigger's span,
        DeepSeek-V4.1's image tokens) contribute V~ = 0, so they add no value residual and feed the
        short conv zeros, exactly what it sees before a sequence start; without a conv (v4.1) such
        a position passes through untouched, as the engine's token mask does. alpha itself is
        returned unmasked.
        """
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
        e = e.to(h.device, h.dtype)  # rows from a tier on another device, or stored in bf16
        if self.head_gain is not None:
            g = self.head_gain.to(e.dtype)
            e = (e.unflatten(-1, (g.numel(), -1)) * g[:, None]).flatten(-2)  # [b, t, H, e] -> c
        if alive is not None and alive.shape != h.shape[:2]:
            raise ValueError(f"alive must be {tuple(h.shape[:2])}, got {tuple(alive.shape)}")
        # [b, t, (m+1)*d]: value and all keys, one GEMM (a fixed gate: the value alone, [b, t, d])
        kv = linear(e, *(self.kv_weights() if self.gate_value is None else self.value_weights()))
        if torch.is_autocast_enabled(h.device.type):
            # Under autocast (bf16/fp16) only the GEMM above runs in low precision: the gate's
            # norms and sigmoid, the conv's norm and SiLU run in float32 (on CPU: the fused
            # kernels), as autocast itself keeps norms and softmax in float32.
            with torch.autocast(h.device.type, enabled=False):
                y, alpha = self._after_gemm(kv.float(), h.float(), state, alive)
        else:
            y, alpha = self._after_gemm(kv, h, state, alive)
        y = y.squeeze(2) if flat else y
        return (y, alpha) if return_gate else y

    def _after_gemm(self, kv: torch.Tensor, h: torch.Tensor, state: EngramState | None,
                    alive: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [b, t, ``(m+1)*d``] (the value alone, [b, t, d], with a fixed gate), h [b, t, m, d]
        -> Y [b, t, m, d] (gate, V~ = alpha v, V~ + conv), alpha [b, t, m]."""
        if self.gate_value is not None:
            alpha = kv.new_full(h.shape[:3], self.gate_value)  # [b, t, m]
            vt = alpha.unsqueeze(-1) * kv.unsqueeze(2)  # [b, t, m, d]
        else:
            # Context-aware gate (paper eq. 4): the hidden state, which has seen the whole
            # context, decides whether the static n-gram memory fits here; a collided or off-topic
            # row is damped.
            w1 = torch.stack([n.weight for n in self.norm1])  # [m, d]: each branch its own norms
            w2 = torch.stack([n.weight for n in self.norm2])  # [m, d]
            if self._kernels_fit(kv, h):
                return self._fused(kv, h, w1, w2, state, alive)
            gate = gate_plain if torch.compiler.is_compiling() else GateFn.apply
            vt, alpha = gate(kv, h, w1, w2, self.norm1[0].eps, self.norm2[0].eps, self.gate)
        if alive is not None:
            vt = vt * alive[:, :, None, None].to(vt.dtype)  # [b, t, m, d]
        y = vt if self.short_conv is None else self.short_conv(vt, state, residual=True)  # V~ + conv
        return y, alpha

    def _kernels_fit(self, kv: torch.Tensor, h: torch.Tensor) -> bool:
        # Under torch.compile the torch path (GateFn, ConvFn) is traced and fused by the compiler
        # itself; the kernels' numba calls would only break its graph.
        if not self.kernels or h.numel() == 0 or torch.compiler.is_compiling():
            return False
        sc = self.short_conv
        if sc is None:
            return fused_kernels.fits(kv, h)
        # A user's hook on the short conv must see its input, which only the torch path computes
        # as a tensor of its own (padding goes in as ``alive``, not as a hook).
        hooked = bool(sc._forward_pre_hooks or sc._forward_hooks)
        return not hooked and fused_kernels.fits(kv, h, kernel_size=sc.kernel_size)

    def _fused(self, kv: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               state: EngramState | None, alive: torch.Tensor | None):
        """The gate and conv after the GEMM as compiled kernels (module/fused.py): Y, alpha."""
        live = h.new_ones(h.shape[:2]) if alive is None else alive.to(h.dtype)  # [b, t]
        eps1, eps2 = self.norm1[0].eps, self.norm2[0].eps
        plan = self.kernels if isinstance(self.kernels, fused_kernels.Plan) else None
        sc = self.short_conv
        if sc is None:
            opts = fused_kernels.Options(self.gate, (eps1, eps2, None), plan=plan)
            y, alpha, _ = fused_kernels.gate_conv(kv, h, w1, w2, live, None, opts)
            return y, alpha
        opts = fused_kernels.Options(self.gate, (eps1, eps2, sc.norms[0].eps), sc.dilation,
                                     keep_inputs=state is not None, plan=plan)
        conv = fused_kernels.Conv(sc.norm_weight(), sc.conv.weight, sc.past(h, state))
        y, alpha, full = fused_kernels.gate_conv(kv, h, w1, w2, live, conv, opts)
        sc.remember(full, state)
        return y, alpha

    def extra_repr(self) -> str:
        return (f"d_mem={self.d_mem}, hidden={self.hidden_size}, hc_mult={self.hc_mult}, "
                f"gate={self.gate}, eps={self.norm1[0].eps}, fused={self.fused}, "
                f"local_ids={self.head_sizes is not None}")


_EAGER_READ = None  # Engram._read as torch.compile runs it: eagerly, a graph break (compile_ready)


def compile_ready() -> None:
    """Before torch.compile traces a model with Engram layers: their table reads run outside the
    graph (made here, not at import: torch.compiler.disable imports torch._dynamo, ~1 s, which
    only a compiled model needs; without this call each trace makes it, one more graph break)."""
    global _EAGER_READ
    if _EAGER_READ is None:
        _EAGER_READ = torch.compiler.disable(Engram._read)


def build_engram(config: EngramConfig, layer_id: int, hidden_size: int, hc_mult: int = 1, *,
                 gate: str | None = None, conv: bool | None = None, conv_init: str = "zero",
                 table: TableStore | None | str = "memory", sparse: bool = False,
                 init_std: float = 1.0, norm_eps: float | None = None,
                 head_gain: bool = False) -> Engram:
    """Map a config to the module for one layer, with the profile's defaults (``gate`` and
    ``norm_eps`` None: PROFILE_GATE, PROFILE_NORM_EPS).

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
        gate=gate or PROFILE_GATE[config.profile],
        kernel_size=config.kernel_size if use_conv else 0, dilation=config.max_ngram_size,
        fused=v41, conv_init=conv_init,
        norm_eps=PROFILE_NORM_EPS[config.profile] if norm_eps is None else norm_eps,
        head_gain=head_gain)
