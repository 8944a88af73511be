"""Training from the file tier (training/tier_tables.py, artifacts/tier_files.py): the same floats
as in-memory training, exact resume, SIGKILL at random points, bad input in one line."""

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engram
from engram.artifacts import tier_files
from engram.artifacts.checkpoint import CheckpointError
from engram.artifacts.tier_files import JOURNAL, Journal, TierFiles, roll_back
from engram.errors import UserError
from engram.tables.store import MemoryTable, deferred_rows, normal_chunks
from engram.training.corpus import DataConfig, build_corpus
from engram.training.hooks import LogMetrics, SaveCheckpoints
from engram.training.loop import ONE_PROCESS, fit
from engram.training.train import TrainConfig, build_run, checkpoints_of, train

TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=2, eval_batches=2, log_every=1, eval_every=3, ckpt_every=3, lr=3e-3, threads=1)
SRC = Path(engram.__file__).parents[1]


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


def _cfg(tmp_path, name, **kw):
    return TrainConfig(out_dir=str(tmp_path / name), **{**TINY, **kw})


def _losses(run):
    return [(r["loss"], r.get("val_loss")) for r in run.history]


def _tier_state(run):
    files = run.batches.tier.files
    return {lid: {k: files.read_all(lid, k) for k in files.names(lid)} for lid in files.shapes}


# (a table of ~80k rows: its gradient is coalesced by torch's sort, not the row-scan kernel)
@pytest.mark.parametrize("opt,accum,rows", [("adam", 1, 997), ("adam", 2, 997),
                                            ("adagrad", 1, 997), ("adam", 2, 20011)])
def test_file_tier_trains_the_same_floats_as_memory(tmp_path, corpus, opt, accum, rows):
    kw = dict(steps=7, table_optimizer=opt, grad_accum=accum, table_size=rows)
    mem = train(_cfg(tmp_path, "mem", **kw), corpus, progress=False)
    tier = train(_cfg(tmp_path, "file", table_tier="file", **kw), corpus, progress=False)
    assert _losses(tier) == _losses(mem)
    # the tables and their optimiser state, row for row
    files = _tier_state(tier)
    for lid, e in mem.model.engrams().items():
        assert torch.equal(files[lid]["rows"], e.table.weight.detach())
        if opt == "adam":
            m, v, t = mem.optim.tables.row_state(e.table.weight, torch.arange(e.table.num_rows))
            assert torch.equal(files[lid]["moments"][:, 0], m)
            assert torch.equal(files[lid]["moments"][:, 1], v)
            assert torch.equal(files[lid]["steps"], t)
    # the dense checkpoint keeps no table: the files do
    ckpt = sorted((tmp_path / "file" / "checkpoints").iterdir())[-1]
    assert ckpt.stat().st_size < sorted((tmp_path / "mem" / "checkpoints").iterdir())[-1].stat().st_size


@pytest.mark.parametrize("rows,dim,chunk", [(997, 32, 16), (20011, 32, 1000), (7, 3, 1),
                                             (1001, 5, 48)])
def test_deferred_rows_are_a_whole_tables_init_chunk_by_chunk(rows, dim, chunk):
    """A table built under deferred_rows holds no rows, leaves the generator where a whole
    table's init does (the rest of the model initialises the same), and its rows made later a
    chunk at a time are the whole table's, bit for bit (normal_ works in blocks of 16 values)."""
    torch.manual_seed(5)
    whole = MemoryTable(rows, dim, init_std=0.3)
    after = torch.rand(4)
    torch.manual_seed(5)
    with deferred_rows():
        lazy = MemoryTable(rows, dim, init_std=0.3)
    assert lazy.weight.shape == (0, dim) and torch.equal(torch.rand(4), after)
    g = torch.Generator()
    g.set_state(lazy.init_state)
    chunks = list(normal_chunks(rows, dim, 0.3, g, chunk_rows=chunk))
    assert torch.equal(torch.cat(chunks), whole.weight.detach())
    assert len(chunks) > 1 or rows * dim < 32


