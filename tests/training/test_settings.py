"""training/settings.py: a run records the GEMM route each product took and takes them again on
resume, or when repeated in its folder, whatever the route cache holds by then (bit for bit);
ENGRAM_GEMM still overrides, and the record says so.

Shapes. The cache's decisions only matter where the two backends round differently. At the
compare models' sizes they do, but those take seconds a step here; the tiny model's products sit
under MIN_MACS (never routed), so the tests route every product (MIN_MACS = 1). At 512 rows a
step (batch 16 x 32 tokens) MKL and oneDNN sum the weight gradient's 512 terms in different
orders (measured on the AMD EPYC Zen 5: its forward products agree bit for bit, dW does not), so
the opposite decisions change the losses: ``test_the_opposite_routes_change_the_losses`` checks
that, so the tests below can fail (each fails with the recorded routes left uninstalled, as before
this record: checked). Resumed at step 2 under the opposite routes, the losses of steps 3-6 and the
last validation loss still agreed here, while the weights did not (by up to 7e-5: Adam's step on
near-zero gradients flips with their last bits), so the resume test compares the weights too.
"""

import json
import os
import tempfile

import pytest
import torch

from engram.compute import gemm
from engram.training import settings
from engram.training.corpus import DataConfig, build_corpus
from engram.training.train import TrainConfig, train

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not gemm._onednn_available(), reason="torch without oneDNN")]

