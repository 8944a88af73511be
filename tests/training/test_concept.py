"""The concept-binding loop: only the given parameters move, it is the plain AdamW loop it always
was (now loop.fit's), and bad input is refused."""

import pytest
import torch

from engram.training.concept import fit_concept


def test_fits_a_target_and_leaves_frozen_weights():
    torch.manual_seed(0)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    before = frozen.weight.clone()
    v = torch.nn.Parameter(torch.zeros(4))
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    curve = fit_concept([v], lambda s: (frozen(x) + v - target).pow(2).mean(), steps=60, lr=0.1,
                        progress=False)
    assert len(curve) == 60 and curve[-1] < curve[0]
    assert torch.equal(frozen.weight, before)


def test_is_the_plain_adamw_loop():
    """Through loop.fit: constant lr, no clipping, the same curve and weights bit for bit as the
    hand-written loop fit_concept used to be."""
    x, target = torch.randn(16, 6, generator=torch.Generator().manual_seed(3)), torch.randn(16, 6)

    def start():
        torch.manual_seed(1)
        return torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6, 6))

    def loss_fn(a, w):
        return lambda step: (x[step % 4::4] @ w + a - target[step % 4::4]).pow(2).mean()

    a, w = start()
    curve = fit_concept([a, w], loss_fn(a, w), steps=30, lr=0.05, progress=False,
                        weight_decay=0.01)
    ra, rw = start()
    opt = torch.optim.AdamW([ra, rw], lr=0.05, weight_decay=0.01)
    ref = []
    for step in range(30):
        loss = loss_fn(ra, rw)(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ref.append(float(loss.detach()))
    assert curve == ref and curve[-1] < curve[0]
    assert torch.equal(a, ra) and torch.equal(w, rw)


def test_refuses_nothing_to_train_and_bad_steps():
    with pytest.raises(ValueError, match="nothing to train"):
        fit_concept([torch.nn.Parameter(torch.zeros(2)).requires_grad_(False)],
                    lambda s: torch.zeros(()), steps=1)
    with pytest.raises(ValueError, match="steps"):
        fit_concept([torch.nn.Parameter(torch.zeros(2))], lambda s: torch.zeros(()), steps=0)
