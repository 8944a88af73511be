"""torchrun with the file tier (training/tier_shards.py): each rank's shard of the tables and its
optimiser state in its own tier folder. The oracle is the same world-size-2 run with its tables in
memory: the same losses, bit for bit, and the same tables; resume, SIGKILL, refusals, budget."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import engram
from engram.artifacts.checkpoint import CheckpointError
from engram.artifacts.tier_files import TierError, TierFiles, rank_folder
from engram.errors import UserError
from engram.retrieval.primes import rows_per_layer
from engram.training.corpus import DataConfig, build_corpus
from engram.training.dist_checkpoint import consolidate, latest_distributed
from engram.training.distributed import build_distributed_run, train_distributed
from engram.training.process_group import Dist, spawn_local, start_local
from engram.training.tier_shards import Shard
from engram.training.train import TrainConfig, build_run, train

# batch_size 6 splits over 2 ranks; min_lr_ratio=1: the schedule does not depend on ``steps``
TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=6,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=2, min_lr_ratio=1.0, eval_batches=2, log_every=1, eval_every=3, ckpt_every=3,
            lr=3e-3, grad_accum=2)
STEPS = 6


def _cfg(path, **kw) -> TrainConfig:
    return TrainConfig(out_dir=str(path), **{**TINY, **kw})


def _losses(out: Path) -> dict[int, tuple]:
    recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in recs}  # a resume logs steps again


def _worker(cfg: TrainConfig, corpus, result: str | None = None):
    torch.set_num_threads(1)  # the ranks share the cores
    try:
        run = train_distributed(cfg, corpus, progress=False, timeout_s=30)
    except Exception as e:  # the kill test reads what a survivor reported
        if result is None:
            raise
        Path(f"{result}.{os.environ['RANK']}").write_text(f"{type(e).__name__}: {e}")
        return
    tier = getattr(run.batches, "tier", None)
    if tier is not None:  # what the budget test reads
        Path(cfg.out_dir, f"peak.{os.environ['RANK']}").write_text(json.dumps(
            {"peak": tier.peak, "fixed": tier.fixed, "budget": tier.budget,
             "ahead": tier.read_ahead}))
        tier.close()


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """The same world-size-2 run with its tables in memory and in per-rank tier folders."""
    root = tmp_path_factory.mktemp("tier2")
    for name, tier in (("mem", "memory"), ("file", "file")):
        t0 = time.time()
        spawn_local(_worker, 2, _cfg(root / name, steps=STEPS, table_tier=tier), corpus)
        print(f"{name}: {time.time() - t0:.1f}s")
    return root


def test_ranks_train_from_their_tier_folders_as_from_memory(runs):
    """Same floats: each rank's working set holds every row of its shard the step's all-to-all
    asks for, its gradient coalesced in the shard's ids as the in-memory shard's is."""
    assert _losses(runs / "file") == _losses(runs / "mem")
    assert sorted(p.name for p in (runs / "file" / "tier").iterdir()) == [
        rank_folder(0, 2), rank_folder(1, 2)]
    # the tables read back from the rank folders equal the in-memory shards' (engram.open)
    got = engram.open(str(runs / "file")).model.state_dict()
    want = engram.open(str(runs / "mem")).model.state_dict()
    assert set(got) == set(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with pytest.raises(CheckpointError, match="consolidate is for in-memory tables"):
        consolidate(runs / "file", runs / "one")
    # and each rank's optimiser state in its folder is the in-memory shard's (its shard file's)
    step_dir = latest_distributed(runs / "mem")[0]
    for rank in (0, 1):
        files = TierFiles.open(runs / "file" / "tier" / rank_folder(rank, 2), writable=False)
        lo = _shard(rank, False).span(0)[0]
        with safe_open(str(step_dir / f"shard-{rank:05d}-of-00002.safetensors"), "pt") as f:
            rows = f.get_tensor("0.rows") - lo  # the rows it touched, sorted
            got = files.read(0, rows)
            assert torch.equal(got["moments"][:, 0], f.get_tensor("0.exp_avg"))
            assert torch.equal(got["moments"][:, 1], f.get_tensor("0.exp_avg_sq"))
            assert torch.equal(got["steps"], f.get_tensor("0.steps"))
        assert int((files.read_all(0, "steps") > 0).sum()) == rows.numel()  # and no other
        files.close()


@pytest.mark.slow
def test_three_ranks_and_a_larger_table_train_the_same_floats(tmp_path, corpus):
    """1/3 is not a power of two, and a larger table sorts more ids: the working shard's gradient
    is still scaled and coalesced as the in-memory shard's, in the same order."""
    kw = dict(steps=5, table_size=20011, eval_every=5)
    spawn_local(_worker, 3, _cfg(tmp_path / "mem", **kw), corpus)
    spawn_local(_worker, 3, _cfg(tmp_path / "file", table_tier="file", **kw), corpus)
    assert _losses(tmp_path / "file") == _losses(tmp_path / "mem")


def test_each_rank_stays_under_its_budget(runs):
    for rank in (0, 1):
        p = json.loads((runs / "file" / f"peak.{rank}").read_text())
        assert 0 < p["peak"] and p["peak"] + p["fixed"] <= p["budget"], p
        assert p["ahead"] > 0  # the default budget (two steps' rows) reads ahead


