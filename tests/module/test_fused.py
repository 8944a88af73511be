"""The compiled gate + conv (module/fused.py) against the torch path (GateFn + ConvFn): outputs and
every gradient, parallel kernels and serial twins alike, decode with a state, determinism over
threads, that the parallel kernels do run, fallbacks, and the kernels' exp."""

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engram import Engram, EngramState
from engram.compute import gemm
from engram.module import fused

pytestmark = pytest.mark.skipif(not fused.fits(), reason="numba is not installed")
SRC = str(Path(fused.__file__).parents[2])


@pytest.fixture(scope="module")
def plans():
    """The serial twins, and the parallel kernels on every call however small (numba's pool: two
    threads or more on a machine with two cores or more)."""
    return {"serial": fused.make_plan(1), "parallel": fused.make_plan(2, serial_below=0)}


def _module(m=4, d=40, gate="demo", kernel_size=4, dilation=3, c=48, fused_kv=False, seed=0):
    torch.manual_seed(seed)
    mod = Engram(None, None, c, d, m, gate=gate, kernel_size=kernel_size, dilation=dilation,
                 fused=fused_kv, conv_init="default")
    with torch.no_grad():  # norm weights away from 1, so a swapped weight would show
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return mod


def _run(mod, h, mem, kernels, state=None, seed=1, alive=None):
    """Y, alpha and the gradients of a random loss on both (the gate's gradient too); kernels:
    False (the torch path), True (the process's plan) or a fused.Plan."""
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
@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_equals_torch_path(m, d, gate, kernel_size, dilation, fused_kv, b, t, mode, plans):
    mod = _module(m, d, gate, kernel_size, dilation, fused_kv=fused_kv)
    h, mem = torch.randn(b, t, m, d), torch.randn(b, t, 48)
    if m == 1:
        h = h[:, :, 0]
    _close(_run(mod, h, mem, plans[mode]), _run(mod, h, mem, False))


@pytest.mark.parametrize("gate,kernel_size", [("paper", 4), ("paper", 0), ("demo", 4)])
def test_as_accurate_as_torch_path_where_the_default_plan_goes_parallel(gate, kernel_size):
    """At a training size (over SERIAL_BELOW values, default threshold), against float64: the
    kernels' error is the float32 torch path's. (The demo gate's signed square root has slope
    1/(2 sqrt|s|): among 2048 gates some score lands near 0 and both float32 paths are off by
    ~2e-4 there, so the float32 paths are not compared with each other.)"""
    plan = fused.make_plan(2)
    mod = _module(gate=gate, kernel_size=kernel_size)
    h, mem = torch.randn(4, 128, 4, 40), torch.randn(4, 128, 48)
    assert h.numel() >= plan.serial_below
    got, f32 = _run(mod, h, mem, plan), _run(mod, h, mem, False)
    ref = _run(mod.double(), h.double(), mem.double(), False)
    for k in ref:
        scale = ref[k].abs().max().clamp_min(1e-6)
        err, err32 = ((x[k].double() - ref[k]).abs().max() / scale for x in (got, f32))
        assert err <= 4 * err32 + 1e-6, f"{k}: {err:.2e} against the torch path's {err32:.2e}"


@pytest.mark.parametrize("kernel_size", [4, 0])
@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_alive_mask_equals_torch_path(kernel_size, mode, plans):
    mod = _module(kernel_size=kernel_size)
    h, mem = torch.randn(3, 21, 4, 40), torch.randn(3, 21, 48)
    alive = torch.ones(3, 21, dtype=torch.bool)
    alive[1, :6] = False  # left padding
    alive[2, 9:12] = False  # a gap (a trigger table's span)
    _close(_run(mod, h, mem, plans[mode], alive=alive), _run(mod, h, mem, False, alive=alive))


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


