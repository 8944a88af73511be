"""Device, precision and compile (models/precision.py) on the CPU: bf16 and fp16 runs track the
fp32 run, tables are stored in the precision with RowAdam's state in float32, fp16's loss scale
skips non-finite steps and resumes exactly, compile equals eager, bad input fails before any work,
and a bf16 checkpoint serves in fp32."""

import dataclasses
import json
import statistics

import numpy as np
import pytest
import torch

from engram.artifacts.checkpoint import load_checkpoint
from engram.errors import NonFinite, UserError
from engram.models.precision import (
    LossScaler,
    autocast_supported,
    check_compile,
    check_precision,
    resolve_device,
)
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.loader import open_model
from engram.studies.evaluate import EvalConfig, run_eval
from engram.tables.store import MemoryTable
from engram.training import sparse_rows
from engram.training.corpus import DataConfig, build_corpus
from engram.training.loop import Run, evaluate, fit
from engram.training.train import TrainConfig, build_run, train, train_step

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=3, eval_batches=2, log_every=1, eval_every=5, ckpt_every=3, lr=3e-3)
# How far a bf16 run may stray from the fp32 run (nats), step by step and in validation. On this
# config two fp32 seeds end 0.12 (training, last 10 steps) and 0.19 (validation) apart; bf16 moved
# by at most 6e-4 over 40 steps when this was written. A tenth of the seed spread: a bf16 run must
# be indistinguishable from the fp32 run on the scale runs are compared at.
BF16_TOL = 0.01
HAS_FP16 = autocast_supported("cpu", torch.float16)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


def _cfg(tmp_path, name="run", **kw) -> TrainConfig:
    return TrainConfig(out_dir=str(tmp_path / name), **{**TINY, **kw})


class _Losses:
    def __init__(self):
        self.losses = []

    def start(self, run):
        pass

    def after_step(self, run, lr, loss):
        self.losses.append(loss)

    def end(self, run):
        pass


def _fit(cfg, corpus) -> tuple[Run, list[float]]:
    run, rec = build_run(cfg, corpus), _Losses()
    fit(run, [rec])
    return run, rec.losses


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, corpus):
    return _fit(_cfg(tmp_path_factory.mktemp("fp32"), steps=40), corpus)


def test_bf16_tracks_fp32_and_stores_tables_in_bf16(tmp_path, corpus, fp32_run):
    ref, ref_losses = fp32_run
    run, losses = _fit(_cfg(tmp_path, steps=40, precision="bf16"), corpus)
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < BF16_TOL, max(diffs)
    assert max(diffs) > 0  # autocast did something: the products ran in bf16
    assert abs(evaluate(run) - evaluate(ref)) < BF16_TOL
    # The tables in bf16, everything else (weights of the autocast products) in float32; RowAdam's
    # moments float32, AdamW's state float32.
    tables = {id(m.weight) for m in run.model.modules() if isinstance(m, MemoryTable)}
    assert tables and all(p.dtype == (torch.bfloat16 if id(p) in tables else torch.float32)
                          for p in run.model.parameters())
    for st in run.optim.tables.state.values():
        assert st["moments"].dtype == torch.float32
    assert all(v.dtype == torch.float32 for st in run.optim.dense.state.values()
               for k, v in st.items() if k != "step")
    assert run.optim.scaler is None