@pytest.mark.parametrize("span", [1 << 20, 256])
def test_file_tier_io_reads_and_writes_rows_by_id(tmp_path, monkeypatch, span):
    """Positional reads and writes: adjacent runs, near spans (rows between written back as they
    were; spans cut at ``span`` bytes) and far rows, against the same writes on a copy in memory."""
    monkeypatch.setattr(tier_files, "SPAN_BYTES", span)
    r, e = 5000, 8
    init = torch.randn(r, e)
    state = {"steps": ([], "int64")}
    files = TierFiles.create(tmp_path, tmp_path, {0: (r, e)}, {0: iter([init[:3000], init[3000:]])},
                             state, "x")
    want = {"rows": init.clone(), "steps": torch.zeros(r, dtype=torch.int64)}
    assert all(torch.equal(files.read_all(0, k), want[k]) for k in want)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 300, 4000):
        ids = torch.unique(torch.cat([torch.randint(0, r, (n,), generator=gen),
                                      torch.arange(100, 140)]))
        new = {"rows": torch.randn(ids.numel(), e, generator=gen),
               "steps": torch.randint(0, 99, (ids.numel(),), generator=gen)}
        got = files.read(0, ids)
        assert all(torch.equal(got[k], want[k][ids]) for k in want)
        files.write(0, ids, new)
        for k in want:
            want[k][ids] = new[k]
        assert all(torch.equal(files.read_all(0, k), want[k]) for k in want)
    assert files.max_of(0, "steps", chunk=333) == int(want["steps"].max())


def test_a_budget_without_prefetch_trains_the_same(tmp_path, corpus):
    """One step's rows and no more: no read-ahead, the same losses."""
    full = train(_cfg(tmp_path, "a", steps=5, table_tier="file"), corpus, progress=False)
    tier = full.batches.tier
    need = (tier.budget / 2) / 2**20  # attach's default budget is two steps' worst case
    tight = train(_cfg(tmp_path, "b", steps=5, table_tier="file", table_budget_mb=need * 1.01),
                  corpus, progress=False)
    assert tight.batches.tier.read_ahead == 0 and full.batches.tier.read_ahead == 4
    assert _losses(tight) == _losses(full)
    for t in (tight.batches.tier, full.batches.tier):
        assert 0 < t.peak and t.peak + t.fixed <= t.budget


