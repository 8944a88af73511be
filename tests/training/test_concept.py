"""The concept-binding loop: only the given parameters move, and bad input is refused."""

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


def test_refuses_nothing_to_train_and_bad_steps():
    with pytest.raises(ValueError, match="nothing to train"):
        fit_concept([torch.nn.Parameter(torch.zeros(2)).requires_grad_(False)],
                    lambda s: torch.zeros(()), steps=1)
    with pytest.raises(ValueError, match="steps"):
        fit_concept([torch.nn.Parameter(torch.zeros(2))], lambda s: torch.zeros(()), steps=0)