SMALL = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=16,
             table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
             warmup=2, eval_batches=1, log_every=1, eval_every=100, ckpt_every=3, lr=3e-3)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=SMALL["max_chars"]))


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Every product routed, a quiet machine, ENGRAM_GEMM unset; ``machine(cache)`` starts a new
    process's GEMM state (nothing decided, nothing installed) reading decisions file ``cache``."""
    monkeypatch.setattr(gemm, "MIN_MACS", 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv("ENGRAM_GEMM", raising=False)
    monkeypatch.setenv(gemm.ROUTES_ENV, "")  # restored (unset) afterwards

    def new_process(cache):
        monkeypatch.setattr(gemm, "_table", {})
        monkeypatch.setattr(gemm, "_mine", set())
        monkeypatch.setattr(gemm, "_loaded", False)
        monkeypatch.setattr(gemm, "_chosen", None)
        monkeypatch.setenv("ENGRAM_GEMM_CACHE", str(cache))
        os.environ[gemm.ROUTES_ENV] = ""

    return new_process


def _opposite(cache, to):
    """A decisions file holding, for every bucket ``cache`` decided, the other backend."""
    data = json.loads(cache.read_text())
    mine = data["machines"][gemm._machine()]
    flip = {"torch": "onednn", "onednn": "torch"}
    data["machines"][gemm._machine()] = {k: {**r, "route": flip[r["route"]], "busy": False}
                                         for k, r in mine.items()}
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_text(json.dumps(data))
    return to


def _losses(run):
    """Every step's loss and the last validation loss (a run stopped early validates its last)."""
    return [r["loss"] for r in run.history] + [run.history[-1]["val_loss"]]


def _cfg(tmp_path, name, **kw):
    return TrainConfig(out_dir=str(tmp_path / name), **{**SMALL, **kw})


def test_the_opposite_routes_change_the_losses(tmp_path, corpus, machine):
    """The premise of the tests below: another cache, another run (without a record to reuse)."""
    machine(tmp_path / "a" / "gemm_routes.json")
    first = train(_cfg(tmp_path, "first", steps=3), corpus, progress=False)
    assert gemm.used() and set(gemm.used().values()) <= {"torch", "onednn"}
    machine(_opposite(tmp_path / "a" / "gemm_routes.json", tmp_path / "b" / "gemm_routes.json"))
    other = train(_cfg(tmp_path, "other", steps=3), corpus, progress=False)
    assert _losses(other) != _losses(first)


def test_resume_takes_the_recorded_routes_whatever_the_cache_holds(tmp_path, corpus, machine):
    fresh = tmp_path / "a" / "gemm_routes.json"
    machine(fresh)
    full = train(_cfg(tmp_path, "full", steps=6), corpus, progress=False)
    took = gemm.used()
    machine(fresh)
    train(_cfg(tmp_path, "part", steps=2), corpus, progress=False)  # its checkpoint: step 2
    rec = settings.recorded(tmp_path / "part")
    assert rec["gemm"]["routes"] == took and rec["gemm"]["backend"] == "auto"
    assert rec["threads"] == torch.get_num_threads() == 1
    machine(_opposite(fresh, tmp_path / "b" / "gemm_routes.json"))  # a new process, other cache
    resumed = train(_cfg(tmp_path, "part", steps=6), corpus, progress=False)
    assert _losses(resumed) == _losses(full)
    for (k, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    assert gemm.used() == took  # none of the cache's (opposite) decisions was taken


def test_a_repeated_run_takes_the_routes_its_folder_recorded(tmp_path, corpus, machine):
    """Killed before its first checkpoint: settings.json (written at its start) has the routes."""
    fresh = tmp_path / "a" / "gemm_routes.json"
    machine(fresh)
    first = train(_cfg(tmp_path, "run", steps=3, ckpt_every=100), corpus, progress=False)
    for p in (tmp_path / "run" / "checkpoints").iterdir():
        p.unlink()  # as if it died before saving
    assert settings.recorded(tmp_path / "run")["gemm"]["routes"] == gemm.used()
    machine(_opposite(fresh, tmp_path / "b" / "gemm_routes.json"))
    again = train(_cfg(tmp_path, "run", steps=3, ckpt_every=100), corpus, progress=False)
    assert again.step == 3 and _losses(again) == _losses(first)


def test_engram_gemm_overrides_the_record_and_the_record_says_so(tmp_path, corpus, machine,
                                                                monkeypatch):
    fresh = tmp_path / "a" / "gemm_routes.json"
    machine(fresh)
    train(_cfg(tmp_path, "part", steps=3), corpus, progress=False)
    routes = gemm.used()
    machine(fresh)
    monkeypatch.setenv("ENGRAM_GEMM", "torch")
    train(_cfg(tmp_path, "part", steps=6), corpus, progress=False)
    rec = settings.recorded(tmp_path / "part")
    assert rec["gemm"]["backend"] == "torch"
    assert rec["gemm"]["routes"] == routes  # installed, kept for a resume under 'auto'
    for key in routes:  # e.g. '1t 512x32x96': every product went to torch all the same
        n, i, o = map(int, key.split()[1].split("x"))
        assert gemm.route(n, i, o) == "torch"


def test_recorded_reads_a_sharded_checkpoint_and_prefers_it_to_settings_json(tmp_path):
    """A torchrun run's record sits in its checkpoint's dense part (dist_checkpoint.py's layout);
    settings.json adds buckets decided since, when it is of the same machine."""
    from engram.artifacts.checkpoint import save_checkpoint

    here = gemm._machine()
    ckpt = {"gemm": {"backend": "auto", "machine": here, "routes": {"1t 64x8x8": "onednn"}},
            "threads": 2}
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    save_checkpoint(step / "dense", 2, {"x": torch.zeros(1)}, {"settings": ckpt}, keep=0)
    (step.parent / "latest.json").write_text(json.dumps({"step": 2, "dir": step.name}))
    assert settings.recorded(tmp_path / "run") == ckpt
    later = {"gemm": {"backend": "auto", "machine": here,
                      "routes": {"1t 64x8x8": "torch", "1t 128x8x8": "torch"}}, "threads": 2}
    (tmp_path / "run" / settings.SETTINGS).write_text(json.dumps(later))
    assert settings.recorded(tmp_path / "run")["gemm"]["routes"] == {"1t 64x8x8": "onednn",
                                                                      "1t 128x8x8": "torch"}
    later["gemm"]["machine"] = "another CPU | torch 0"
    (tmp_path / "run" / settings.SETTINGS).write_text(json.dumps(later))
    assert settings.recorded(tmp_path / "run") == ckpt
    assert settings.recorded(tmp_path / "nothing") == {}
