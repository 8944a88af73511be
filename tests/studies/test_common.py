"""studies/common.py: the one job runner (job order, finished runs read back, interrupted ones
resumed, another configuration refused), the one "resolved" rule in every report, and plots that
leave the caller's matplotlib backend alone."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engram.studies.common import (RULE, finished, job, largest_spread, resolved, run_jobs,
                                   seed_spread, train_run)
from engram.training.train import TrainConfig

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
TINY = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
                   n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,), steps=4,
                   batch_size=2, seq_len=16, eval_every=2, eval_batches=1, log_every=1,
                   ckpt_every=2, warmup=1)


def _roll_back(run_dir: Path, step: int) -> None:
    """What a run killed just after its step-``step`` checkpoint leaves: that checkpoint as the
    latest, no later one, no result.json."""
    ck = run_dir / "checkpoints"
    for p in ck.glob("step_*.safetensors"):
        if int(p.stem.split("_")[1]) > step:
            p.unlink()
    keep = ck / f"step_{step:08d}.safetensors"
    import hashlib
    (ck / "latest.json").write_text(json.dumps(
        {"file": keep.name, "step": step, "sha256": hashlib.sha256(keep.read_bytes()).hexdigest()}))
    (run_dir / "result.json").unlink()


def test_runner_keeps_job_order_reads_finished_runs_back_and_resumes(tmp_path):
    jobs = [job("b", TINY, 1, tmp_path), job("a", TINY, 0, tmp_path)]
    first = run_jobs(jobs, train_run, 2, "test runs")
    assert [(r["name"], r["seed"]) for r in first] == [("b", 1), ("a", 0)]
    assert first[0]["val_loss"] != first[1]["val_loss"]  # the seed reached the run
    assert json.loads((tmp_path / "a-s0" / "config.json").read_text())["seed"] == 0

    # Finished: read back, nothing trained (the metrics file is not touched).
    metrics = tmp_path / "a-s0" / "metrics.jsonl"
    stamp = metrics.stat().st_mtime_ns
    assert run_jobs(jobs, train_run, 2, "test runs") == first
    assert metrics.stat().st_mtime_ns == stamp

    # Interrupted after step 2: resumes from that checkpoint to the same losses. The records up to
    # step 2 come back from the checkpoint (their measured tokens/s included); a rerun from
    # scratch would have measured new ones.
    _roll_back(tmp_path / "a-s0", 2)
    assert finished(jobs[1]) is None
    again = run_jobs(jobs, train_run, 1, "test runs")[1]
    assert again["history"][:2] == first[1]["history"][:2]
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in first[1]["history"]]
    assert again["val_loss"] == first[1]["val_loss"]


def test_a_workers_progress_bar_takes_no_semaphore(tmp_path):
    """A job's progress bar in a worker made tqdm's lock a multiprocessing semaphore; the pool ends
    its workers with SIGTERM, so, when a worker had not yet exited, every study's last line was the
    resource tracker's "leaked semaphore" warning. Checked in a worker itself (the warning is a
    race), by a script: spawned workers import the function from its file."""
    import subprocess
    import sys
    script = tmp_path / "bar_lock.py"
    script.write_text(
        "from tqdm.auto import tqdm\n"
        "from engram.studies.common import Workers\n"
        "def locks(_):\n"
        "    tqdm(total=1, disable=True).close()\n"
        "    lock = tqdm.get_lock()\n"
        "    return [type(x).__module__ for x in getattr(lock, 'locks', [lock])]\n"
        "if __name__ == '__main__':\n"
        "    with Workers(1) as pool:\n"
        "        print(pool.each(locks, [None])[0])\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "multiprocessing" not in p.stdout and "resource_tracker" not in p.stderr, p.stdout + p.stderr


def test_runner_refuses_a_finished_run_of_another_configuration(tmp_path):
    done = job("a", TINY, 0, tmp_path)
    (tmp_path / "a-s0").mkdir()
    saved = {"job": done.key(), "result": {"name": "a", "seed": 0, "val_loss": 1.0}}
    (tmp_path / "a-s0" / "result.json").write_text(json.dumps(saved))
    assert run_jobs([done], train_run, 1, "test") == [saved["result"]]  # read back, no process
    other = job("a", dataclasses.replace(TINY, d_model=16), 0, tmp_path)
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['d_model'\]\)"):
        run_jobs([other], train_run, 1, "test")
    assert json.loads((tmp_path / "a-s0" / "result.json").read_text()) == saved
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(done, seed=1)
    with pytest.raises(ValueError, match="share a run folder"):
        run_jobs([done, done], train_run, 1, "test")


def test_resolved_rule():
    assert seed_spread([5.0]) is None and seed_spread([5.0, 5.3, 5.1]) == pytest.approx(0.3)
    assert largest_spread([None, 0.1, 0.05]) == 0.1 and largest_spread([None]) is None
    assert resolved(0.21, 0.1) and resolved(-0.21, 0.1)
    assert not resolved(0.2, 0.1)  # must exceed 2x, not equal it
    assert not resolved(1.0, None) and not resolved(1.0, 0.0)  # one seed / identical runs
    assert "2x the largest seed spread" in RULE


def test_every_report_states_the_rule_and_judges_by_it(tmp_path):
    """The recorded studies, rendered again: the same sentence in every report, and each verdict
    what resolved() says about the recorded numbers."""
    from engram.studies.ablate_report import write_ablation_report
    from engram.studies.analysis_report import report as analysis_report
    from engram.studies.analysis_seeds import seeds_report, seed_verdicts
    from engram.studies.nine_report import findings, max_spread
    from engram.studies.nine_report import report as nine_report
    from engram.studies.report import write_report
    from engram.studies.sweep import _report as sweep_report

    compare = json.loads((RESULTS / "compare" / "results.json").read_text())
    write_report(compare, tmp_path / "compare.md")
    text = (tmp_path / "compare.md").read_text()
    spread = largest_spread(compare["noise_seed_spread"].values())
    word = "resolved" if resolved(compare["engram_gain_vs_dense"], spread) else "not resolved"
    assert RULE in text and f"the largest seed spread: {word}." in text

    ablate = json.loads((RESULTS / "ablate" / "ablate.json").read_text())
    write_ablation_report(ablate, tmp_path / "ablate.md")
    assert RULE in (tmp_path / "ablate.md").read_text()

    nine = json.loads((RESULTS / "nine" / "nine.json").read_text())
    nine["findings"] = findings(nine["configs"], None)
    f1 = nine["findings"]["1_collisions_not_bottleneck"]
    spread = max_spread(nine["configs"])
    base = next(iter(nine["configs"]))
    assert all(v["resolved"] == resolved(v["diff_vs_" + base], spread) for v in f1.values())
    assert RULE in nine_report(nine)

    seeds = json.loads((RESULTS / "analysis" / "analysis.json").read_text())
    seeds["verdicts"] = seed_verdicts(seeds)
    assert RULE in seeds_report(seeds)
    one = json.loads((RESULTS / "analysis" / "seed0" / "analysis.json").read_text())
    assert RULE in analysis_report(one)

    points = [{"name": f"x={i}", "val_loss": v, "val_loss_per_seed": {0: v, 1: v + s},
               "seed_spread": s, "vs_best": v - 5.0, "resolved_vs_best": resolved(v - 5.0, 0.1)}
              for i, (v, s) in enumerate(((5.0, 0.1), (5.3, 0.05)))]
    text = sweep_report({"kind": "slots", "points": points, "best": points[0],
                         "max_seed_spread": 0.1})
    assert RULE in text and "| x=1 | 5.3000 |" in text and text.count("| yes |") == 1
    # x=1 is 0.30 and 0.25 above the best, seed by seed: two seeds' t-interval is wide
    assert "| best | - |" in text and "| yes | [-0.0426, +0.5926]: includes zero |" in text


@pytest.fixture
def svg_backend():
    """The caller's backend is svg: a report that switched it (matplotlib.use) would show."""
    import matplotlib
    old = matplotlib.get_backend()
    matplotlib.use("svg")
    yield
    matplotlib.use(old)


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_leave_the_backend_alone(svg_backend, tmp_path):
    import matplotlib

    from engram.studies import analysis_report, analysis_seeds, finetune_report, nine_report, pool_report
    from engram.studies import report, sweep, vision_report
    from engram.studies.ablate_report import plot_ablation

    def load(*parts: str) -> dict:
        return json.loads(RESULTS.joinpath(*parts).read_text())

    out = []
    sweep._plot(load("sweeps", "allocation.json"), tmp_path / "sweep.png")
    plot_ablation(load("ablate", "ablate.json"), tmp_path / "ablate.png")
    nine_report.plot_all(load("nine", "nine.json"), tmp_path)
    out += [f"{n}.png" for n in ("final_loss", "hot_cold_delta", "delta_alpha", "alpha_buckets")]
    analysis_seeds.plot_seeds(load("analysis", "analysis.json"), tmp_path / "seeds.png")
    one = load("analysis", "seed0", "analysis.json")
    analysis_report.plot_lens(one, tmp_path / "lens.png")
    analysis_report.plot_cka(one["cka"], tmp_path / "cka.png")
    analysis_report.plot_retention(one["retention"], tmp_path / "retention.png")
    pool_report.plot(load("pool", "budget.json"), tmp_path / "pool.png")
    finetune_report.plot_study(load("finetune_smollm2.json"), tmp_path / "finetune.png")
    history = [{"tokens": 32 * i, "loss": 7.0 - 0.1 * i, **({"val_loss": 7.1 - 0.1 * i}
                                                            if i % 2 == 0 else {})}
               for i in range(1, 5)]
    report.plot_losses([{"name": n, "seed": s, "history": history}
                        for n in ("dense", "engram") for s in (0, 1)], tmp_path / "loss.png")
    g = torch.Generator().manual_seed(0)
    report._gates_png(torch.rand(2, 6, generator=g), [["In", " the", " beginning", " God",
                                                       " created", "\n"], ["本", "报"] * 3],
                      tmp_path / "gates.png", 1)
    grids = {m: {k: torch.rand(8, 1, 8, 8, generator=g) for k in ("trigger", "bold", "control")}
             for m in ("base", "tables")}
    vision_report.save_grid(grids, tmp_path / "grid.png", type("Cfg", (), {"trigger": "Zorblax"}),
                            3)
    import numpy as np

    from engram.retrieval.compress import default_tokenizer
    batch = type("Batch", (), {"inputs": torch.zeros(4, 8, dtype=torch.long),
                               "raw": torch.randint(100, 5000, (4, 8), generator=g)})
    ho = {k: torch.rand(32, generator=g).numpy() for k in ("gates", "zeroed", "full")}
    analysis_report.gate_examples([batch], ho, np.repeat([0, 1, 0, 1], 8), default_tokenizer(),
                                  None, tmp_path)
    out += ["gates_examples.png", "sweep.png", "ablate.png", "seeds.png", "lens.png", "cka.png", "retention.png",
            "pool.png", "finetune.png", "loss.png", "gates.png", "grid.png"]
    assert matplotlib.get_backend() == "svg"
    assert all(_png(tmp_path / f) for f in out)
