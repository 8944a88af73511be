"""study-nine: equal parameters across the Nine splits and the hashed baseline; a small run writes
every output and its flip detection works."""

import json

import pytest

from engram.studies.compare import budget
from engram.studies.nine import NineStudyConfig, run_nine_study, study_configs, table_params
from engram.studies.nine_report import flip_step
from engram.training.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _counts(cfg, vocab=38_304):
    import torch

    from engram.models.nine_model import build_nine_lm, nine_param_counts

    with torch.device("meta"):
        return nine_param_counts(build_nine_lm(cfg.model_config(vocab),
                                               (cfg.max_ngram_size - 1) * cfg.hot_rows))


def test_default_configurations_have_equal_parameters():
    sc = NineStudyConfig()
    cfgs = study_configs(budget(TrainConfig(), sc), sc)
    assert list(cfgs) == ["hash-10k", "nine-2k/8k", "nine-1k/9k", "hash-6k", "hash-16k"]
    equal = [n for n in cfgs if n.startswith("nine-")] + ["hash-10k"]
    totals = {n: _counts(cfgs[n]) for n in cfgs}
    ref = totals["hash-10k"]
    for n in equal:
        assert abs(totals[n]["total"] - ref["total"]) / ref["total"] < 1e-3, n
        assert abs(totals[n]["table"] - ref["table"]) / ref["table"] < 1e-3, n
        assert totals[n]["table"] == table_params(cfgs[n])
    assert totals["hash-6k"]["table"] < ref["table"] < totals["hash-16k"]["table"]
    assert cfgs["nine-2k/8k"].hot_rows == 2000 and cfgs["nine-2k/8k"].shared_tables


def test_flip_step():
    assert flip_step([0, 10, 20, 30], [0.3, 0.1, -0.1, 0.2]) == 20
    assert flip_step([0, 10], [0.3, 0.1]) is None
    assert flip_step([0, 10, 20], [-0.1, 0.2, 0.0]) == 20  # counts only after being positive


def test_small_study_writes_everything(tmp_path):
    sc = NineStudyConfig(out_dir=str(tmp_path / "nine"), seeds=(0,), workers=1, steps=4,
                         batch_size=4, seq_len=32, eval_every=2, eval_batches=2, total_rows=500,
                         hot_rows=(100,), small_rows=300, large_rows=800, ref_hot_rows=100,
                         engram_layers=(0, 1), n_embed_per_ngram=32)
    base = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2)
    summary = run_nine_study(sc, base)
    out = tmp_path / "nine"
    for f in ("nine.json", "report.md", "final_loss.png", "hot_cold_delta.png", "delta_alpha.png",
              "alpha_buckets.png"):
        assert (out / f).exists(), f
    saved = json.loads((out / "nine.json").read_text())
    c = saved["configs"]["nine-100/400"]
    assert c["steps"] == [0, 2, 4] and c["served_hot_share"] > 0
    assert saved["configs"]["hash-500"]["served_hot_share"] == 0
    assert set(c["delta_alpha_mean"]) == {"0", "1"}
    assert sum(b["count"] for b in c["alpha_buckets"]["0"]) > 0
    assert "**4. Gate mismatch.**" in (out / "report.md").read_text()
    assert set(summary["findings"]) == {"1_collisions_not_bottleneck", "2_flip",
                                        "3_nine_flips_earlier", "4_gate_mismatch"}
    with pytest.raises(ValueError, match="hot_rows"):
        study_configs(base, NineStudyConfig(total_rows=500, hot_rows=(600,)))


_KILLED_RUN = """
import json, sys, torch
from engram.studies.nine import train_and_watch
from engram.training.train import TrainConfig
torch.set_num_threads(1)
cfg = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v
                     for k, v in json.loads(sys.argv[1]).items()})
train_and_watch(cfg, int(sys.argv[2]), 5)
"""


def test_killed_nine_run_resumes_to_the_same_numbers(tmp_path):
    """A real SIGKILL mid-run; train_and_watch run again resumes from the last checkpoint (its
    tier history included) and ends with the uninterrupted run's numbers, every one."""
    import dataclasses
    import os
    import signal
    import subprocess
    import sys
    import time

    from engram.studies.nine import train_and_watch
    from engram.artifacts.checkpoint import CheckpointError
    from engram.training.loop import restore
    from engram.training.train import FileCheckpoints, build_run

    sc = NineStudyConfig(steps=12, batch_size=4, seq_len=32, eval_every=1, eval_batches=2,
                         total_rows=500, hot_rows=(100,), small_rows=300, large_rows=800,
                         engram_layers=(0, 1), n_embed_per_ngram=32)
    base = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2)
    cfg = study_configs(budget(base, sc), sc)["nine-100/400"]
    killed = dataclasses.replace(cfg, out_dir=str(tmp_path / "killed"))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, json.dumps(killed.to_dict()), "100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ptr, deadline = tmp_path / "killed" / "checkpoints" / "latest.json", time.time() + 300
    while time.time() < deadline and not (ptr.exists() and json.loads(ptr.read_text())["step"] >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run = build_run(killed)
    assert restore(run, FileCheckpoints(killed.out_dir))
    assert 3 <= run.step < sc.steps, "the run was not killed mid-way"
    assert [h["step"] for h in run.history] == list(range(run.step + 1))  # its records so far
    with pytest.raises(CheckpointError, match="ref_hot_rows"):  # measured with other hot positions
        train_and_watch(killed, 50, 5)
    resumed = train_and_watch(killed, 100, 5)
    whole = train_and_watch(dataclasses.replace(cfg, out_dir=str(tmp_path / "whole")), 100, 5)
    assert [h["step"] for h in whole["history"]] == list(range(sc.steps + 1))
    assert resumed["history"] == whole["history"]
    assert resumed["final"] == whole["final"]