def test_tier_resume_equals_uninterrupted(tmp_path, corpus):
    full = train(_cfg(tmp_path, "full", steps=7, table_tier="file"), corpus, progress=False)
    cfg = _cfg(tmp_path, "part", steps=7, table_tier="file")
    run = build_run(cfg, corpus)
    ckpts = checkpoints_of(run)

    class Crash:  # step 5's rows are in the tables, the newest checkpoint is step 3's
        def start(self, run): pass
        def end(self, run): pass
        def after_step(self, run, lr, loss):
            if run.step == 5:
                raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        fit(run, [LogMetrics(ONE_PROCESS, False), SaveCheckpoints(ckpts, 3), Crash()])
    run.batches.tier.close()
    assert run.batches.tier.journal.base == 3 and (tmp_path / "part" / "tier" / JOURNAL
                                                   ).stat().st_size > 100
    resumed = train(_cfg(tmp_path, "part", steps=7, table_tier="file"), corpus, progress=False)
    assert _losses(resumed) == _losses(full)
    a, b = _tier_state(full), _tier_state(resumed)
    assert all(torch.equal(a[lid][k], b[lid][k]) for lid in a for k in a[lid])


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_a_tier_run_opens_at_its_checkpoint_read_only(tmp_path, corpus):
    """engram.open (so generate, eval, export) reads a tier run's tables from its folder, copied
    anywhere, writing nothing; killed after checkpoint 3 (the files hold step 5's rows, the journal
    step 3's), it opens as the same run trained in memory and killed there opens: at step 3."""
    class Crash:
        def start(self, run): pass
        def end(self, run): pass
        def after_step(self, run, lr, loss):
            if run.step == 5:
                raise RuntimeError("crash")

    for name, tier in (("mem", "memory"), ("tier", "file")):
        run = build_run(_cfg(tmp_path, name, steps=7, table_tier=tier), corpus)
        with pytest.raises(RuntimeError, match="crash"):
            fit(run, [LogMetrics(ONE_PROCESS, False), SaveCheckpoints(checkpoints_of(run), 3),
                      Crash()])
    run.batches.tier.close()
    assert run.batches.tier.journal.base == 3
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(tmp_path / "tier", moved)
    shutil.rmtree(tmp_path / "tier")
    before = _tree(moved)
    got = engram.open(str(moved)).model.state_dict()
    assert _tree(moved) == before  # opening wrote nothing
    want = engram.open(str(tmp_path / "mem")).model.state_dict()
    assert set(got) == set(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    (moved / "tier" / "tier.json").unlink()
    with pytest.raises(UserError, match="trained with its tables in files"):
        engram.open(str(moved))


def test_journal_rolls_back_and_ignores_a_torn_entry(tmp_path, corpus):
    run = train(_cfg(tmp_path, "r", steps=3, table_tier="file"), corpus, progress=False)
    tier = run.batches.tier
    files, lid = tier.files, next(iter(tier.files.shapes))
    before = {k: files.read_all(lid, k) for k in files.names(lid)}
    rows = torch.tensor([5, 17, 18, 900])  # 17, 18: one positional write
    tier.journal.append([(lid, rows, list(files.read(lid, rows).values()))])
    files.write(lid, rows, {k: torch.full_like(v, 7) for k, v in files.read(lid, rows).items()})
    assert not torch.equal(files.read_all(lid, "rows"), before["rows"])
    with open(files.folder / JOURNAL, "ab") as f:  # a torn next entry: header, half a payload
        f.write(struct.pack("<IIQI", lid, 3, 1000, 0) + b"\x01" * 9)
    journal = Journal.open(files.folder / JOURNAL, files.run_id)
    assert roll_back(files, journal) == 4
    assert roll_back(files, journal) == 4  # idempotent
    assert all(torch.equal(files.read_all(lid, k), before[k]) for k in before)


def test_bad_input_is_one_line_before_any_work(tmp_path, corpus):
    with pytest.raises(UserError, match="below one step's rows"):
        train(_cfg(tmp_path, "small", steps=2, table_tier="file", table_budget_mb=0.01), corpus,
              progress=False)
    assert not (tmp_path / "small" / "tier").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write the tier tables"):
        train(_cfg(tmp_path, "ro", steps=2, table_tier="file",
                   table_dir=str(tmp_path / "file" / "t")), corpus, progress=False)
    if os.geteuid() != 0:  # root writes through a read-only mode
        ro = tmp_path / "ro_dir"
        ro.mkdir(mode=0o555)
        with pytest.raises(UserError, match="cannot write the tier tables"):
            train(_cfg(tmp_path, "ro2", steps=2, table_tier="file", table_dir=str(ro / "t")),
                  corpus, progress=False)
    shared = str(tmp_path / "shared_tier")
    train(_cfg(tmp_path, "a", steps=3, table_tier="file", table_dir=shared), corpus, progress=False)
    with pytest.raises(UserError, match="tables of another run"):  # a fresh run over it
        train(_cfg(tmp_path, "b", steps=3, table_tier="file", table_dir=shared), corpus,
              progress=False)
    with pytest.raises(UserError, match="another shape"):  # run a's checkpoint, other tables
        train(_cfg(tmp_path, "a", steps=6, table_tier="file", table_dir=shared, table_size=499),
              corpus, progress=False)
    train(_cfg(tmp_path, "c", steps=3, table_tier="file"), corpus, progress=False)
    with pytest.raises(CheckpointError, match="another run"):  # c's checkpoint, a's tables
        train(_cfg(tmp_path, "c", steps=6, table_tier="file", table_dir=shared), corpus,
              progress=False)
    for bad, match in ((dict(precision="bf16"), "fp32"), (dict(engram=False), "plain Engram"),
                       (dict(table_budget_mb=-1.0), "> 0")):
        with pytest.raises(UserError, match=match):
            _cfg(tmp_path, "x", table_tier="file", **bad)


# -- SIGKILL at random points ---------------------------------------------------------------------

KILL_STEPS = 12


def _argv(out: Path) -> list[str]:
    args = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in {**TINY, "ckpt_every": 2}.items()]
    return [sys.executable, "-m", "engram", "train", f"--out_dir={out}", f"--steps={KILL_STEPS}",
            "--table_tier=file", *args]