@pytest.mark.skipif(not HAS_FP16, reason="this torch's CPU autocast has no float16")
def test_fp16_scales_the_loss_and_resumes_exactly(tmp_path, corpus, fp32_run):
    """fp16 on the CPU: the first steps overflow at the initial scale 2^16 and are skipped (the
    scale backs off), then the run tracks fp32 (looser than bf16: the skipped steps); the scale is
    in the checkpoint, so a resumed run equals an uninterrupted one."""
    _, ref_losses = fp32_run
    whole = train(_cfg(tmp_path, "whole", steps=12, precision="fp16"), corpus, progress=False)
    assert all(np.isfinite(r["loss"]) for r in whole.history)
    assert abs(whole.history[-1]["loss"] - ref_losses[11]) < 0.2
    assert whole.optim.scaler.scale <= 2.0 ** 16
    assert {m.weight.dtype for m in whole.model.modules() if isinstance(m, MemoryTable)} == {
        torch.float16}
    # Interrupted after the step-6 checkpoint (ckpt_every 3), resumed: the same losses and scale.
    # (min_lr_ratio 1: the schedule does not depend on the steps asked for)
    flat = train(_cfg(tmp_path, "flat", steps=12, precision="fp16", min_lr_ratio=1.0), corpus,
                 progress=False)
    part = train(_cfg(tmp_path, "part", steps=6, precision="fp16", min_lr_ratio=1.0), corpus,
                 progress=False)
    resumed = train(dataclasses.replace(part.cfg, steps=12), corpus, progress=False)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in flat.history]
    assert resumed.optim.scaler.state_dict() == flat.optim.scaler.state_dict()


def test_loss_scaler_skips_a_non_finite_step_on_every_table_and_weight(corpus):
    cfg = TrainConfig(out_dir="/nonexistent", **{**TINY, "precision": "bf16"})
    run = build_run(cfg, corpus)
    run.optim.scaler = scaler = LossScaler(init_scale=8.0, growth_interval=2)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    # A step whose gradient overflows: every weight and table row stays, the scale halves.
    hook = run.model.norm.weight.register_hook(lambda g: g * float("inf"))
    train_step(run)
    assert scaler.scale == 4.0 and scaler.good_steps == 0
    assert all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    assert all(p.grad is None for p in run.model.parameters())
    hook.remove()
    train_step(run)  # finite: the step is taken, and the grads were divided back by the scale
    assert not all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    train_step(run)
    assert scaler.scale == 8.0  # two finite steps: grown again
    sd = scaler.state_dict()
    other = LossScaler()
    other.load_state_dict(json.loads(json.dumps(sd)))
    assert other.state_dict() == sd


@pytest.mark.skipif(not HAS_FP16, reason="this torch has no fp16 autocast on the CPU")
def test_the_non_finite_stop_spares_the_loss_scales_own_skips(corpus):
    """issue 27's stop at the first non-finite loss or gradient, under fp16: a step the loss scale
    skips on purpose (its gradient overflowed at a scale above 1) is not one; an overflow at a
    scale of 1, or a non-finite loss, is, and stops the run naming the step."""
    cfg = TrainConfig(out_dir="/nonexistent", **{**TINY, "precision": "fp16", "steps": 6})
    run = build_run(cfg, corpus)
    # from 2^30 (whatever the init, the first steps overflow): skipped, none stops the run
    run.optim.scaler = LossScaler(init_scale=2.0 ** 30)
    fit(run, [])
    assert run.step == 6 and run.optim.scaler.scale < 2.0 ** 30
    run = build_run(cfg, corpus)
    run.optim.scaler = scaler = LossScaler(init_scale=2.0)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    hook = run.model.norm.weight.register_hook(lambda g: g * float("inf"))
    train_step(run)  # at scale 2: skipped, backed off to 1
    assert scaler.scale == 1.0
    with pytest.raises(NonFinite, match="step 1: the loss is .* gradient norm inf") as e:
        train_step(run)  # at scale 1 the overflow is the run's own
    assert e.value.step == 1 and scaler.scale == 1.0  # stopped before the scale moved
    hook.remove()
    assert all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    scaler.scale = 2.0 ** 10
    run.optim.zero_grad(set_to_none=True)  # the stopped step's (a run ends there)
    nan = run.model.norm.register_forward_hook(lambda m, i, out: out * float("nan"))
    with pytest.raises(NonFinite, match="step 1: the loss is nan"):
        train_step(run)  # a NaN loss is never the scale's doing
    nan.remove()


