"""Binding a concept: a short loop that trains only the given parameters (trigger tables, LoRA, a
token embedding) on a loss the caller builds from a handful of images (DreamBooth-style).

The base model stays frozen: the caller passes only the trainable parameters, and this loop checks
that they are the only ones it updates.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .hooks import LossCurve
from .loop import LoopConfig, fit, loss_run
from .optim import Optimizers


def fit_concept(params: Sequence[nn.Parameter], loss_fn: Callable[[int], torch.Tensor], steps: int,
                lr: float = 1e-2, desc: str = "concept", progress: bool = True,
                weight_decay: float = 0.0) -> list[float]:
    """AdamW on ``params`` at a constant ``lr`` for ``steps`` steps of ``loop.fit`` (no
    clipping); ``loss_fn(step)`` returns the loss. Returns the curve."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires grad")
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    # The parameters as the module fit clips (no limit) and steps; they stay the caller's.
    held = nn.ParameterList(params)
    curve = LossCurve(desc, progress, every=20)
    fit(loss_run(LoopConfig(steps=steps, lr=lr), held, Optimizers(opt, None, 1.0),
                 batch=lambda step: step, loss=lambda module, step: loss_fn(step)), [curve])
    return curve.losses


__all__ = ["fit_concept"]
