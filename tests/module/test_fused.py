"""The compiled gate + conv (module/fused.py) against the torch path (GateFn + ConvFn): outputs and
every gradient, decode with a state, determinism over threads, fallbacks, and the kernels' exp."""

import math

import numpy as np
import pytest
import torch

from engram import Engram, EngramState
from engram.module import fused

pytestmark = pytest.mark.skipif(not fused.fits(), reason="numba is not installed")


def _module(m=4, d=40, gate="demo", kernel_size=4, dilation=3, c=48, fused_kv=False, seed=0):
    torch.manual_seed(seed)
    mod = Engram(None, None, c, d, m, gate=gate, kernel_size=kernel_size, dilation=dilation,
                 fused=fused_kv, conv_init="default")
    with torch.no_grad():  # norm weights away from 1, so a swapped weight would show
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return mod


def _run(mod, h, mem, kernels, state=None, seed=1, alive=None):
    """Y, alpha and the gradients of a random loss on both (the gate's gradient too)."""
    mod.kernels = kernels
    mod.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    mem = mem.detach().requires_grad_()
    y, a = mod(h, memory=mem, state=state, return_gate=True, alive=alive)
    g = torch.Generator().manual_seed(seed)
    ((y * torch.randn(y.shape, generator=g)).sum()
     + (a * torch.randn(a.shape, generator=g)).sum()).backward()
    return {"y": y.detach(), "alpha": a.detach(), "h": h.grad, "memory": mem.grad,
            **{n: p.grad for n, p in mod.named_parameters()}}


def _close(got, want, rtol=2e-5):
    assert got.keys() == want.keys()
    for k in want:
        scale = want[k].abs().max().clamp_min(1e-6)
        err = (got[k] - want[k]).abs().max() / scale
        assert err < rtol, f"{k}: relative error {err:.2e}"


@pytest.mark.parametrize("m,d,gate,kernel_size,dilation,fused_kv", [
    (4, 40, "demo", 4, 3, False),  # the demo's layout
    (1, 24, "paper", 0, 3, True),  # v4.1: no conv
    (2, 300, "paper", 4, 1, False),  # rows wider than a vector, odd widths
    (3, 16, "demo", 2, 2, False),  # a short kernel: the taps past K are zero rows
    (1, 8, "demo", 3, 5, True),
])
@pytest.mark.parametrize("b,t", [(2, 37), (1, 5), (3, 1)])  # t < the conv's context too
def test_equals_torch_path(m, d, gate, kernel_size, dilation, fused_kv, b, t):
    mod = _module(m, d, gate, kernel_size, dilation, fused_kv=fused_kv)
    h, mem = torch.randn(b, t, m, d), torch.randn(b, t, 48)
    if m == 1:
        h = h[:, :, 0]
    _close(_run(mod, h, mem, True), _run(mod, h, mem, False))


@pytest.mark.parametrize("kernel_size", [4, 0])
def test_alive_mask_equals_torch_path(kernel_size):
    mod = _module(kernel_size=kernel_size)
    h, mem = torch.randn(3, 21, 4, 40), torch.randn(3, 21, 48)
    alive = torch.ones(3, 21, dtype=torch.bool)
    alive[1, :6] = False  # left padding
    alive[2, 9:12] = False  # a gap (a trigger table's span)
    _close(_run(mod, h, mem, True, alive=alive), _run(mod, h, mem, False, alive=alive))


@pytest.mark.parametrize("kernels", [True, False])
def test_left_padding_is_invisible(kernels):
    """A left-padded row's real positions get what the row gets alone: padding feeds the conv the
    zeros it sees before a sequence start."""
    mod = _module()
    mod.kernels = kernels
    h, mem = torch.randn(2, 15, 4, 40), torch.randn(2, 15, 48)
    alive = torch.ones(2, 15, dtype=torch.bool)
    alive[1, :5] = False
    with torch.no_grad():
        padded = mod(h, memory=mem, alive=alive)
        alone = mod(h[1:, 5:], memory=mem[1:, 5:])
    torch.testing.assert_close(padded[1:, 5:], alone, rtol=1e-5, atol=1e-6)
    assert padded[1, :5].abs().max() == 0  # no residual at padding (SiLU(conv(0)) = 0 there)


