"""Precision and compile under torchrun: DDP + row-sharded tables on real gloo process groups.

bf16 at world size 2 tracks the single-process fp32 run (tables sharded in bf16); fp16's loss
scale is agreed over the ranks and saved with the dense part of a sharded checkpoint; --device
picks the process group's backend, and refuses what the machine cannot give before joining.
"""

import pytest
import torch
from safetensors import safe_open
from test_distributed import (  # noqa: F401  (corpus, reference: fixtures)
    STEPS,
    _cfg,
    _metrics,
    _train_worker,
    corpus,
    reference,
)

from engram.artifacts.checkpoint import latest_checkpoint, load_checkpoint
from engram.errors import UserError
from engram.models.precision import autocast_supported
from engram.training.dist_checkpoint import consolidate, latest_distributed
from engram.training.process_group import backend_for, spawn_local
from engram.training.train import train

BF16_TOL = 0.01  # tests/training/test_precision.py: a tenth of this config's seed spread


def test_bf16_at_world_2_tracks_fp32_with_bf16_shards(tmp_path, corpus, reference):  # noqa: F811
    spawn_local(_train_worker, 2, _cfg(tmp_path / "run", steps=STEPS, precision="bf16"), corpus)
    got = _metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for g, w in zip(got, reference):
        assert abs(g["loss"] - w["loss"]) < BF16_TOL, g["step"]
        if "val_loss" in w:
            assert abs(g["val_loss"] - w["val_loss"]) < BF16_TOL
    step_dir, _ = latest_distributed(tmp_path / "run")
    for shard in step_dir.glob("shard-*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes = {k.split(".", 1)[1]: f.get_tensor(k).dtype for k in f.keys()}
        # Each rank's rows in bf16, their RowAdam moments in float32.
        assert dtypes["weight"] == torch.bfloat16 and dtypes["exp_avg"] == torch.float32


@pytest.mark.skipif(not autocast_supported("cpu", torch.float16), reason="no CPU fp16")
def test_fp16_at_world_2_saves_its_loss_scale_and_consolidates(tmp_path, corpus):  # noqa: F811
    """The scale is the same on every rank (a skip is agreed over the ranks), saved once with the
    dense part, and read back by a single-process run that resumes the sharded checkpoint."""
    cfg = _cfg(tmp_path / "run", steps=STEPS, precision="fp16")
    spawn_local(_train_worker, 2, cfg, corpus)
    one = train(_cfg(tmp_path / "one", steps=STEPS, precision="fp16"), corpus, progress=False)
    got = _metrics(tmp_path / "run")
    for g, w in zip(got, one.history):
        assert abs(g["loss"] - w["loss"]) < 0.05, g["step"]  # fp16 rounding; same skipped steps
    step_dir, _ = latest_distributed(tmp_path / "run")
    saved = load_checkpoint(latest_checkpoint(step_dir / "dense"))[0]["optim"]["scaler"]
    assert saved == one.optim.scaler.state_dict()
    consolidate(tmp_path / "run", tmp_path / "w1")
    resumed = train(_cfg(tmp_path / "w1", steps=STEPS, precision="fp16"), corpus, progress=False)
    assert resumed.step == STEPS and resumed.optim.scaler.state_dict() == saved


@pytest.mark.slow
def test_compiled_model_under_ddp_tracks_eager(tmp_path, corpus, reference):  # noqa: F811
    spawn_local(_train_worker, 2, _cfg(tmp_path / "run", steps=STEPS, compile=True), corpus, 600)
    for g, w in zip(_metrics(tmp_path / "run"), reference):
        assert g["loss"] == pytest.approx(w["loss"], rel=2e-4, abs=2e-4), g["step"]


def test_device_picks_the_backend_and_refuses_what_is_not_there(monkeypatch):
    """CUDA is faked (counts only): --device under torchrun, before the process group exists."""
    for k, v in dict(WORLD_SIZE=3, LOCAL_RANK=2, LOCAL_WORLD_SIZE=3).items():
        monkeypatch.setenv(k, str(v))
    assert backend_for("cpu") == "gloo" and backend_for("auto") is None
    with pytest.raises(UserError, match="each rank takes its own GPU"):
        backend_for("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="3 rank\\(s\\) on this machine need a GPU each, torch "
                                        "sees 1"):
        backend_for("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert backend_for("cuda") == "nccl"