def test_a_stopped_tier_run_resumes_to_the_same_losses(runs, tmp_path, corpus):
    out = tmp_path / "part"
    spawn_local(_worker, 2, _cfg(out, steps=4, table_tier="file"), corpus)  # stops at step 4
    assert latest_distributed(out)[1]["step"] == 4
    spawn_local(_worker, 2, _cfg(out, steps=STEPS, table_tier="file"), corpus)
    got, want = _losses(out), _losses(runs / "file")
    assert {s: v[0] for s, v in got.items()} == {s: v[0] for s, v in want.items()}
    assert got[STEPS] == want[STEPS]  # (step 4's record has the stopped run's final val_loss)




@pytest.mark.parametrize("after,wait", [
    (2, 0.0), pytest.param(1, 0.15, marks=pytest.mark.slow),
    pytest.param(3, 0.05, marks=pytest.mark.slow), pytest.param(2, 0.3, marks=pytest.mark.slow)])
def test_sigkill_of_a_rank_then_relaunch_resumes_exactly(runs, tmp_path, corpus, after, wait):
    """Rank 1 SIGKILLed mid-run (its tier folder mid-step, maybe mid-write), rank 0 stopped by the
    failed collective; relaunched, every rank's journal puts its folder back to the newest
    checkpoint: the uninterrupted run's losses."""
    out, err = tmp_path / "k", tmp_path / "err"
    procs = start_local(_worker, 2, _cfg(out, steps=1000, ckpt_every=1, table_tier="file"), corpus,
                        str(err))
    try:
        end, ptr = time.time() + 120, out / "checkpoints" / "latest.json"
        while time.time() < end and not (ptr.exists() and json.loads(ptr.read_text())["step"]
                                         >= after):
            time.sleep(0.01)
        time.sleep(wait)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[0].join(60)
        assert procs[0].exitcode is not None, "rank 0 hung on a dead peer"
    finally:
        for p in procs:
            p.kill()
            p.join()
    at = latest_distributed(out)[1]["step"]
    assert at < STEPS, "killed too late to test a resume"
    assert "DistributedError" in Path(f"{err}.0").read_text()
    before = _tree(out / "tier")
    engram.open(str(out))  # a killed run opens at its checkpoint (journals read, not played)
    assert _tree(out / "tier") == before
    spawn_local(_worker, 2, _cfg(out, steps=STEPS, table_tier="file"), corpus)
    got, want = _losses(out), _losses(runs / "file")
    assert {s: v[0] for s, v in got.items()} == {s: v[0] for s, v in want.items()}, at
    assert got[STEPS] == want[STEPS]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_a_budget_without_read_ahead_trains_the_same(runs, tmp_path, corpus):
    """A budget of about one step's most rows (not two): the read-ahead rarely fits, rows are
    read when their step starts."""
    need = json.loads((runs / "file" / "peak.0").read_text())["budget"] // 2  # the default: 2x
    out = tmp_path / "tight"
    spawn_local(_worker, 2, _cfg(out, steps=STEPS, table_tier="file",
                                 table_budget_mb=need * 1.01 / 2**20), corpus)
    assert _losses(out) == _losses(runs / "file")
    for rank in (0, 1):
        p = json.loads((out / f"peak.{rank}").read_text())
        assert p["peak"] + p["fixed"] <= p["budget"] < 2 * p["peak"], p


def _dist1() -> Dist:
    return Dist(0, 1, torch.device("cpu"), None, None, 30.0, False)


def test_a_tier_run_resumes_only_at_its_world_size(runs, tmp_path, corpus):
    out = tmp_path / "w1"
    shutil.copytree(runs / "file", out)
    with pytest.raises(UserError, match="--nproc-per-node 2 .tier folders are not resharded"):
        build_distributed_run(_cfg(out, steps=8, table_tier="file"), _dist1(), corpus)
    with pytest.raises(CheckpointError, match="--nproc-per-node 2: its tables are in per-rank"):
        train(_cfg(out, steps=8, table_tier="file"), corpus, progress=False)  # one process
    with pytest.raises(UserError, match="drop --table_init=sharded"):
        build_distributed_run(_cfg(tmp_path / "s", table_tier="file"), _dist1(), corpus,
                              "sharded")


def _shard(rank: int, fresh: bool, **kw) -> Shard:
    return Shard(rank, 2, rows_per_layer(_cfg("x", **kw).engram_config()), fresh)


def test_a_folder_of_another_run_rank_or_a_small_budget_is_refused(runs, tmp_path, corpus):
    out = tmp_path / "copy"
    shutil.copytree(runs / "file", out)
    tier = out / "tier"
    with pytest.raises(TierError, match="another shape"):
        build_run(_cfg(out, table_tier="file", table_size=1009), corpus,
                  shard=_shard(0, False, table_size=1009))
    shutil.rmtree(tier / rank_folder(1, 2))
    shutil.copytree(tier / rank_folder(0, 2), tier / rank_folder(1, 2))  # rank 0's, as rank 1's
    with pytest.raises(TierError, match=r"of rank/world \[0, 2\], not this rank's \[1, 2\]"):
        build_run(_cfg(out, table_tier="file"), corpus, shard=_shard(1, False))
    # a fresh run pointed at another run's tier folder
    with pytest.raises(TierError, match="tables of another run"):
        build_run(_cfg(tmp_path / "new", table_tier="file", table_dir=str(tier)), corpus,
                  shard=_shard(0, True))
    with pytest.raises(UserError, match="below one step's rows of a rank's shard"):
        build_run(_cfg(tmp_path / "small", table_tier="file", table_budget_mb=0.01), corpus,
                  shard=_shard(0, True))
