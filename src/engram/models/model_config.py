"""The reference LM's configuration: widths, depth, MoE, hyper-connections, head, Engram placement.

Plain data with validation; ``engram.models.model.EngramLM`` builds from it. Every error names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import UserError
from ..module import GATES, LEGACY_V41_GATE, LEGACY_V41_NORM_EPS, PROFILE_GATE, PROFILE_NORM_EPS
from ..retrieval.config import EngramConfig

HEADS = ("full", "adaptive")


@dataclass
class ModelConfig:
    """The reference LM's shape: vocabulary, blocks, width, attention heads, FFN or MoE, LM head,
    hyper-connections and, in ``engram``, an ``EngramConfig`` (None: no Engram)."""

    # The model's own vocabulary (possibly a restricted one); hash ids come from raw ids separately.
    vocab_size: int = 32768
    # Number of transformer blocks.
    n_layer: int = 12
    # Model width d.
    d_model: int = 768
    # Attention heads; d_model must divide evenly, and the head dim must be even (RoPE pairs).
    n_head: int = 12
    # Dense SwiGLU hidden width; None -> 8/3 * d_model rounded up to a multiple of 32 (LLaMA).
    d_ff: int | None = None
    # Longest sequence (RoPE tables and the default decode cache length).
    max_seq_len: int = 2048
    # RoPE base frequency.
    rope_base: float = 10000.0
    # Epsilon of every RMSNorm in the backbone.
    norm_eps: float = 1e-5
    # Std of the normal init of dense weights (residual output projections get std/sqrt(2*n_layer)).
    init_std: float = 0.02
    # Share the input embedding with the LM head (full head only).
    tie_embeddings: bool = False
    # LM head: "full" softmax, or "adaptive" softmax (layers.AdaptiveHead; exact, cheaper on CPU).
    head: str = "full"
    # Adaptive head: frequency ranks where the shortlist and each tail cluster end (< vocab_size).
    head_cutoffs: tuple[int, ...] = (2048, 8192)
    # Adaptive head: tail cluster i is computed at width d_model / head_div**i.
    head_div: float = 4.0
    # DeepSeekMoE (shared + routed experts) instead of the dense FFN, from first_dense_layers on.
    moe: bool = False
    # Routed experts per MoE layer (E).
    n_routed_experts: int = 8
    # Always-on shared experts per MoE layer.
    n_shared_experts: int = 1
    # Routed experts each token uses (k).
    top_k: int = 2
    # Expert hidden width; None -> d_ff // (n_shared + top_k), so the activated FFN matches dense.
    d_expert: int | None = None
    # Weight of the load-balancing loss (DeepSeek expert-level balance loss), added to aux_loss.
    aux_loss_coef: float = 0.01
    # Leading layers that keep a dense FFN even when moe=True (DeepSeek's first_k_dense_replace).
    first_dense_layers: int = 0
    # Hyper-connection branches m (Zhu et al. 2024); 1 = the plain residual stream.
    hc_mult: int = 1
    # Engram retrieval config (its layer_ids say which blocks get Engram); None = no Engram.
    engram: EngramConfig | None = None
    # Engram gate: "paper" or "demo"; None = the profile's default (recorded as such once built).
    engram_gate: str | None = None
    # Eps of the Engram gate's RMSNorms; None = the profile's (v4.1: 1e-6, DeepSeek-V4.1's
    # rms_norm_eps; demo-v1: the dtype's, as nn.RMSNorm).
    engram_norm_eps: float | None = None
    # Engram short conv on/off; None = the profile's default (demo-v1 on, v4.1 off).
    engram_conv: bool | None = None
    # Ablation: Engram gate fixed at 1 (no key projections, no context-aware gating).
    engram_fixed_gate: bool = False
    # Ablation: with hc_mult > 1, one key projection and key norm shared by all branches.
    engram_shared_key: bool = False
    # Control: a learned gain per hash head on the rows read (Engram's head_gain; "frozen-scaled").
    engram_head_gain: bool = False
    # Tables produce sparse row gradients (pair with a row-wise optimiser, engram.training.row_optim.RowAdam).
    sparse_tables: bool = True
    # Std of the tables' normal init (1.0 = nn.Embedding and the official demo).
    table_init_std: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.engram, dict):
            self.engram = EngramConfig.from_dict(self.engram)
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "max_seq_len", "hc_mult"):
            _positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise UserError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise UserError(f"head dim d_model/n_head={self.d_model // self.n_head} must be even "
                             "(RoPE rotates pairs of channels)")
        for name in ("rope_base", "norm_eps", "init_std", "table_init_std"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        self.head_cutoffs = tuple(self.head_cutoffs)
        if self.head not in HEADS:
            raise UserError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.head == "adaptive":
            cuts = (0, *self.head_cutoffs, self.vocab_size)
            if len(cuts) < 3 or any(a >= b for a, b in zip(cuts, cuts[1:])):
                raise UserError(f"head_cutoffs must increase strictly within (0, vocab_size="
                                 f"{self.vocab_size}), got {self.head_cutoffs}")
            if self.tie_embeddings:
                raise UserError("tie_embeddings needs head='full' (the adaptive head has no "
                                 "[V, d] matrix to share)")
            if not self.head_div >= 1:
                raise UserError(f"head_div must be >= 1, got {self.head_div}")
        if self.d_ff is None:
            self.d_ff = 32 * math.ceil(8 * self.d_model / 3 / 32)
        _positive("d_ff", self.d_ff)
        if self.moe:
            _positive("n_routed_experts", self.n_routed_experts)
            _positive("top_k", self.top_k)
            if self.n_shared_experts < 0:
                raise UserError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
            if self.top_k > self.n_routed_experts:
                raise UserError(f"top_k={self.top_k} > n_routed_experts={self.n_routed_experts}")
            if self.d_expert is None:
                self.d_expert = max(1, self.d_ff // (self.n_shared_experts + self.top_k))
            _positive("d_expert", self.d_expert)
            if self.aux_loss_coef < 0:
                raise UserError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
            if not 0 <= self.first_dense_layers <= self.n_layer:
                raise UserError(f"first_dense_layers={self.first_dense_layers} must be in "
                                 f"[0, n_layer={self.n_layer}]")
        if self.engram is not None:
            if not isinstance(self.engram, EngramConfig):
                raise TypeError(f"engram must be an EngramConfig or None, got {type(self.engram)}")
            bad = [i for i in self.engram.layer_ids if i >= self.n_layer]
            if bad:
                raise UserError(f"Engram layer ids {bad} are out of range for n_layer="
                                 f"{self.n_layer} (layers are 0-based)")
        if self.engram_gate is not None and self.engram_gate not in GATES:
            raise UserError(f"engram_gate must be one of {GATES} or None, "
                             f"got {self.engram_gate!r}")
        if self.engram_norm_eps is not None and not self.engram_norm_eps > 0:
            raise UserError(f"engram_norm_eps must be > 0 or None, got {self.engram_norm_eps}")
        if self.engram is not None:
            # The profile's defaults are written into the config, so a saved config says which
            # gate and eps its model ran with even if a profile's defaults change (v4.1 did).
            self.engram_gate = self.engram_gate or PROFILE_GATE[self.engram.profile]
            if self.engram_norm_eps is None:
                self.engram_norm_eps = PROFILE_NORM_EPS[self.engram.profile]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def engram_layers(self) -> list[int]:
        return [] if self.engram is None else list(self.engram.layer_ids)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe and layer >= self.first_dense_layers

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["engram"] = None if self.engram is None else self.engram.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """A saved config (``to_dict``). One saved before the gate and eps were recorded (no
        ``engram_norm_eps`` key) with the v4.1 profile ran the profile's old defaults, the plain
        sigmoid and float32's eps: it gets those back, so the model it describes is unchanged."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        engram = d.get("engram")
        profile = getattr(engram, "profile", None) or (engram or {}).get("profile")
        if "engram_norm_eps" not in d and profile == "v4.1":
            d = {**d, "engram_gate": d.get("engram_gate") or LEGACY_V41_GATE,
                 "engram_norm_eps": LEGACY_V41_NORM_EPS}
        return cls(**d)


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{name} must be a positive integer, got {value!r}")
