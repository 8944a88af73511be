"""Interventions on a built EngramLM, for ablations (trained that way) and analyses (at inference).

Everything here swaps submodules or adds forward hooks; ``module/`` is not touched, so the Engram
module stays one implementation. Permanent changes (``fix_gate``, ``share_key``) are applied by
``EngramLM`` when its config asks; the context managers undo themselves.

The gate is alpha = sigmoid(<RMSNorm(k), RMSNorm(h)> / sqrt(d)) (paper eq. 4). A forced or fixed
gate sets the module's ``gate_value``: alpha is exactly that value, the keys and the gate are
skipped, and no gradient reaches the key projections or the hidden state through the gate.

Shape legend:
    b batch, t positions, m residual branches, d model width, c memory width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..module import Engram


class Alias(nn.Module):
    """Calls another module without registering it, so its parameters exist (and count) once."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self._target = [target]  # a list hides it from nn.Module registration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._target[0](x)

    # The module reads its projections' and norms' weights directly (one GEMM for all keys).
    @property
    def weight(self) -> torch.Tensor:
        return self._target[0].weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self._target[0], "bias", None)

    @property
    def eps(self) -> float | None:
        return self._target[0].eps


def fix_gate(engram: Engram) -> None:
    """Ablation "gate fixed at 1" (paper table 5, w/o context-aware gating): alpha = 1 everywhere.
    The key projections and both gate norms are dropped (they would receive no gradient)."""
    if engram.fused:
        raise ValueError("fix_gate needs the unfused projections (demo-v1 profile)")
    engram.gate_value = 1.0
    engram.key_projs, engram.norm1, engram.norm2 = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()


def share_key(engram: Engram) -> None:
    """Ablation "one shared key": every hyper-connection branch uses branch 0's key projection and
    key norm instead of its own (paper 2.4 gives each branch its own)."""
    if engram.fused:
        raise ValueError("share_key needs the unfused projections (demo-v1 profile)")
    for i in range(1, engram.hc_mult):
        engram.key_projs[i] = Alias(engram.key_projs[0])
        engram.norm1[i] = Alias(engram.norm1[0])


@contextmanager
def forced_gate(model: nn.Module, value: float) -> Iterator[None]:
    """Every Engram layer's gate is exactly ``value`` (0 or 1) inside the block."""
    if value not in (0.0, 1.0):
        raise ValueError(f"the gate can be forced to 0 or 1, got {value}")
    saved = {i: e.gate_value for i, e in model.engrams().items()}
    for e in model.engrams().values():
        e.gate_value = float(value)
    try:
        yield
    finally:
        for i, e in model.engrams().items():
            e.gate_value = saved[i]


@contextmanager
def engram_zeroed(model: nn.Module) -> Iterator[None]:
    """Every Engram layer adds nothing to the residual (the paper's suppression, section 6.2)."""
    def zero(_module, _args, out):
        if isinstance(out, tuple):  # (y, alpha) when gates were asked for
            return torch.zeros_like(out[0]), out[1]
        return torch.zeros_like(out)

    handles = [e.register_forward_hook(zero) for e in model.engrams().values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def captured_hidden(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The residual stream after the embedding and after each block: a list of L+1 tensors
    [b, t, d] (hyper-connection branches averaged, as the model does before its final norm),
    filled by the forward passes run inside the block (the last pass's states)."""
    states: list[torch.Tensor | None] = [None] * (len(model.blocks) + 1)

    def keep(index):
        def hook(_module, _args, out):
            h = out[0] if isinstance(out, tuple) else out
            states[index] = (h.mean(dim=2) if h.dim() == 4 else h).detach()
        return hook

    handles = [model.embed.register_forward_hook(keep(0))]
    handles += [b.register_forward_hook(keep(i + 1)) for i, b in enumerate(model.blocks)]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()