def test_kernels_run_and_differ_in_rounding_only():
    """The equivalence above must not be the torch path twice: the bits differ somewhere."""
    mod = _module()
    h, mem = torch.randn(2, 37, 4, 40), torch.randn(2, 37, 48)
    got, want = _run(mod, h, mem, True), _run(mod, h, mem, False)
    assert any(not torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kernel_size", [4, 0])
def test_decode_with_state_equals_full_forward(kernel_size):
    mod = _module(kernel_size=kernel_size)
    h, mem = torch.randn(2, 23, 4, 40), torch.randn(2, 23, 48)
    with torch.no_grad():
        full = mod(h, memory=mem)
        state, outs = EngramState(keep_inputs=True), []
        inputs = []
        for a, z in ((0, 7), (7, 8), (8, 9), (9, 23)):
            outs.append(mod(h[:, a:z], memory=mem[:, a:z], state=state))
            if kernel_size:
                inputs.append(state.inputs)
        ref_state = EngramState(keep_inputs=True)
        mod.kernels = False
        ref = mod(h, memory=mem, state=ref_state)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-5, atol=1e-6)
    if kernel_size:
        torch.testing.assert_close(torch.cat(inputs, 1), ref_state.inputs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.conv, ref_state.conv, rtol=1e-5, atol=1e-6)


def test_training_graph_and_inference_agree():
    mod = _module()
    h, mem = torch.randn(2, 19, 4, 40), torch.randn(2, 19, 48)
    y = mod(h.requires_grad_(), memory=mem)
    with torch.no_grad():
        assert torch.equal(y.detach(), mod(h, memory=mem))


def test_same_bits_on_any_thread_count():
    mod = _module()
    h, mem = torch.randn(4, 64, 4, 40), torch.randn(4, 64, 48)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(mod, h, mem, True)
        torch.set_num_threads(2)
        two = _run(mod, h, mem, True)
    finally:
        torch.set_num_threads(threads)
    for k in one:
        assert torch.equal(one[k], two[k]), k


@pytest.mark.parametrize("case", ["kernel5", "float64", "off", "hooked"])
def test_falls_back_to_torch_path(case):
    mod = _module(kernel_size=5 if case == "kernel5" else 4)
    h, mem = torch.randn(2, 11, 4, 40), torch.randn(2, 11, 48)
    if case == "float64":
        mod, h, mem = mod.double(), h.double(), mem.double()
    if case == "hooked":  # a hook on the conv must see its input
        seen = []
        mod.short_conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    got = _run(mod, h, mem, case != "off")
    want = _run(mod, h, mem, False)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    if case == "hooked":
        assert len(seen) == 2


def test_empty_input():
    mod = _module()
    y = mod(torch.randn(2, 0, 4, 40), memory=torch.randn(2, 0, 48))
    assert y.shape == (2, 0, 4, 40)


def test_nan_spreads_like_the_torch_path():
    """A NaN in one position's hidden state: that position's gate and, through the causal conv,
    later outputs become NaN, earlier ones stay finite, and nothing crashes."""
    mod = _module()
    h, mem = torch.randn(1, 20, 4, 40), torch.randn(1, 20, 48)
    h[0, 6, 1, 3] = float("nan")
    with torch.no_grad():
        got = mod(h, memory=mem)
        mod.kernels = False
        want = mod(h, memory=mem)
    assert torch.equal(got.isnan(), want.isnan())
    assert got[:, :6].isfinite().all() and got[:, 6].isnan().any()


def test_exp_and_silu_kernels():
    from engram.module import kernels
    x = np.concatenate([np.linspace(-87, 87, 20001), [0.0, -0.0, 1e-30, -1e-30]]).astype(np.float32)
    got = np.array([kernels.exp_neg(v) for v in x[:: 50]], np.float32)
    want = np.exp(-x[:: 50].astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 4 * 2.0 ** -23  # a few ulp
    for v, ref in ((100.0, 100.0), (-100.0, -100.0 * math.exp(-100.0)), (0.0, 0.0)):
        assert kernels.silu(np.float32(v)) == pytest.approx(ref, rel=1e-6, abs=1e-30)
    assert kernels.exp_neg(np.float32(200.0)) > 0  # saturated, not 0 or a bad index
    assert np.isnan(kernels.silu(np.float32("nan")))
