"""The row-wise table optimisers with O(1) state a row (RowAdagrad, RowRMSprop) against dense and
per-row references and torch, their state size, checkpoints, and `engram train --table_optimizer`
(one process, Engram-Nine, fp16, torchrun with sharded tables)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from engram.artifacts.checkpoint import CheckpointError
from engram.errors import UserError
from engram.tables.store import MemoryTable
from engram.training.corpus import DataConfig, build_corpus
from engram.training.optim import TABLE_OPTIMIZERS, build_optimizers, make_table_optimizer
from engram.training.row_optim import RowAdagrad, RowAdam, RowRMSprop
from engram.training.train import TrainConfig, train

CLASSES = {"adagrad": RowAdagrad, "rmsprop": RowRMSprop}


def sparse_grad(ids, grads, num_rows):
    """A row-sparse COO gradient, uncoalesced (duplicates kept), like F.embedding's backward."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (num_rows, grads.shape[1]),
                                   check_invariants=True)


def unique_batches(n_steps, rows, e, k, seed):
    """Steps touching k distinct rows each (rows come and go), with their gradients."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randperm(rows, generator=gen)[:k], torch.randn(k, e, generator=gen))
            for _ in range(n_steps)]


# -- equivalence with references ---------------------------------------------------------------
@pytest.mark.parametrize("kernels", [True, False])
def test_adagrad_equals_dense_rowwise_adagrad(kernels):
    """Lazy row-wise Adagrad equals the dense computation over every row (an untouched row's
    gradient is zero, so its accumulator and weights stay): bit for bit, lr changing per step."""
    rows, e, lr, eps = 300, 8, 0.05, 1e-8
    w0 = torch.randn(rows, e, generator=torch.Generator().manual_seed(1))
    p = nn.Parameter(w0.clone())
    opt = RowAdagrad([p], lr=lr, eps=eps, kernels=kernels)
    w, acc = w0.clone(), torch.zeros(rows)  # the dense reference: [r, e] and [r]
    touched = set()
    for i, (ids, g) in enumerate(unique_batches(7, rows, e, 40, seed=2)):
        step_lr = lr * (1 + i) / 7
        opt.param_groups[0]["lr"] = step_lr
        p.grad = sparse_grad(ids, g, rows)
        opt.step()
        dense = torch.zeros(rows, e).index_copy_(0, ids, g)  # [r, e], zeros off the batch
        acc.add_(dense.square().mean(1))
        w.addcmul_(dense, torch.div(step_lr, acc.sqrt().add(eps)).unsqueeze(1), value=-1)
        touched |= set(ids.tolist())
        assert torch.equal(p.detach(), w), i
    assert torch.equal(opt.row_state(p, torch.arange(rows))["sum_sq"], acc)
    untouched = torch.tensor(sorted(set(range(rows)) - touched))
    assert torch.equal(p.detach()[untouched], w0[untouched])
    assert torch.equal(opt.touched_rows(p), torch.tensor(sorted(touched)))


def rmsprop_reference(w0, batches, lr, beta2, eps):
    """Per-row RMSprop with a row-scalar second moment, in float64, restricted to each step's
    rows: v_r = beta2 v_r + (1 - beta2) mean(g_r^2), t_r += 1,
    w_r -= lr g_r / (sqrt(v_r / (1 - beta2^t_r)) + eps); other rows untouched."""
    w = w0.double().clone()
    v, t = torch.zeros(w.shape[0], dtype=torch.float64), torch.zeros(w.shape[0], dtype=torch.long)
    for ids, g in batches:
        for r, gr in zip(ids.tolist(), g.double()):
            t[r] += 1
            v[r] = beta2 * v[r] + (1 - beta2) * gr.square().mean()
            w[r] -= lr * gr / ((v[r] / (1 - beta2 ** int(t[r]))).sqrt() + eps)
    return w, v, t


def test_rmsprop_equals_per_row_reference_when_rows_come_and_go():
    rows, e, lr, beta2 = 200, 6, 0.03, 0.95
    w0 = torch.randn(rows, e, generator=torch.Generator().manual_seed(3))
    batches = unique_batches(8, rows, e, 30, seed=4)
    p = nn.Parameter(w0.clone())
    opt = RowRMSprop([p], lr=lr, beta2=beta2)
    for ids, g in batches:
        p.grad = sparse_grad(ids, g, rows)
        opt.step()
    w, v, t = rmsprop_reference(w0, batches, lr, beta2, 1e-8)
    torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    st = opt.row_state(p, torch.arange(rows))
    torch.testing.assert_close(st["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-9)
    assert torch.equal(st["steps"], t)
    seen = torch.unique(torch.cat([b[0] for b in batches]))
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[seen] = False
    assert torch.equal(p.detach()[untouched], w0[untouched])  # bit for bit


def test_width_one_rows_are_torch_adagrad_and_adam_without_momentum():
    """With one element a row, the row mean is the element: RowAdagrad is torch's sparse
    Adagrad, RowRMSprop is torch's Adam at beta1 = 0 (every row touched every step)."""
    rows, lr = 50, 0.1
    w0 = torch.randn(rows, 1, generator=torch.Generator().manual_seed(5))
    a, ref_a = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_a, torch_a = RowAdagrad([a], lr=lr), torch.optim.Adagrad([ref_a], lr=lr, eps=1e-8)
    b, ref_b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_b = RowRMSprop([b], lr=lr, beta2=0.95)
    torch_b = torch.optim.Adam([ref_b], lr=lr, betas=(0.0, 0.95), foreach=False)
    for ids, g in unique_batches(6, rows, 1, 20, seed=6):
        a.grad = ref_a.grad = sparse_grad(ids, g, rows)
        opt_a.step(), torch_a.step()
    torch.testing.assert_close(a, ref_a, rtol=2e-6, atol=1e-7)
    for ids, g in unique_batches(6, rows, 1, rows, seed=7):
        b.grad = sparse_grad(ids, g, rows)
        ref_b.grad = b.grad.to_dense()
        opt_b.step(), torch_b.step()
    torch.testing.assert_close(b, ref_b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", CLASSES)
def test_duplicate_ids_are_summed(name):
    a, b = nn.Parameter(torch.zeros(10, 3)), nn.Parameter(torch.zeros(10, 3))
    oa, ob = CLASSES[name]([a], lr=0.1), CLASSES[name]([b], lr=0.1)
    g = torch.arange(9.0).view(3, 3)
    a.grad = sparse_grad([2, 5, 2], g, 10)
    b.grad = sparse_grad([2, 5], torch.stack([g[0] + g[2], g[1]]), 10)
    oa.step(), ob.step()
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", CLASSES)
def test_bfloat16_table_keeps_float32_state(name):
    p = nn.Parameter(torch.zeros(20, 4, dtype=torch.bfloat16))
    opt = CLASSES[name]([p], lr=0.01)
    p.grad = sparse_grad([3, 7], torch.ones(2, 4, dtype=torch.bfloat16), 20)
    opt.step()
    assert p.dtype == torch.bfloat16 and p[3].float().sub(-0.01).abs().max() < 1e-3
    assert all(t.dtype in (torch.float32, torch.int64) for k, t in opt.state[p].items()
               if isinstance(t, torch.Tensor) and k != "slot")


# -- state size ------------------------------------------------------------------------------
@pytest.mark.parametrize("e", [4, 64, 512])
def test_state_bytes_per_row_are_constant_not_row_sized(e):
    """O(1) a row: 12 bytes (adagrad: id + accumulator) and 20 (rmsprop: + step count) a touched
    row saved, whatever the width; RowAdam's grow with it (8e + 16)."""
    rows = 5000
    per_row = {"adagrad": 12, "rmsprop": 20, "adam": 8 * e + 16}
    for name in TABLE_OPTIMIZERS:
        p = nn.Parameter(torch.zeros(rows, e))
        opt = make_table_optimizer(name, [p], lr=0.01)
        for ids, g in unique_batches(3, rows, e, 700, seed=8):
            p.grad = sparse_grad(ids, g, rows)
            opt.step()
        b = opt.state_bytes(p)
        assert b["saved"] == b["rows"] * per_row[name], name
        assert b["rows"] == opt.touched_rows(p).numel() > 1024  # past one growth
        # held: compact buffers (capacity < 2x the touched rows) + the 4-byte slot map
        assert b["held"] < 2 * b["saved"] + 4 * rows + 8 * 1024
        sd = sum(t.nbytes for t in opt.state_dict()["state"][0].values())
        assert sd == b["saved"]


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["adam", *CLASSES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("via", ["torch", "safetensors"])
def test_state_dict_round_trip_resumes_bit_exactly(name, dtype, via):
    """Every table optimiser: saved mid-run (torch or safetensors) and resumed == never stopped."""
    cls = {"adam": RowAdam, **CLASSES}[name]
    rows, e = 3000, 4  # 6 x 700 ids outgrow the first 1024 slots, so capacities differ on resume
    w0 = torch.randn(rows, e, generator=torch.Generator().manual_seed(9)).to(dtype)
    gen = torch.Generator().manual_seed(10)
    batches = [(ids := torch.randint(0, rows, (700,), generator=gen),
                torch.randn(ids.numel(), e, generator=gen)) for _ in range(6)]

    def run(p, opt, bs):
        for ids, g in bs:
            p.grad = sparse_grad(ids, g.to(dtype), rows)
            opt.step()

    full = nn.Parameter(w0.clone())
    run(full, cls([full], lr=0.01), batches)
    first = nn.Parameter(w0.clone())
    opt = cls([first], lr=0.01)
    run(first, opt, batches[:3])
    sd = opt.state_dict()
    if via == "torch":
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf)
    else:
        flat = {f"{i}.{k}": t for i, s in sd["state"].items() for k, t in s.items()}
        back = st_load(st_save(flat))
        loaded = {"param_groups": sd["param_groups"],
                  "state": {i: {k: back[f"{i}.{k}"] for k in s} for i, s in sd["state"].items()}}
    resumed = nn.Parameter(first.detach().clone())
    opt2 = cls([resumed], lr=0.5)  # lr comes back from the checkpoint
    opt2.load_state_dict(loaded)
    assert opt2.param_groups[0]["lr"] == 0.01
    run(resumed, opt2, batches[3:])
    assert torch.equal(resumed, full)
    assert torch.equal(opt2.touched_rows(resumed), torch.unique(torch.cat([b[0] for b in batches])))


def test_state_of_another_table_optimizer_or_shape_is_refused():
    p = nn.Parameter(torch.zeros(100, 4))
    adam = RowAdam([p])
    p.grad = sparse_grad([99], torch.ones(1, 4), 100)
    adam.step()
    with pytest.raises(ValueError, match="another table optimiser"):
        RowAdagrad([p]).load_state_dict(adam.state_dict())
    ada = RowAdagrad([p])
    ada.step()
    with pytest.raises(ValueError, match="another table optimiser"):
        RowAdam([p]).load_state_dict(ada.state_dict())
    with pytest.raises(ValueError, match="does not fit"):
        RowAdagrad([nn.Parameter(torch.zeros(50, 4))]).load_state_dict(ada.state_dict())


def test_build_optimizers_takes_the_choice_and_keeps_its_signature():
    model = nn.Sequential(MemoryTable(100, 8, sparse=True), nn.Linear(8, 8))
    assert isinstance(build_optimizers(model, 1e-3).tables, RowAdam)  # the default
    for name, cls in CLASSES.items():
        opts = build_optimizers(model, 1e-3, 0.1, (0.9, 0.95), 5.0, 1e-8, table_optimizer=name)
        assert type(opts.tables) is cls and opts.tables.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert build_optimizers(model, 1e-3, table_optimizer="rmsprop").tables.defaults["beta2"] == 0.95
    with pytest.raises(UserError, match="table_optimizer must be one of adam, adagrad, rmsprop"):
        build_optimizers(nn.Linear(2, 2), 1e-3, table_optimizer="sgd")  # even without tables
    with pytest.raises(UserError, match="table_optimizer"):
        TrainConfig(table_optimizer="adafactor")


# -- engram train --------------------------------------------------------------------------------
TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=2, eval_batches=2, log_every=1, eval_every=3, ckpt_every=3, lr=3e-3)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


