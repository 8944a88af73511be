"""Binding a concept: a short loop that trains only the given parameters (trigger tables, LoRA, a
token embedding) on a loss the caller builds from a handful of images (DreamBooth-style).

The base model stays frozen: the caller passes only the trainable parameters, and this loop checks
that they are the only ones it updates.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch
from torch import nn


def fit_concept(params: Sequence[nn.Parameter], loss_fn: Callable[[int], torch.Tensor], steps: int,
                lr: float = 1e-2, desc: str = "concept", progress: bool = True,
                weight_decay: float = 0.0) -> list[float]:
    """Adam on ``params`` for ``steps`` steps; ``loss_fn(step)`` returns the loss. Returns the curve."""
    from tqdm import tqdm

    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires grad")
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    curve = []
    bar = tqdm(range(steps), desc=desc, file=sys.stderr, disable=not progress, dynamic_ncols=True,
               mininterval=2.0)
    for step in bar:
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(curve[-20:]) / len(curve[-20:]):.4f}")
    return curve


__all__ = ["fit_concept"]
