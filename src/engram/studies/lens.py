"""Reading the residual stream: LogitLens KL per layer and linear CKA between layers (paper 6.1).

LogitLens (nostalgebraist 2020): each layer's hidden state read through the final norm and the LM
head, as if the model stopped there; its KL divergence to the model's own output distribution says
how far from "done" that layer is. The paper finds smaller KL in early layers with Engram: the
memory does early what the backbone would otherwise spend layers on (effective depth).
Linear CKA (Kornblith et al. 2019) compares two layers' representations of the same tokens,
invariant to rotation and scale; the paper finds Engram's layer 5 most like the baseline's layer 12.

Shape legend:
    b batch, t positions, n tokens (``b*t``), d model width, V model vocabulary, L blocks (L+1
    states: the embedding output, then after each block).
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.surgery import captured_hidden


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of x [n, d1] and y [n, d2] (same n tokens): ||Yc^T Xc||_F^2 /
    (||Xc^T Xc||_F ||Yc^T Yc||_F) with column-centred Xc, Yc; in float64 for the small-sample sums."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same tokens: {x.shape[0]} vs {y.shape[0]} rows")
    xc = x.double() - x.double().mean(0)  # [n, d1]
    yc = y.double() - y.double().mean(0)  # [n, d2]
    cross = (yc.T @ xc).pow(2).sum()
    norm = (xc.T @ xc).norm() * (yc.T @ yc).norm()
    return float(cross / norm) if norm > 0 else 0.0


def cka_matrix(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[list[float]]:
    """CKA of every state of ``a`` (rows) against every state of ``b`` (columns); each [n, d]."""
    return [[linear_cka(x, y) for y in b] for x in a]


@torch.no_grad()
def lens_kl(model: torch.nn.Module, states: list[torch.Tensor], final: torch.Tensor,
            chunk: int = 2048) -> list[torch.Tensor]:
    """Per-state KL(final output || state read through norm + head) [n] for n tokens.

    states: L+1 tensors [n, d] (pre final norm); final: [n, d] the model's output hidden (post
    norm), whose head output is the distribution the model actually predicts."""
    out = [final.new_zeros(final.shape[0]) for _ in states]
    for s in range(0, final.shape[0], chunk):
        ref = model.logits(final[s:s + chunk]).float().log_softmax(-1)  # [c, V]
        p = ref.exp()
        for i, h in enumerate(states):
            lp = model.logits(model.norm(h[s:s + chunk])).float().log_softmax(-1)  # [c, V]
            out[i][s:s + chunk] = (p * (ref - lp)).sum(-1).clamp_min(0)
    return out


@torch.no_grad()
def read_layers(rt: Any, batches: list[Any], cka_tokens: int = 4096) -> dict[str, Any]:
    """Mean LogitLens KL per state over ``batches`` read through the runtime ``rt``'s forward
    (serving/runtime.py), and the states of ``cka_tokens`` tokens taken in equal shares from every
    batch (batches spread over the stream cover both languages).

    Returns {"kl": [L+1 floats], "states": L+1 tensors [<= cka_tokens, d]}."""
    model = rt.model.eval()
    share = -(-cka_tokens // max(1, len(batches)))
    kl_sum: list[float] | None = None
    n = 0
    kept: list[list[torch.Tensor]] = []
    have = 0
    for b in batches:
        with captured_hidden(model) as states:
            out = rt.forward(b.raw, warn=False)
        flat = [h.flatten(0, 1) for h in states]  # L+1 x [n, d]
        kls = lens_kl(model, flat, out.hidden.flatten(0, 1))
        sums = [float(k.sum()) for k in kls]
        kl_sum = sums if kl_sum is None else [a + c for a, c in zip(kl_sum, sums)]
        n += flat[0].shape[0]
        if have < cka_tokens:
            kept.append([h[:min(share, cka_tokens - have)] for h in flat])
            have += kept[-1][0].shape[0]
    if kl_sum is None:
        raise ValueError("no batches to read")
    return {"kl": [s / n for s in kl_sum],
            "states": [torch.cat([k[i] for k in kept]) for i in range(len(kept[0]))]}
