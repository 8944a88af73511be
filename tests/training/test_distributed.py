"""Data-parallel training with sharded tables, on real gloo process groups over loopback.

The oracle is train.py's single-process run on the same global batch: world size 2 and 3 (and a
sharded checkpoint consolidated back to one process) must reach its losses, up to float summation
order. Faults are real: a rank is SIGKILLed or SIGSTOPped mid-run.
"""

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engram.artifacts.checkpoint import CheckpointError
from engram.training.corpus import DataConfig, build_corpus
from engram.training.dist_checkpoint import consolidate, latest_distributed
from engram.training.distributed import train_distributed
from engram.training.process_group import init_distributed, spawn_local, start_local
from engram.training.train import TrainConfig, train

# batch_size 6 splits over 2 and 3 ranks; min_lr_ratio=1 makes the schedule independent of
# ``steps``, so a run launched for many steps and killed resumes on the reference's schedule.
TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=6,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=2, min_lr_ratio=1.0, eval_batches=2, log_every=1, eval_every=2, ckpt_every=3,
            lr=3e-3)
STEPS = 6


def _cfg(path, **kw) -> TrainConfig:
    return TrainConfig(out_dir=str(path), **{**TINY, **kw})


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=2e-5, abs=2e-5), g["step"]
        assert g.get("last_loss") == pytest.approx(w.get("last_loss"), rel=2e-5, abs=2e-5)
        assert ("val_loss" in g) == ("val_loss" in w)
        if "val_loss" in w:
            assert g["val_loss"] == pytest.approx(w["val_loss"], rel=2e-5, abs=2e-5), g["step"]


def _train_worker(cfg: TrainConfig, corpus, timeout_s: float = 30, result: str | None = None,
                  table_init: str = "replicated"):
    # Ranks share the cores. Not via cfg.threads: the in-process runs (reference, consolidate)
    # would apply it to the test process itself, and change the numerics of later tests there.
    torch.set_num_threads(1)
    try:
        train_distributed(cfg, corpus, progress=False, timeout_s=timeout_s, table_init=table_init)
    except Exception as e:  # the fault tests read what the survivor reported
        if result is None:
            raise
        Path(f"{result}.{os.environ['RANK']}").write_text(f"{type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """train.py, one process, STEPS steps: the losses every other run must reproduce."""
    run = train(_cfg(tmp_path_factory.mktemp("ref") / "run", steps=STEPS), corpus, progress=False)
    return run.history




def _fail_one_rank(out: Path, fault: str, timeout: float = 8.0) -> tuple[str, float]:
    """Run world size 2 until its step-3 checkpoint, then SIGKILL or SIGSTOP rank 1.

    Returns what rank 0 raised and how long it took to give up.
    """
    result = str(out.parent / "error")
    procs = start_local(_train_worker, 2, _cfg(out, steps=1000, ckpt_every=1), None, timeout,
                        result)
    try:
        end = time.time() + 120
        while time.time() < end:
            ptr = out / "checkpoints" / "latest.json"
            if ptr.exists() and json.loads(ptr.read_text())["step"] >= 3:
                break
            time.sleep(0.05)
        t0 = time.time()
        os.kill(procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        procs[0].join(timeout + 30)
        elapsed = time.time() - t0
        assert procs[0].exitcode is not None, "rank 0 hung on a failed peer"
    finally:
        for p in procs:
            p.kill()
            p.join()
    return Path(f"{result}.0").read_text(), elapsed


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A world-size-2 run whose rank 1 was SIGKILLed after the step-3 checkpoint."""
    out = tmp_path_factory.mktemp("killed") / "run"
    msg, elapsed = _fail_one_rank(out, "kill")
    return out, msg, elapsed


def test_killed_rank_is_reported_and_world_2_equals_world_1(killed, reference):
    out, msg, elapsed = killed
    assert elapsed < 15, f"rank 0 took {elapsed:.1f}s to notice a dead peer"
    assert msg.startswith("DistributedError: rank 0/2") and "relaunch" in msg, msg
    assert "Last complete checkpoint: step" in msg
    got = _metrics(out)[:STEPS]
    assert len(got) >= 3
    _assert_same_run(got, reference[:len(got)])  # world size 2 == train.py on the same batches
    step_dir, info = latest_distributed(out)
    assert info["world"] == 2 and info["step"] >= 3
    assert sorted(p.name for p in step_dir.glob("shard-*")) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]


def test_world_2_checkpoint_resumes_at_world_3(killed, reference, tmp_path, corpus):
    out = tmp_path / "w3"
    shutil.copytree(killed[0], out)
    spawn_local(_train_worker, 3, _cfg(out, steps=STEPS), corpus)
    _assert_same_run(_metrics(out)[:STEPS], reference)
    assert latest_distributed(out)[1]["world"] == 3