def test_compile_is_refused_where_it_cannot_build(monkeypatch):
    check_compile(torch.device("cpu"))  # this machine has g++ (the compile tests need it too)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(UserError, match="needs a C[+][+] compiler; '/nonexistent/c[+][+]'"):
        check_compile(torch.device("cpu"))


def test_unscale_divides_dense_and_sparse_grads_and_sees_inf_in_either():
    dense = torch.nn.Parameter(torch.ones(3))
    table = torch.nn.Parameter(torch.ones(5, 2, dtype=torch.float16))
    dense.grad = torch.full((3,), 8.0)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1, 3]]), torch.full((3, 2), 4.0),
                                         (5, 2)).to(torch.float16)
    s = LossScaler(init_scale=4.0)
    assert s.unscale_([dense, table])
    assert torch.equal(dense.grad, torch.full((3,), 2.0))
    assert torch.equal(table.grad.coalesce().to_dense()[1],
                       torch.full((2,), 2.0, dtype=torch.float16))
    table.grad = torch.sparse_coo_tensor(torch.tensor([[2]]), torch.tensor([[float("inf"), 0.0]]),
                                         (5, 2)).to(torch.float16)
    assert not s.unscale_([dense, table])
    assert not s.unscale_([dense, table], sum_ranks=lambda v: v)
    assert s.unscale_([dense], sum_ranks=lambda v: [0.0])  # finite here, as the ranks agree


def test_low_precision_row_gradients_are_summed_in_float32():
    """A row read at many positions: torch sums the repeats in bfloat16 and stalls (1000 x 1e-3
    sums to 0.5); ours sum in float32 and round once."""
    n = 1000
    vals = torch.full((n, 4), 1e-3).to(torch.bfloat16)
    g = torch.sparse_coo_tensor(torch.zeros(1, n, dtype=torch.long), vals, (3, 4))
    want = vals.float().sum(0)
    assert float(g.coalesce().values()[0, 0]) < 0.6  # the stall this guards against
    for got in (sparse_rows.coalesce_rows(g), sparse_rows.coalesce(g)):
        assert got.dtype == torch.bfloat16 and got.is_coalesced()
        assert torch.allclose(got.values()[0].float(), want, rtol=2 ** -8)
    f32 = g.float()
    assert torch.equal(sparse_rows.coalesce(f32).values(), f32.coalesce().values())


def test_bad_device_and_precision_fail_before_any_work(tmp_path):
    with pytest.raises(UserError, match="precision must be one of"):
        TrainConfig(precision="fp8")
    with pytest.raises(UserError, match="device must be auto, cpu, cuda or cuda:N"):
        TrainConfig(device="gpu")
    with pytest.raises(UserError, match="precision must be one of"):
        EvalConfig(source="kjv", precision="int8")
    with pytest.raises(UserError, match="device must be"):
        GenerationConfig(device="tpu")
    # A device whose autocast lacks the precision (the meta device has none at all).
    with pytest.raises(UserError, match="not supported on meta"):
        check_precision("bf16", torch.device("meta"))
    assert not autocast_supported("cpu", torch.float64)  # CPU autocast: bf16 and fp16 only
    assert autocast_supported("cpu", torch.bfloat16)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            resolve_device("cuda:1")


# The command line's refusals (--device cuda without CUDA, an unknown --precision, --compile
# without a compiler): cases in tests/test_bad_input.py.