def _run_losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}  # a resumed run logs its steps again


def _kill_and_resume(tmp_path: Path, seeds: list[int]) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    ref = tmp_path / "ref"
    done = subprocess.run(_argv(ref), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = _run_losses(ref)
    refused = 0
    for seed in seeds:
        rng = random.Random(seed)
        out = tmp_path / f"k{seed}"
        proc = subprocess.Popen(_argv(out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        at = rng.randrange(1, KILL_STEPS)  # kill somewhere after the at-th logged step
        metrics = out / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= at:
                time.sleep(rng.random() * 0.3)
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        again = subprocess.run(_argv(out), env=env, capture_output=True, text=True, timeout=600)
        if again.returncode != 0:  # refused: one line, never a traceback
            assert len(again.stderr.strip().splitlines()) == 1, again.stderr[-2000:]
            refused += 1
            continue
        assert _run_losses(out) == want, f"seed {seed}: killed after step {at}"
    print(f"{len(seeds)} SIGKILLs: {len(seeds) - refused} resumed exactly, {refused} refused")
    assert refused < len(seeds)  # the journal makes resume possible, not a refusal every time


def test_sigkill_at_random_points_resumes_exactly(tmp_path):
    _kill_and_resume(tmp_path, [1, 2])


@pytest.mark.slow
def test_sigkill_at_thirty_random_points(tmp_path):
    _kill_and_resume(tmp_path, list(range(100, 130)))


def test_a_journal_older_or_newer_than_the_checkpoint(tmp_path, corpus):
    """Killed between the dense checkpoint and the journal's reset, the journal is older than the
    checkpoint and its entries must not be played back; a newer one cannot be undone: refused."""
    full = train(_cfg(tmp_path, "full", steps=6, table_tier="file"), corpus, progress=False)
    run = train(_cfg(tmp_path, "part", steps=3, table_tier="file"), corpus, progress=False)
    tier = run.batches.tier
    tier.close()
    files, lid, path = tier.files, next(iter(tier.files.shapes)), tier.files.folder / JOURNAL
    Journal.create(path, 0, files.run_id)  # as of the checkpoint before: its entries are stale
    stale = Journal.open(path, files.run_id)
    rows = torch.tensor([1, 2, 3])
    stale.append([(lid, rows, [torch.full_like(a, 9) for a in files.read(lid, rows).values()])])
    stale.close()
    resumed = train(_cfg(tmp_path, "part", steps=6, table_tier="file"), corpus, progress=False)
    assert _losses(resumed) == _losses(full)
    a, b = _tier_state(full), _tier_state(resumed)
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    Journal.create(path, 9, resumed.batches.tier.files.run_id)  # newer than the step-6 checkpoint
    resumed.batches.tier.close()
    with pytest.raises(CheckpointError, match="undoes to step 9"):
        train(_cfg(tmp_path, "part", steps=8, table_tier="file"), corpus, progress=False)