def _cfg(tmp_path, name, **kw):
    return TrainConfig(out_dir=str(tmp_path / name), **{**TINY, **kw})


@pytest.mark.parametrize("name", CLASSES)
def test_engram_train_learns_resumes_exactly_and_refuses_another_choice(tmp_path, corpus, name):
    # min_lr_ratio 1: the schedule does not depend on the steps asked for
    kw = dict(lr=1e-2, min_lr_ratio=1.0, table_optimizer=name)
    full = train(_cfg(tmp_path, "full", steps=12, **kw), corpus, progress=False)
    losses = [r["loss"] for r in full.history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    assert type(full.optim.tables) is CLASSES[name]
    saved = json.loads((tmp_path / "full" / "config.json").read_text())
    assert saved["table_optimizer"] == name
    train(_cfg(tmp_path, "part", steps=6, **kw), corpus, progress=False)
    resumed = train(_cfg(tmp_path, "part", steps=12, **kw), corpus, progress=False)
    assert [r["loss"] for r in resumed.history] == losses
    for (k, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(CheckpointError, match=r"differs in \['table_optimizer'\]"):
        train(_cfg(tmp_path, "part", steps=15, **{**kw, "table_optimizer": "adam"}), corpus,
              progress=False)


def test_nine_hot_tier_and_fp16_train_with_a_row_wise_optimizer(tmp_path, corpus):
    """Engram-Nine (hot + cold tables, shared by two layers) resumes exactly; fp16 (fp16 tables,
    the loss scale's skipped steps) stays finite with float32 row state."""
    nine = dict(hot_rows=40, shared_tables=True, engram_layers=(0, 1), table_optimizer="adagrad",
                min_lr_ratio=1.0)
    full = train(_cfg(tmp_path, "full", steps=6, **nine), corpus, progress=False)
    assert len(full.optim.tables.param_groups[0]["params"]) == 2  # hot and cold, once each
    assert all(full.optim.tables.touched_rows(p).numel()
               for p in full.optim.tables.param_groups[0]["params"])
    train(_cfg(tmp_path, "part", steps=3, **nine), corpus, progress=False)
    resumed = train(_cfg(tmp_path, "part", steps=6, **nine), corpus, progress=False)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    from engram.models.precision import autocast_supported

    if autocast_supported("cpu", torch.float16):
        half = train(_cfg(tmp_path, "fp16", steps=8, precision="fp16", table_optimizer="rmsprop"),
                     corpus, progress=False)
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in half.history)
        st = half.optim.tables.state[half.optim.tables.param_groups[0]["params"][0]]
        assert st["exp_avg_sq"].dtype == torch.float32 and st["n"] > 0


def test_torchrun_sharded_tables_match_one_process_and_reshard(tmp_path, corpus):
    """world 2 with sharded tables equals one process (up to summation order); its shard files
    carry the row-wise state, and a world-3 run resumes from them to the same losses."""
    import shutil

    from engram.training.process_group import spawn_local

    from test_distributed import TINY as DIST, _metrics, _train_worker

    kw = dict(DIST, steps=6, table_optimizer="rmsprop")
    one = train(TrainConfig(out_dir=str(tmp_path / "one"), **kw), corpus, progress=False).history
    spawn_local(_train_worker, 2, TrainConfig(out_dir=str(tmp_path / "two"), **{**kw, "steps": 3}),
                corpus)
    shutil.copytree(tmp_path / "two", tmp_path / "three")
    spawn_local(_train_worker, 3, TrainConfig(out_dir=str(tmp_path / "three"), **kw), corpus)
    got = _metrics(tmp_path / "three")  # step 3 is world 2's last: validated there, not in one
    assert [r["step"] for r in got] == [r["step"] for r in one]
    # summation order only (test_distributed's 2e-5 is RowAdam's; 2.4e-5 seen here at step 6)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    from safetensors import safe_open

    from engram.training.dist_checkpoint import latest_distributed

    shard = next(latest_distributed(tmp_path / "three")[0].glob("shard-*"))
    with safe_open(str(shard), "pt") as f:
        assert {k.split(".", 1)[1] for k in f.keys()} == {"weight", "rows", "exp_avg_sq", "steps"}
    with pytest.raises(Exception, match="table_optimizer"):
        spawn_local(_train_worker, 2, TrainConfig(out_dir=str(tmp_path / "three"),
                                                  **{**kw, "steps": 8,
                                                     "table_optimizer": "adagrad"}), corpus)


def test_a_run_from_before_the_option_resumes_as_adam():
    from engram.training.train import check_same_config

    saved = {k: v for k, v in TrainConfig(**TINY).to_dict().items() if k != "table_optimizer"}
    check_same_config(TrainConfig(**TINY), saved, "old")
    with pytest.raises(CheckpointError, match="table_optimizer"):
        check_same_config(dataclasses.replace(TrainConfig(**TINY), table_optimizer="adagrad"),
                          saved, "old")