def test_world_2_checkpoint_loads_in_one_process(killed, reference, tmp_path, corpus):
    consolidate(killed[0], tmp_path / "w1")
    # The torchrun run's own folder opens in one process (engram.open, generate, eval): every
    # table row from its shards, the same model as the consolidated checkpoint.
    from engram.serving.loader import open_model
    from engram.artifacts.checkpoint import latest_checkpoint, load_checkpoint

    served = open_model(killed[0]).model.state_dict()
    want = load_checkpoint(latest_checkpoint(tmp_path / "w1" / "checkpoints"))[0]["model"]
    assert served.keys() == want.keys()
    assert all(torch.equal(served[k], want[k]) for k in want)
    with pytest.raises(CheckpointError, match="^[^ ]+ holds a torchrun run's sharded"):
        latest_checkpoint(killed[0] / "checkpoints")
    run = train(_cfg(tmp_path / "w1", steps=STEPS), corpus, progress=False)  # train.py resumes
    _assert_same_run(run.history[:STEPS], reference)
    # A damaged shard is refused, not loaded.
    shutil.copytree(killed[0], tmp_path / "bad")
    shard = next(latest_distributed(tmp_path / "bad")[0].glob("shard-00001-*"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        consolidate(tmp_path / "bad", tmp_path / "bad1")


def test_torchrun_and_one_process_run_the_same_loop(tmp_path, corpus):
    """Both go through loop.fit with the same hooks: records at the same steps with the same keys,
    the same schedule and token counts, validation where train.py has it (the full sweep at the
    end), checkpoints at the same steps; the losses agree up to summation order."""
    kw = dict(steps=5, grad_accum=2, log_every=2, eval_every=3, ckpt_every=2, final_eval_full=True)
    one = train(_cfg(tmp_path / "one", **kw), corpus, progress=False).history
    spawn_local(_train_worker, 2, _cfg(tmp_path / "two", **kw), corpus)
    two = _metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [2, 4, 5]  # every log_every, and the last
    assert [sorted(r) for r in two] == [sorted(r) for r in one]
    assert [(r["lr"], r["tokens"]) for r in two] == [(r["lr"], r["tokens"]) for r in one]
    _assert_same_run(two, one)
    assert "val_loss" in one[-1] and "val_loss" not in one[0]  # eval_every 3: only the last
    assert json.loads((tmp_path / "two" / "checkpoints" / "latest.json").read_text())["step"] == 5
    assert latest_distributed(tmp_path / "two")[1]["world"] == 2
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").glob("step_*")) == [
        "step_00000004", "step_00000005"]  # as train.py's: every 2 and the last, 2 kept
    assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").glob("step_*")) == [
        "step_00000004.safetensors", "step_00000005.safetensors"]


def test_ranks_read_one_folder_of_shards(tmp_path):
    """Under torchrun every rank opens the same prepared folder (memory-mapped) and reads the
    global batch's windows from it: world size 2 on --data equals one process."""
    from engram.training.prepare import PrepareConfig, prepare
    from engram.training.sources import load_documents

    (tmp_path / "in").mkdir()
    for i, d in enumerate(load_documents("kjv", max_chars=60_000)):
        (tmp_path / "in" / f"{i:03d}.txt").write_text(d.text)
    data = tmp_path / "data"
    prepare(PrepareConfig(out=str(data), input=[str(tmp_path / "in")], workers=0,
                          val_fraction=0.3, shard_mb=0.01), progress=False)
    kw = dict(steps=4, max_chars=None, data=str(data))
    one = train(_cfg(tmp_path / "one", **kw), progress=False).history
    spawn_local(_train_worker, 2, _cfg(tmp_path / "two", **kw), None)
    _assert_same_run(_metrics(tmp_path / "two"), one)


@pytest.mark.slow
def test_hung_rank_times_out_with_a_clear_error(tmp_path):
    msg, elapsed = _fail_one_rank(tmp_path / "run", "hang", timeout=5.0)
    assert 4 < elapsed < 20
    assert msg.startswith("DistributedError: rank 0/2") and "5s timeout" in msg, msg


@pytest.mark.slow
def test_sharded_init_is_the_same_at_every_world_size(tmp_path, corpus):
    """table_init="sharded" (no rank ever holds a whole table): world 1 == world 2 -> 3."""
    spawn_local(_train_worker, 1, _cfg(tmp_path / "w1", steps=4), corpus, 30, None, "sharded")
    spawn_local(_train_worker, 2, _cfg(tmp_path / "w2", steps=2), corpus, 30, None, "sharded")
    spawn_local(_train_worker, 3, _cfg(tmp_path / "w2", steps=4), corpus, 30, None, "sharded")
    _assert_same_run(_metrics(tmp_path / "w2"), _metrics(tmp_path / "w1"))


class _Joined(Exception):
    pass


@pytest.mark.parametrize("gpus, backend", [(1, "gloo"), (3, "nccl")])
def test_ranks_share_gpus_only_over_gloo(monkeypatch, gpus, backend):
    """With CUDA, a 3-rank job on fewer than 3 GPUs (the tests above, on a 1-GPU machine) must not
    take NCCL: set_device(LOCAL_RANK) fails past the last GPU. CUDA is faked here."""
    devices, joined = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init(backend, **kw):
        joined.append(backend)
        raise _Joined
    monkeypatch.setattr(dist, "init_process_group", init)
    for k, v in dict(RANK=2, WORLD_SIZE=3, LOCAL_RANK=2, LOCAL_WORLD_SIZE=3,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=1).items():
        monkeypatch.setenv(k, str(v))
    warns = pytest.warns(RuntimeWarning, match="1 GPU") if gpus == 1 else contextlib.nullcontext()
    with pytest.raises(_Joined), warns:
        init_distributed()
    assert joined == [backend] and devices == ([2] if backend == "nccl" else [])
