"""The reference decoder-only LM with Engram at chosen layers (paper section 2.1, figure 1).

token embedding -> blocks -> final RMSNorm -> LM head (a full softmax, or an adaptive softmax that
costs a fraction on CPU and is still exact). A block is, in order:
    H <- H + Engram(H, hash ids)   (Engram layers only: the memory is added before attention & FFN)
    H <- H + Attention(RMSNorm(H))  (RoPE, causal)
    H <- H + FFN(RMSNorm(H))        (SwiGLU, or shared + routed top-k experts)
With hyper-connections (hc_mult = m > 1) H is m branches and each "+" is a hyper-connection
(``engram.models.layers.HyperConnection``); Engram then sees all branches and gates each one separately.

Hash ids are computed outside (data loader, serving engine) from raw token ids; the model never
hashes, so the tables' rows are known, and can be prefetched, before the forward pass.

``EngramLM.trunk`` is the one path from tokens to final hidden states: ``forward`` runs it with
full causal attention or a ``DecodeCache``, a paged serving engine (serving/paged.py) with its own
attention and Engram history.

Shape legend:
    b batch, t new positions, d model width, m residual branches, V model vocabulary,
    H hash heads per Engram layer, h attention heads, e head dim.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from ..compute.gemm import Linear
from ..module import Engram, EngramState, build_engram
from ..module.engram import compile_ready
from ..tables.store import TableStore
from .cache import DecodeCache
from .layers import (AdaptiveHead, Attend, Block, Memory, MoE, SwiGLU, causal_attention,
                     engram_memory, rope_tables)
from .model_config import ModelConfig
from .surgery import fix_gate, share_key

__all__ = ["EngramLM", "ModelConfig", "ModelOutput", "build_block", "build_ffn"]


@dataclass
class ModelOutput:
    """What ``EngramLM.forward`` returns: the final hidden states, the MoE auxiliary loss,
    the gates when asked for, and the head that turns hidden states into logits."""

    hidden: torch.Tensor  # [b, t, d] after the final norm
    aux_loss: torch.Tensor  # scalar: MoE load-balancing loss (already weighted), 0 without MoE
    gates: dict[int, torch.Tensor] | None = None  # {layer: alpha [b, t, m]} when asked
    head: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)

    @cached_property
    def logits(self) -> torch.Tensor:
        """[b, t, V], computed on first use (training losses never need them with the adaptive
        head); with the adaptive head they are log-probabilities, which softmax/argmax take as is."""
        return self.head(self.hidden)


def build_ffn(config: ModelConfig, layer: int) -> nn.Module:
    if config.is_moe_layer(layer):
        return MoE(config.d_model, config.n_routed_experts, config.n_shared_experts, config.top_k,
                   config.d_expert, config.aux_loss_coef)
    return SwiGLU(config.d_model, config.d_ff)


def build_block(config: ModelConfig, layer: int,
                table: TableStore | None | str = "memory") -> Block:
    engram = None
    if layer in config.engram_layers:
        engram = build_engram(config.engram, layer, config.d_model, config.hc_mult,
                              gate=config.engram_gate, conv=config.engram_conv, table=table,
                              sparse=config.sparse_tables, init_std=config.table_init_std,
                              norm_eps=config.engram_norm_eps,
                              head_gain=config.engram_head_gain)
    return Block(config.d_model, config.n_head, build_ffn(config, layer), norm_eps=config.norm_eps,
                 engram=engram, hc_mult=config.hc_mult, index=layer)


class EngramLM(nn.Module):
    """Decoder-only LM; ``tables`` puts given layers' rows in another store (kept as it is)."""

    def __init__(self, config: ModelConfig, tables: dict[int, TableStore | None] | None = None,
                 *, init: bool = True):
        """``init=False``: a model whose values a state dict will give (opening a saved run):
        built on the meta device (the small adaptive head aside), nothing drawn from the global
        generator, and its first ``load_state_dict`` takes the state's tensors as its own
        (``tables``, outside stores, stay as they are)."""
        super().__init__()
        # One draw from the global generator (what the caller seeded), before any module is built:
        # every parameter's init is then drawn from (this, its name) alone (init_weights), so two
        # models that differ in one part share every other initial parameter bit for bit.
        # Opening draws nothing (issue 48): the global generator is the caller's, untouched.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu")) if init else None
        tables = dict(tables or {})
        extra = sorted(set(tables) - set(config.engram_layers))
        if extra:
            raise ValueError(f"tables given for layers {extra} without Engram "
                             f"(Engram layers: {config.engram_layers})")
        self.config = config
        self._own_tables = [i for i in config.engram_layers if i not in tables]
        self._unloaded = not init  # on meta until load_state_dict (gpt-fast's _load_model)
        with nullcontext() if init else torch.device("meta"):
            # On meta, nn.Embedding's own normal_ would load torch's Python meta kernels (sympy,
            # about 2 s a process): given its weight, it draws nothing.
            shape = (config.vocab_size, config.d_model)
            self.embed = (nn.Embedding(*shape) if init else
                          nn.Embedding(*shape, _weight=torch.empty(shape)))
            self.blocks = nn.ModuleList([build_block(config, i, tables.get(i, "memory"))
                                         for i in range(config.n_layer)])
            for engram in self.engrams().values():  # ablations (paper table 5), off by default
                if config.engram_fixed_gate:
                    fix_gate(engram)
                if config.engram_shared_key:
                    share_key(engram)
            self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
            if config.head != "adaptive":
                self.head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.head == "adaptive":
            # Off meta when opening: its rank buffer's arange has only a Python meta kernel (sympy
            # again); the head is small, drawn under a forked generator (the caller's untouched).
            with nullcontext() if init else torch.random.fork_rng(devices=[]):
                self.head = AdaptiveHead(config.d_model, config.vocab_size, config.head_cutoffs,
                                         config.head_div)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        # In the caller's device context, off meta: no checkpoint holds the rotary tables.
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, e/2]
        self.register_buffer("rope_sin", sin, persistent=False)
        if init:
            self.init_weights()

    # -- initialisation (all of it) ----------------------------------------------------------------
    def generator(self, name: str) -> torch.Generator:
        """The generator parameter ``name`` is initialised from: seeded by (init_seed, name), so
        an arm that changes one part (a table's size, an FFN's width) redraws that part alone."""
        digest = hashlib.blake2b(f"{self.init_seed}:{name}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)

    @torch.no_grad()
    def init_weights(self) -> None:
        c = self.config
        std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layer)  # GPT-2 residual scaling
        names = {id(p): n for n, p in self.named_parameters()}

        def normal_(w: torch.Tensor, std: float) -> None:
            if not w.is_meta:  # built on meta (parameter counts): nothing to draw
                w.normal_(0.0, std, generator=self.generator(names[id(w)]))

        normal_(self.embed.weight, std)
        if not c.tie_embeddings:
            for module in self.head.modules():
                if isinstance(module, nn.Linear):
                    normal_(module.weight, std)
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for i, block in enumerate(self.blocks):
            normal_(block.attn.qkv.weight, std)
            normal_(block.attn.proj.weight, out_std)
            ffn = block.ffn
            swiglu = ffn if isinstance(ffn, SwiGLU) else ffn.shared  # MoE: its shared experts
            if swiglu is not None:
                normal_(swiglu.w1.weight, std)
                normal_(swiglu.w3.weight, std)
                normal_(swiglu.w2.weight, out_std)
            if isinstance(ffn, MoE):
                normal_(ffn.router.weight, std)
                normal_(ffn.w1, std)
                normal_(ffn.w3, std)
                normal_(ffn.w2, out_std)
            for hc in (block.attn_hc, block.ffn_hc):
                if hc is not None:  # identity at the start: every branch is the plain residual
                    hc.mix.copy_(F.one_hot(torch.tensor(hc.index % hc.hc_mult), hc.hc_mult))
                    hc.res.copy_(torch.eye(hc.hc_mult))
                    hc.out.fill_(1.0)
            if block.engram is not None:
                self._init_engram(block.engram, f"blocks.{i}.engram", normal_,
                                  own_table=i in self._own_tables)

    def _init_engram(self, engram: Engram, name: str, normal_: Callable, own_table: bool) -> None:
        for module in engram.modules():
            if isinstance(module, nn.Linear):
                normal_(module.weight, self.config.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if engram.head_gain is not None:
            nn.init.ones_(engram.head_gain)
        if own_table:  # a table passed in by the caller brings its own (trained) rows
            # N(0, table_init_std); deferred_rows records the generator's state instead
            engram.table.reset_parameters(self.generator(f"{name}.table.weight"))
        # Zero conv (paper 2.3): Y = alpha * v at the start, a pure gated lookup.
        engram.init_weights()

    # -- loading -----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """``nn.Module.load_state_dict``; into a model built with ``init=False`` the state's
        tensors become the parameters, cast to the dtypes the model was built with as a copy
        would (gpt-fast's ``assign=True``: no second copy of the tables), outside stores keep
        their own, tied parameters stay tied, and the buffers no state holds are made."""
        if not self._unloaded:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        own = self.state_dict(keep_vars=True)
        given = {}
        for key, value in state_dict.items():
            mine = own.get(key)
            if mine is not None and not mine.is_meta and mine.shape == value.shape:
                with torch.no_grad():  # an outside store's tensor: filled in place, kept
                    if value.data_ptr() != mine.data_ptr():
                        mine.copy_(value)
                value = mine
            elif mine is not None and mine.is_meta:
                value = value.to(mine.dtype)
            given[key] = value
        tied: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        result = super().load_state_dict(given, strict=strict, assign=True)
        for first, *others in (names for names in tied.values() if len(names) > 1):
            for name in others:  # assign gave each name its own tensor (tie_embeddings)
                module, _, attr = name.rpartition(".")
                setattr(self.get_submodule(module), attr, self.get_parameter(first))
        self._make_buffers()
        return result

    def _make_buffers(self) -> None:
        """The buffers built on meta that no state holds (Engram's per-head offsets and sizes,
        module/engram.py), then a check that nothing is left on meta."""
        for engram in self.engrams().values():
            if engram.head_sizes is not None and engram.offsets.is_meta:
                engram.make_head_buffers()
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"the state dict gave no values for {left[:5]} (a model built with "
                             "init=False takes every value from it)")
        self._unloaded = False

    def compile(self, *args, **kwargs) -> None:
        """``nn.Module.compile`` (torch.compile of this model's forward, in place: same module,
        same state dict), with the Engram table reads kept out of the graph (sparse row
        gradients, tiers' reads). Under compile the gate and conv run as plain ops the compiler
        fuses (module/gate.py ``gate_plain``, conv.py ``conv_plain``), products as the compiler
        picks them (not compute/gemm.py's route); the MoE dispatch's per-expert split is a graph
        break."""
        compile_ready()
        super().compile(*args, **kwargs)

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, hash_ids: dict[int, torch.Tensor] | None = None, *,
                cache: DecodeCache | None = None, return_gates: bool = False,
                engram_mask: torch.Tensor | None = None) -> ModelOutput:
        """tokens [b, t] (model-vocabulary ids) -> final hidden [b, t, d]; ``.logits`` [b, t, V]
        are computed from it on first use, and ``loss``/``token_nll`` need only the hidden states.

        With ``cache`` only the new tokens are passed; they sit at positions cache.pos.. and the
        cache advances by t. ``hash_ids`` then hold the new tokens' ids only (``HashStream.step``).
        ``engram_mask`` [b, t] (False: no Engram residual there, as DeepSeek-V4.1's image tokens;
        hash such positions as dead so they break n-grams too).
        """
        self._check_inputs(tokens, hash_ids, cache)
        t = tokens.shape[1]
        pos = 0 if cache is None else cache.pos
        cos, sin = self.rope_cos[pos:pos + t], self.rope_sin[pos:pos + t]  # [t, e/2]

        def attention(i: int) -> Attend:
            return causal_attention if cache is None else cache.attention(i)

        def memory(i: int) -> Memory:
            state = None if cache is None else cache.engram.get(i)
            return engram_memory(hash_ids[i], state, return_gate=return_gates, alive=engram_mask)

        hidden, aux, gates = self.trunk(tokens, cos, sin, attention, memory)
        if cache is not None:
            cache.pos += t
        return ModelOutput(hidden, aux, gates if return_gates else None, self.logits)

    def trunk(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attention: Callable[[int], Attend], memory: Callable[[int], Memory]
              ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """tokens [b, t] at the positions of cos, sin [t, e/2] -> (final hidden [b, t, d], aux loss,
        {layer: alpha [b, t, m]} where the Engram reads returned one). Layer i attends with
        ``attention(i)`` and reads its Engram rows with ``memory(i)``: ``forward`` passes the
        reference's (full, or from a ``DecodeCache``), a paged engine its own (serving/paged.py)."""
        b, t = tokens.shape
        m = self.config.hc_mult
        h = self.embed(tokens)  # [b, t, d]
        if m > 1:
            h = h.unsqueeze(2).expand(b, t, m, h.shape[-1]).contiguous()  # [b, t, m, d] copies
        aux = h.new_zeros(())
        gates = {}
        for i, block in enumerate(self.blocks):
            read = None if block.engram is None else memory(i)
            h, a, g = block(h, cos, sin, attention(i), read)
            if a is not None:
                aux = aux + a
            if g is not None:
                gates[i] = g
        if m > 1:
            # Branches are summed in the HC paper; the mean is the same after RMSNorm (up to eps)
            # and makes an m-branch model at init exactly the plain-residual one.
            h = h.mean(dim=2)  # [b, t, d]
        return self.norm(h), aux, gates

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V] (log-probabilities with the adaptive head)."""
        if isinstance(self.head, AdaptiveHead):
            return self.head.log_probs(hidden)
        return self.head(hidden)

    def _check_inputs(self, tokens, hash_ids, cache) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"tokens must be an integer tensor [batch, seq], got "
                             f"{getattr(tokens, 'shape', type(tokens))}")
        b, t = tokens.shape
        v = self.config.vocab_size
        # Value checks read the tensor (a graph break under torch.compile, which indexes out of
        # range with an error of its own): eager forwards only.
        if tokens.numel() and not torch.compiler.is_compiling() and (
                int(tokens.min()) < 0 or int(tokens.max()) >= v):
            raise ValueError(f"token ids must be in [0, vocab_size={v}), got "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        pos = 0 if cache is None else cache.pos
        if pos + t > self.config.max_seq_len:
            raise ValueError(f"positions up to {pos + t} exceed "
                             f"max_seq_len={self.config.max_seq_len}")
        if cache is not None:
            if b != cache.batch_size:
                raise ValueError(f"batch of {b} rows but the cache holds {cache.batch_size}")
            if pos + t > cache.max_len:
                raise ValueError(f"cache full: {pos} + {t} new positions > max_len={cache.max_len}")
        layers = self.config.engram_layers
        given = sorted(hash_ids or {})
        if layers and hash_ids is None:
            raise ValueError(f"this model has Engram at layers {layers}: pass hash_ids={{layer: "
                             "LongTensor[b, t, H]} computed by engram.NgramHasher from raw ids")
        missing = sorted(set(layers) - set(given))
        extra = sorted(set(given) - set(layers))
        if missing or extra:
            raise ValueError(f"hash_ids layers {given} do not match the model's Engram layers "
                             f"{layers} (missing {missing}, unexpected {extra})")
        for lid in layers:
            if tuple(hash_ids[lid].shape[:2]) != (b, t):
                raise ValueError(f"hash_ids[{lid}] has shape {tuple(hash_ids[lid].shape)}, "
                                 f"expected [{b}, {t}, H] to match tokens")

    def loss(self, output: ModelOutput, targets: torch.Tensor, *,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross entropy over targets [b, t] (already shifted) + MoE aux loss."""
        nll = self.token_nll(output, targets, ignore_index=ignore_index)
        keep = targets != ignore_index
        return nll.sum() / keep.sum().clamp(min=1) + output.aux_loss

    def token_nll(self, output: ModelOutput, targets: torch.Tensor, *,
                  ignore_index: int = -100) -> torch.Tensor:
        """Next-token negative log-likelihood [b, t] in nats; 0 where targets == ignore_index."""
        if not isinstance(self.head, AdaptiveHead):
            return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten(),
                                   ignore_index=ignore_index, reduction="none").view_as(targets)
        keep = (targets != ignore_index).flatten()  # [n]
        if keep.all():
            return self.head.token_nll(output.hidden.flatten(0, 1), targets.flatten()).view_as(targets)
        nll = output.hidden.new_zeros(targets.numel())  # [n]
        if keep.any():
            idx = keep.nonzero().squeeze(1)
            nll = nll.index_copy(0, idx, self.head.token_nll(output.hidden.flatten(0, 1)[idx],
                                                             targets.flatten()[idx]))
        return nll.view_as(targets)

    # -- decoding ----------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int | None = None) -> DecodeCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` (or max_seq_len)."""
        c = self.config
        max_len = c.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= c.max_seq_len:
            raise ValueError(f"max_len must be in [1, max_seq_len={c.max_seq_len}], got {max_len}")
        w = self.embed.weight
        shape = (batch_size, c.n_head, max_len, c.head_dim)
        return DecodeCache(
            keys=[torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.n_layer)],
            values=[torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.n_layer)],
            engram={i: EngramState() for i in c.engram_layers})

    # -- parameters --------------------------------------------------------------------------------
    def engrams(self) -> dict[int, Engram]:
        return {i: b.engram for i, b in enumerate(self.blocks) if b.engram is not None}

    def table_parameters(self) -> Iterator[nn.Parameter]:
        """The Engram tables' parameters (sparse, row-wise optimiser, no weight decay)."""
        for engram in self.engrams().values():
            if isinstance(engram.table, nn.Module):
                yield from engram.table.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every other parameter (each shared one once)."""
        tables = {id(p) for p in self.table_parameters()}
        return (p for p in self.parameters() if id(p) not in tables)

    def param_counts(self) -> dict[str, int]:
        """Parameter accounting; the convention is applied identically to every variant.

        - ``total``: all parameters: embeddings, head, every expert, the tables (also when they live
          in an outside store, counted as rows x width).
        - ``table``: Engram table entries (the memory; the "sparse" parameters of the Engram side).
        - ``embedding`` / ``head``: input embedding / LM head (head 0 when tied).
        - ``routed_inactive``: routed experts a token does not use, (E - k) per MoE layer.
        - ``active``: parameters used per token, ~ FLOPs/2: total - table - routed_inactive - the
          input embedding when untied (a lookup, no FLOPs, like the tables). The LM head is a matmul
          and counts; tied, the shared matrix counts once, as the head.
        - ``total_non_embedding`` / ``active_non_embedding``: the same without embedding and head,
          the paper's P_tot and P_act (section 3); ``sparse`` = P_tot - P_act = table +
          routed_inactive, so the paper's allocation ratio is rho = routed_inactive / sparse.
        """
        c = self.config
        # A control's head gains rescale rows (no product): counted with the tables they scale.
        gains = sum(e.head_gain.numel() for e in self.engrams().values()
                    if e.head_gain is not None)
        dense = sum(p.numel() for p in self.dense_parameters()) - gains
        table = sum(e.table.num_rows * e.table.dim for e in self.engrams().values()
                    if e.table is not None) + gains
        total = dense + table
        embedding = self.embed.weight.numel()
        head = 0 if c.tie_embeddings else sum(p.numel() for p in self.head.parameters())
        routed_inactive = sum((b.ffn.n_routed - b.ffn.top_k) * b.ffn.params_per_expert
                              for b in self.blocks if isinstance(b.ffn, MoE))
        active = total - table - routed_inactive - (0 if c.tie_embeddings else embedding)
        return {
            "total": total, "table": table, "embedding": embedding, "head": head,
            "routed_inactive": routed_inactive, "active": active,
            "total_non_embedding": total - embedding - head,
            "active_non_embedding": active - c.vocab_size * c.d_model,
            "sparse": table + routed_inactive,
        }