@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_kernels_run_and_differ_in_rounding_only(mode, plans):
    """The equivalence above must not be the torch path twice: the bits differ somewhere."""
    mod = _module()
    h, mem = torch.randn(2, 37, 4, 40), torch.randn(2, 37, 48)
    got, want = _run(mod, h, mem, plans[mode]), _run(mod, h, mem, False)
    assert any(not torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kernel_size", [4, 0])
@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_decode_with_state_equals_full_forward(kernel_size, mode, plans):
    mod = _module(kernel_size=kernel_size)
    mod.kernels = plans[mode]
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


def test_same_bits_on_any_thread_count(plans):
    """The serial twins and the parallel kernels on the pool's threads (uneven chunks too). torch
    runs on one thread and every product on torch's route here: the value/key GEMM around the
    kernels is then the same sum in the same order on both calls (MKL on several threads may
    change its split under load; the auto route's decisions can change with the machine's
    history). Whether each came from numba's cache or was compiled here: the next test."""
    mod = _module()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with gemm.using("torch"):
            for b, t in ((4, 64), (3, 50)):
                h, mem = torch.randn(b, t, 4, 40), torch.randn(b, t, 48)
                one = _run(mod, h, mem, plans["serial"])
                many = _run(mod, h, mem, plans["parallel"])
                for k in one:
                    assert torch.equal(one[k], many[k]), k
    finally:
        torch.set_num_threads(threads)


def test_same_bits_compiled_or_loaded_from_the_cache(tmp_path):
    """A fresh copy of the package: one process compiles the serial twins (into the cache), the
    next loads them and compiles the parallel kernels. Both calls, in both processes, give the
    same bits. numba links a copy of each callee (a parallel loop's body too) into its caller and
    optimises it again, so compiled and loaded code are not the same machine code; with fastmath's
    reassociation they summed differently (~1e-5 in the gradients: CI's failure of the test
    above, twice, under pytest-xdist with the cache filled by other processes meanwhile). The
    kernels are IEEE now (engram/compute/jit.py); this fails with fastmath back on."""
    shutil.copytree(Path(SRC) / "engram", tmp_path / "engram",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = textwrap.dedent(f"""
        import hashlib, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_fused import _module, _run  # this file's module and its gradients
        import engram
        from engram.compute import gemm
        from engram.module import fused
        assert engram.__file__.startswith({str(tmp_path)!r}), engram.__file__  # the fresh copy
        mod = _module()
        h, mem = torch.randn(4, 64, 4, 40), torch.randn(4, 64, 48)
        torch.set_num_threads(1)
        plans = {{"serial": fused.make_plan(1), "parallel": fused.make_plan(2, serial_below=0)}}
        for name in sys.argv[1:]:
            with gemm.using("torch"):
                got = _run(mod, h, mem, plans[name])
            print(name, hashlib.sha256(b"".join(t.numpy().tobytes() for t in got.values()))
                  .hexdigest())
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(tmp_path), NUMBA_NUM_THREADS="2")
    runs = [subprocess.run([sys.executable, "-c", code, *modes], env=env, capture_output=True,
                           text=True, timeout=300)
            for modes in (["serial"], ["serial", "parallel"])]
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
    first, second = (dict(line.split() for line in out.stdout.splitlines()) for out in runs)
    assert first["serial"] == second["serial"] == second["parallel"], (first, second)


def test_parallel_kernels_run_and_share_the_pool_across_threads():
    """In a fresh process on numba's workqueue pool (which aborts the process when two threads
    launch parallel loops at once), two threads: a small call runs the serial twins and starts no
    pool; a large one runs the parallel kernels, which start it; two Python threads training at
    once get the same bits as one (one at a time in the pool, the other on the twins)."""
    code = textwrap.dedent("""
        import copy, threading, numba, torch
        from numba.np.ufunc import parallel
        from engram import Engram
        from engram.module import fused, kernels
        torch.manual_seed(0)
        mod = Engram(None, None, 48, 40, 4, gate="demo", conv_init="default")
        def grads(b, t, seed=0, mod=mod):
            g = torch.Generator().manual_seed(seed)
            h = torch.randn(b, t, 4, 40, generator=g, requires_grad=True)
            mem = torch.randn(b, t, 48, generator=g)
            mod.zero_grad(set_to_none=True)
            mod(h, memory=mem).square().sum().backward()
            return [h.grad] + [p.grad for p in mod.parameters()]
        mod.kernels = fused.make_plan(1)
        grads(2, 9)
        assert not parallel._is_initialized and not kernels.gate_forward.signatures
        mod.kernels = plan = fused.make_plan(2)
        assert plan.threads == 2 and plan.exclusive, plan
        small = grads(2, 9)
        assert not kernels.gate_forward.signatures  # under SERIAL_BELOW: the twins
        big = [grads(4, 128, seed) for seed in range(2)]
        assert parallel._is_initialized and numba.threading_layer() == "workqueue"
        for fn in (kernels.gate_forward, kernels.conv_forward, kernels.backward):
            assert fn.signatures, fn  # the parallel dispatchers ran
        out = {}
        def work(i):  # a module of its own: the threads share the pool, not the grads
            own = copy.deepcopy(mod)
            out[i] = [grads(4, 128, i % 2, own) for _ in range(3)]
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for i in range(2):
            for got in out[i]:
                assert all(torch.equal(a, b) for a, b in zip(got, big[i % 2]))
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": SRC, "NUMBA_NUM_THREADS": "2",
           "NUMBA_THREADING_LAYER": "workqueue"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]


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
