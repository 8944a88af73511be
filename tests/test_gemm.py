"""engram.gemm: the oneDNN path equals F.linear to float32 rounding, forward and every gradient,
and each product goes where the backend and its size say."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engram import gemm

needs_onednn = pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")


def _grads(fn, x, w, b, gy):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    y = fn(x, w, b)
    y.backward(gy)
    return y.detach(), [None if t is None else t.grad.clone() for t in (x, w, b)]


@needs_onednn
@pytest.mark.parametrize("shape", [(300, 96), (4, 70, 96), (2, 3, 50, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_equals_f_linear_forward_and_backward(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(130, 96, generator=g, requires_grad=True)
    b = torch.randn(130, generator=g, requires_grad=True) if bias else None
    gy = torch.randn(*shape[:-1], 130, generator=g)
    with gemm.using("onednn"):
        assert gemm._routes(x, w, b)
        y, grads = _grads(gemm.linear, x, w, b, gy)
    y_ref, ref = _grads(F.linear, x, w, b, gy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert y.shape == y_ref.shape


@needs_onednn
def test_onednn_takes_strided_inputs_and_partial_grads():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 400, generator=g).t()  # [400, 96], not contiguous
    w = torch.randn(200, 96, generator=g, requires_grad=True)
    gy = torch.randn(400, 200, generator=g)
    with gemm.using("onednn"):
        y = gemm.linear(x, w)
        y.backward(gy)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, gy.t() @ x, rtol=1e-5, atol=1e-4)
    assert x.grad is None


@needs_onednn
def test_onednn_bits_repeat_and_do_not_depend_on_threads():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(512, 256, generator=g), torch.randn(384, 256, generator=g)
    n = torch.get_num_threads()
    with gemm.using("onednn"):
        try:
            torch.set_num_threads(1)
            one = gemm.linear(x, w)
            torch.set_num_threads(2)
            two, again = gemm.linear(x, w), gemm.linear(x, w)
        finally:
            torch.set_num_threads(n)
    assert torch.equal(two, again)
    if gemm.resolve("auto") == "onednn":  # where oneDNN is the default (checked on an AMD EPYC)
        assert torch.equal(one, two)


def test_routing_by_backend_size_device_and_dtype():
    x, w = torch.randn(64, 256), torch.randn(256, 256)  # 4.2M multiply-adds
    with gemm.using("torch"):
        assert gemm.backend() == "torch" and not gemm._routes(x, w, None)
    if not gemm._onednn_available():
        return
    with gemm.using("onednn"):
        assert gemm.backend() == "onednn" and gemm._routes(x, w, None)
        assert not gemm._routes(x[:4], w, None)  # a decode step's few rows: MKL is faster
        assert not gemm._routes(x.double(), w.double(), None)
        assert not gemm._routes(x.bfloat16(), w.bfloat16(), None)
        assert not gemm._routes(x[0], w, None)  # 1-d input: F.linear's business
        assert not gemm._routes(torch.randn(64, 255), w, None)  # F.linear raises its own error
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not gemm._routes(x, w, None)
        with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied"):
            gemm.linear(torch.randn(64, 255), w)


def test_auto_means_onednn_on_amd_x86_only(monkeypatch):
    if gemm._onednn_available():
        assert gemm.resolve("auto", vendor="AuthenticAMD", machine="x86_64") == "onednn"
    else:
        assert gemm.resolve("auto", vendor="AuthenticAMD", machine="x86_64") == "torch"
    assert gemm.resolve("auto", vendor="GenuineIntel", machine="x86_64") == "torch"
    assert gemm.resolve("auto", vendor="", machine="aarch64") == "torch"
    assert gemm.cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags : avx\n") == \
        "AuthenticAMD"
    assert gemm.cpu_vendor("no such line") == ""


def test_bad_backend_names_are_refused_clearly(monkeypatch):
    with pytest.raises(ValueError, match="one of .*'torch'.*got 'mkl'"):
        gemm.set_backend("mkl")
    monkeypatch.setenv("ENGRAM_GEMM", "fast")
    monkeypatch.setattr(gemm, "_resolved", {})
    with pytest.raises(ValueError, match="ENGRAM_GEMM"):
        gemm.backend()
    monkeypatch.setenv("ENGRAM_GEMM", "torch")
    assert gemm.backend() == "torch"


def test_adopt_swaps_plain_linears_and_keeps_the_state_dict():
    asm = nn.AdaptiveLogSoftmaxWithLoss(32, 100, [20, 60], div_value=2.0)
    before = {k: v.clone() for k, v in asm.state_dict().items()}
    x, target = torch.randn(40, 32), torch.randint(0, 100, (40,))
    ref = asm(x, target).loss
    gemm.adopt(asm)
    linears = [m for m in asm.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is gemm.Linear for m in linears)
    assert asm.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in asm.state_dict().items())
    torch.testing.assert_close(asm(x, target).loss, ref)
