"""The module under autocast and under torch.compile: the gate and conv run in float32 inside a
bf16/fp16 autocast region, and their plain-op twins (what torch.compile traces) equal the
hand-written autograd Functions in float64, outputs and every gradient."""

import pytest
import torch
from test_engram import VARIANTS, _ids, _module

from engram import build_engram
from engram.module.conv import ConvFn, conv_plain
from engram.module.gate import GateFn, gate_plain


def _grads(out, inputs):
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
               for o in out if o.requires_grad)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("kind", ["paper", "demo"])
@pytest.mark.parametrize("m", [1, 3])
def test_gate_plain_equals_gate_fn(kind, m):
    g = torch.Generator().manual_seed(m)
    b, t, d = 2, 7, 8
    kv, h = torch.randn(b, t, (m + 1) * d, generator=g), torch.randn(b, t, m, d, generator=g)
    w1, w2 = 1 + 0.1 * torch.randn(m, d, generator=g), 1 + 0.1 * torch.randn(m, d, generator=g)
    inputs = [x.double().requires_grad_() for x in (kv, h, w1, w2)]
    want = GateFn.apply(*inputs, None, 1e-6, kind)
    got = gate_plain(*inputs, None, 1e-6, kind)
    for a, z in zip((*got, *_grads(got, inputs)), (*want, *_grads(want, inputs))):
        assert torch.allclose(a, z, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("residual", [False, True])
def test_conv_plain_equals_conv_fn(residual):
    g = torch.Generator().manual_seed(0)
    b, t, m, d, k, dil = 2, 9, 2, 8, 4, 3
    x = torch.randn(b, t, m, d, generator=g)
    past = torch.randn(b, (k - 1) * dil, m * d, generator=g)
    nw, cw = 1 + 0.1 * torch.randn(m, d, generator=g), torch.randn(m * d, 1, k, generator=g)
    inputs = [z.double().requires_grad_() for z in (x, nw, cw)]
    want = ConvFn.apply(inputs[0], past.double(), inputs[1], inputs[2], None, dil, residual)
    got = conv_plain(inputs[0], past.double(), inputs[1], inputs[2], None, dil, residual)
    assert torch.allclose(got[1], want[1], rtol=1e-12, atol=1e-12)  # the decode state's buffer
    for a, z in zip((got[0], *_grads(got[:1], inputs)), (want[0], *_grads(want[:1], inputs))):
        assert torch.allclose(a, z, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("v", VARIANTS)
def test_under_autocast_only_the_gemm_is_low_precision(tiny_config, tiny_lookup, v):
    """bf16 autocast: the value/key GEMM in bf16, the gate and conv in float32 (Y, alpha float32);
    Y within bf16 rounding of the fp32 module's, alpha too, gradients flow to every parameter."""
    cfg, m = _module(tiny_config, v)
    ids = _ids(cfg, tiny_lookup)[2]
    b, t = ids.shape[:2]
    h = torch.randn(b, t, v["hc_mult"], 24, generator=torch.Generator().manual_seed(1))
    want, alpha0 = m(h, ids, return_gate=True)
    hh = h.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, alpha = m(hh, ids, return_gate=True)
    assert y.dtype == alpha.dtype == torch.float32
    assert (y - want).norm() / want.norm() < 2e-2
    assert (alpha - alpha0).abs().max() < 2e-2
    y.square().sum().backward()
    assert hh.grad is not None and all(p.grad is not None for p in m.parameters())


def test_a_bf16_table_feeds_the_float32_module(tiny_config, tiny_lookup):
    """Tables stored in bf16 (``--precision bf16``): rows are widened to the hidden dtype."""
    torch.manual_seed(0)
    m = build_engram(tiny_config, 2, 24, sparse=True)
    ids = _ids(tiny_config, tiny_lookup)[2]
    h = torch.randn(*ids.shape[:2], 24)
    m.table.to(torch.bfloat16)
    y = m(h, ids)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert m.table.weight.grad.dtype == torch.bfloat16 and m.table.weight.grad.is_sparse