@pytest.fixture(scope="module")
def bf16_run_dir(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("bf16") / "run"
    train(TrainConfig(out_dir=str(out), steps=6, precision="bf16", **{**TINY, "ckpt_every": 6}),
          corpus, progress=False)
    return out


def test_a_bf16_checkpoint_serves_in_fp32_and_bf16(bf16_run_dir):
    saved = json.loads((bf16_run_dir / "config.json").read_text())
    assert saved["precision"] == "bf16" and saved["device"] == "cpu" and saved["compile"] is False
    ec = dict(source="kjv", max_chars=3_000, batch_size=4)
    fp32 = run_eval(str(bf16_run_dir), EvalConfig(**ec), progress=False)
    bf16 = run_eval(str(bf16_run_dir), EvalConfig(**ec, precision="bf16"), progress=False)
    assert np.isfinite(fp32["loss"]) and abs(fp32["loss"] - bf16["loss"]) < BF16_TOL
    served = open_model(bf16_run_dir)
    # The tables were saved in bf16 and load into the float32 model as they are (exactly).
    saved = load_checkpoint(served.checkpoint_file)[0]["model"]
    tables = [k for k in saved if ".engram.table." in k]
    assert tables and all(saved[k].dtype == torch.bfloat16 for k in tables)
    own = served.model.state_dict()
    assert all(own[k].dtype == torch.float32 and torch.equal(own[k], saved[k].float())
               for k in tables)
    prompts = [[int(i) for i in served.vocab[10:15]]]
    out = {p: Generator(served.model, served.hasher, served.vocab,
                        GenerationConfig(max_new_tokens=4, precision=p)).generate(prompts).tokens
           for p in ("fp32", "bf16")}
    assert all(len(t[0]) == 4 for t in out.values())


def test_compiled_training_equals_eager(tmp_path, corpus):
    """torch.compile of the whole model with the compiler's cheapest backend (aot_eager: the
    graph capture and autograd of torch.compile, no code generation): the table reads break the
    graph, the gate and conv trace as plain ops; losses and weights equal eager ones to float
    rounding. The real compiler runs in the slow test below."""
    cfg = _cfg(tmp_path, steps=3)
    eager, compiled = build_run(cfg, corpus), build_run(cfg, corpus)
    compiled.model.compile(backend="aot_eager")
    for _ in range(3):
        a, b = train_step(eager), train_step(compiled)
        eager.step += 1
        compiled.step += 1
        assert b == pytest.approx(a, rel=1e-5)
    assert evaluate(compiled) == pytest.approx(evaluate(eager), rel=1e-5)
    import torch._dynamo

    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"precision": "bf16", "hc_mult": 2}, {"moe": True,
                                                                          "engram": False}])
def test_compile_option_trains_like_eager(tmp_path, corpus, kw):
    """``TrainConfig.compile`` (inductor): Engram, bf16 with hyper-connections, MoE."""
    base = _cfg(tmp_path, steps=4, **kw)
    _, eager = _fit(base, corpus)
    _, compiled = _fit(dataclasses.replace(base, compile=True), corpus)
    assert compiled == pytest.approx(eager, rel=2e-4, abs=2e-4)


def test_study_and_eval_configs_carry_device_and_precision():
    from engram.studies.finetune import FinetuneStudyConfig as FinetuneConfig

    assert FinetuneConfig().device == "cpu" and FinetuneConfig().precision == "fp32"
    with pytest.raises(UserError):
        FinetuneConfig(precision="bf8")
    cfg = TrainConfig(device="auto", precision="bf16", compile=True)
    assert {k: cfg.to_dict()[k] for k in ("device", "precision", "compile")} == {
        "device": "auto", "precision": "bf16", "compile": True}
    # Resuming on another device, in another precision or compiled is allowed (bookkeeping).
    from engram.training.train import check_same_config

    check_same_config(TrainConfig(), cfg.to_dict(), "x")


def test_seed_spread_behind_the_tolerance_is_real(fp32_run, tmp_path, corpus):
    """The justification of BF16_TOL, kept honest: another seed moves the loss by >10x it."""
    _, a = fp32_run
    _, b = _fit(_cfg(tmp_path, steps=40, seed=1), corpus)
    assert abs(statistics.mean(a[-10:]) - statistics.mean(b[-10:])) > 5 * BF16_TOL
