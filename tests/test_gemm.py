"""engram.compute.gemm: the oneDNN path equals F.linear to float32 rounding, forward and every gradient;
each product goes where the backend, its size and its bucket's measured route say; the route is
measured once, kept on disk, handed to workers, and survives a cache it cannot write."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engram
from engram.compute import gemm, gemm_decisions, machine

needs_onednn = pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
# One thread: timings are short and steady (two threads on a busy 2-core machine stall for ms).
pytestmark = pytest.mark.usefixtures("one_thread")
SRC = str(Path(engram.__file__).parents[1])


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has decided nothing yet, its decisions file in tmp_path (and the temp-dir
    fallback there too), ENGRAM_GEMM unset."""
    monkeypatch.setattr(gemm, "_table", {})
    monkeypatch.setattr(gemm, "_mine", set())
    monkeypatch.setattr(gemm, "_loaded", False)
    monkeypatch.setattr(gemm, "_chosen", None)
    monkeypatch.setenv("ENGRAM_GEMM_CACHE", str(tmp_path / "cache" / "gemm_routes.json"))
    monkeypatch.setenv(gemm.ROUTES_ENV, "")  # restored (unset) afterwards, whatever _export sets
    monkeypatch.delenv("ENGRAM_GEMM", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    return tmp_path / "cache" / "gemm_routes.json"


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
@pytest.mark.parametrize("n,i,o", [(283, 8, 30112), (2048, 128, 384), (37, 96, 130)])
def test_onednn_weight_grad_is_dy_t_x_in_the_weights_layout(n, i, o):
    """dW as (X^T dY)^T (no copy of dY^T): dY^T X to float32 rounding, laid out as the weight; on
    the Zen 4 measured, the very bits of dY^T X as one product (runs repeat across the change)."""
    g = torch.Generator().manual_seed(3)
    x, gy = torch.randn(n, i, generator=g), torch.randn(n, o, generator=g)
    got = gemm._grad_weight(gy, x)
    assert got.shape == (o, i) and got.is_contiguous()
    torch.testing.assert_close(got.double(), gy.double().t() @ x.double(), rtol=1e-4, atol=1e-3)
    if machine.cpu_id().startswith("AMD EPYC (family 25 model 17"):  # measured on this Zen 4
        assert torch.equal(got, gemm._mm(gy.t(), x.t()))


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
    if machine.cpu_id().startswith("AMD EPYC (family 26"):  # measured on this Zen 5 only
        assert torch.equal(one, two)


def test_routing_by_backend_size_device_and_dtype(fresh):
    x, w = torch.randn(64, 256), torch.randn(256, 256)  # 4.2M multiply-adds
    with gemm.using("torch"):
        assert gemm.backend() == "torch" and not gemm._routes(x, w, None)
    if not gemm._onednn_available():
        return
    with gemm.using("onednn"):
        assert gemm.backend() == "onednn" and gemm._routes(x, w, None)
        assert not gemm._routes(x[:4], w, None)  # a decode step's few rows: under MIN_MACS
        assert not gemm._routes(x.double(), w.double(), None)
        assert not gemm._routes(x.bfloat16(), w.bfloat16(), None)
        assert not gemm._routes(x[0], w, None)  # 1-d input: F.linear's business
        assert not gemm._routes(torch.randn(64, 255), w, None)  # F.linear raises its own error
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not gemm._routes(x, w, None)
        with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied"):
            gemm.linear(torch.randn(64, 255), w)
    assert not fresh.exists() and gemm.routes() == {}  # a forced backend measures nothing


def test_buckets_round_down_cap_rows_and_name_the_threads():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert gemm.bucket(2048, 128, 384) == "1t 512x128x512"  # rows capped at 2^25 MACs
        assert gemm.bucket(100, 128, 512) == "1t 128x128x512"  # each to the nearest power of 2
        assert gemm.bucket(90, 128, 512) == "1t 64x128x512"
        assert gemm.bucket(2048, 1024, 5120) == "1t 64x1024x4096"  # MEASURE_ROWS at the least
        assert gemm.bucket(5, 1024, 5120) == "1t 4x1024x4096"  # a decode: its own bucket
        torch.set_num_threads(2)
        assert gemm.bucket(2048, 128, 384) == "2t 512x128x512"
    finally:
        torch.set_num_threads(n)


@needs_onednn
def test_measure_times_both_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    rec = gemm.measure(256, 128, 256, rounds=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert rec["torch_ms"] > 0 and rec["onednn_ms"] > 0
    ratio = rec["torch_ms"] / rec["onednn_ms"]
    assert rec["onednn_speedup"] == pytest.approx(ratio, rel=1e-2)
    assert rec["route"] == ("onednn" if rec["onednn_speedup"] >= gemm.MARGIN else "torch")


@needs_onednn
def test_first_use_measures_once_then_the_file_decides(fresh):
    x, w = torch.randn(300, 128), torch.randn(256, 128)
    key = gemm.bucket(300, 128, 256)
    got = gemm._routes(x, w, None)
    data = json.loads(fresh.read_text())
    rec = data["machines"][gemm._machine()][key]
    assert rec["route"] == ("onednn" if got else "torch")
    assert gemm.routes() == {key: rec["route"]}
    assert json.loads(os.environ[gemm.ROUTES_ENV])["routes"] == {key: rec["route"]}
    # Fixed within the process: a changed file no longer matters.
    other = "torch" if got else "onednn"
    rec["route"] = other
    fresh.write_text(json.dumps(data))
    assert gemm._routes(x, w, None) == got
    # A new process (nothing loaded) takes the file's decision instead of measuring again.
    gemm._table.clear()
    gemm._loaded = False
    os.environ[gemm.ROUTES_ENV] = ""
    assert gemm.route(300, 128, 256) == other
    assert json.loads(fresh.read_text())["machines"][gemm._machine()][key]["route"] == other


@needs_onednn
def test_a_decision_made_on_a_busy_machine_is_measured_again_when_quiet(fresh, monkeypatch):
    key = gemm.bucket(300, 128, 256)
    busy = 4.0 * (os.cpu_count() or 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    gemm.route(300, 128, 256)
    rec = json.loads(fresh.read_text())["machines"][gemm._machine()][key]
    assert rec["busy"] is True
    # Another busy process takes it as it is (no new timing: the marked record stays)
    data = json.loads(fresh.read_text())
    data["machines"][gemm._machine()][key] = {**rec, "route": "torch", "measured": "then"}
    fresh.write_text(json.dumps(data))
    gemm._table.clear()
    gemm._loaded = False
    os.environ[gemm.ROUTES_ENV] = ""
    assert gemm.route(300, 128, 256) == "torch"
    # A process on a quiet machine measures again and replaces it, unmarked
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    gemm._table.clear()
    gemm._loaded = False
    os.environ[gemm.ROUTES_ENV] = ""
    gemm.route(300, 128, 256)
    again = json.loads(fresh.read_text())["machines"][gemm._machine()][key]
    assert again["busy"] is False and again["measured"] != "then"


@needs_onednn
def test_the_parents_decisions_beat_the_file_and_reach_spawned_workers(fresh, tmp_path):
    key = gemm.bucket(512, 256, 256)
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({"version": gemm_decisions.VERSION, "machines": {gemm._machine(): {
        key: {"route": "torch"}}}}))
    os.environ[gemm.ROUTES_ENV] = json.dumps({"machine": gemm._machine(),
                                              "routes": {key: "onednn"}})
    assert gemm.route(512, 256, 256) == "onednn"
    # A worker with an empty cache of its own: the parent's decision, nothing measured there.
    child_cache = tmp_path / "child" / "gemm_routes.json"
    env = {**os.environ, "ENGRAM_GEMM_CACHE": str(child_cache), "TMPDIR": str(tmp_path / "ct"),
           "PYTHONPATH": SRC}
    code = (f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
            "from engram.compute import gemm; print(gemm.route(512, 256, 256))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["onednn"]
    assert not child_cache.exists()


def test_a_file_of_another_format_is_measured_again(fresh):
    """Decisions timed before the format changed (e.g. with oneDNN's old weight gradient) are not
    read: the bucket is measured again and the file rewritten in today's format."""
    key = gemm.bucket(512, 256, 256)
    fresh.parent.mkdir(parents=True)
    old = {"version": gemm_decisions.VERSION - 1, "machines": {gemm._machine(): {
        key: {"route": "torch"}}}}
    fresh.write_text(json.dumps(old))
    assert gemm_decisions.read(fresh, gemm._machine()) == {}
    gemm.route(512, 256, 256)
    data = json.loads(fresh.read_text())
    assert data["version"] == gemm_decisions.VERSION
    assert "measured" in data["machines"][gemm._machine()][key]


@needs_onednn
def test_installed_routes_beat_the_cache_until_pinned_ends(fresh):
    """A run's recorded routes (training/settings.py) over the cache's; ENGRAM_GEMM over both."""
    key = gemm.bucket(512, 256, 256)
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({"version": gemm_decisions.VERSION, "machines": {gemm._machine(): {
        key: {"route": "torch"}}}}))
    assert gemm.route(512, 256, 256) == "torch" and gemm.used() == {key: "torch"}
    with gemm.pinned({key: "onednn"}):
        assert gemm.route(512, 256, 256) == "onednn" and gemm.used() == {key: "onednn"}
        assert json.loads(os.environ[gemm.ROUTES_ENV])["routes"][key] == "onednn"  # to workers
        with gemm.using("torch"):
            assert gemm.route(512, 256, 256) == "torch"
            assert gemm.record()["backend"] == "torch"
    assert gemm.route(512, 256, 256) == "torch" and gemm.used() == {key: "torch"}
    assert json.loads(fresh.read_text())["machines"][gemm._machine()][key]["route"] == "torch"
    assert not gemm.reuse({"machine": "another CPU | torch 0", "routes": {key: "onednn"}})
    assert gemm.route(512, 256, 256) == "torch"
    assert gemm.reuse({**gemm.record(), "routes": {key: "onednn"}})
    assert gemm.route(512, 256, 256) == "onednn"
    with pytest.raises(ValueError, match="'torch' or 'onednn'"):
        gemm.install({key: "mkl"})


@needs_onednn
def test_concurrent_first_uses_agree(fresh, tmp_path):
    """Two workers needing the same undecided bucket at once: one measures under the file's
    lock, the other reads its decision."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "t"), "PYTHONPATH": SRC}
    env.pop(gemm.ROUTES_ENV, None)
    code = ("import torch; torch.set_num_threads(1); from engram.compute import gemm; "
            "print(gemm.route(1000, 256, 512))")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    got = [o.strip() for o, _ in outs]
    key = "1t {}x{}x{}".format(*gemm._shape(1000, 256, 512))
    recs = json.loads(fresh.read_text())["machines"][gemm._machine()]
    assert list(recs) == [key]
    assert got == [recs[key]["route"]] * 2


@needs_onednn
def test_no_writable_cache_is_no_error(fresh, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a folder cannot be made under a file, even by root
    monkeypatch.setenv("ENGRAM_GEMM_CACHE", str(blocker / "sub" / "gemm_routes.json"))
    monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))
    monkeypatch.setenv("HOME", str(tmp_path / "no_such_home"))
    x, w = torch.randn(300, 128), torch.randn(256, 128)
    y = gemm.linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert list(gemm.routes()) == [gemm.bucket(300, 128, 256)]  # decided, kept in the process
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]  # nothing written anywhere


@needs_onednn
def test_prepare_decides_a_models_shapes_before_its_forward(fresh):
    model = nn.Sequential(gemm.Linear(128, 384), nn.ReLU(), gemm.Linear(384, 128),
                          gemm.Linear(128, 2))  # the last is under MIN_MACS: never routed
    decided = gemm.prepare(model, rows=[2048])
    assert set(decided) == {gemm.bucket(2048, 128, 384), gemm.bucket(2048, 384, 128)}
    before = gemm.routes()
    model(torch.randn(16, 128, 128)).sum().backward()
    assert gemm.routes() == before == decided


def test_bad_backend_names_are_refused_clearly(fresh, monkeypatch):
    with pytest.raises(ValueError, match="one of .*'torch'.*got 'mkl'"):
        gemm.set_backend("mkl")
    monkeypatch.setenv("ENGRAM_GEMM", "fast")
    with pytest.raises(ValueError, match="ENGRAM_GEMM"):
        gemm.resolve()
    monkeypatch.setenv("ENGRAM_GEMM", "torch")
    assert gemm.resolve() == "torch" and gemm.backend() == "torch"
    assert gemm.route(4096, 1024, 1024) == "torch" and not fresh.exists()


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
