"""studies/estimate.py: what a run costs from the probe's figures (evaluations, saves, a resumed
run's remaining steps), the hand-out order against every order tried by brute force, and the probe
on real workers and runs."""

import itertools
import json

import pytest

from engram.studies.common import Workers, job, train_run
from engram.studies.compare import CompareConfig, budget
from engram.studies.estimate import Costs, best_order, estimate, simulate
from engram.training.train import TrainConfig

TINY = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
                   n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,), steps=4,
                   batch_size=2, seq_len=16, eval_every=2, eval_batches=1, log_every=1,
                   ckpt_every=2, warmup=1)


def test_run_seconds_count_compares_steps_evaluations_and_saves():
    cfg = budget(TrainConfig(), CompareConfig())  # 480 steps, eval every 80 (16 batches), full last
    c = Costs(startup_s=2.0, step_s=0.25, eval_batch_s=0.1, save_s=0.5, step_cpu_s=0.2)
    # 5 evaluations of 16 batches + the full sweep of 57, saves at 160, 320, 480
    assert c.run_s(cfg, val_batches=57) == pytest.approx(2 + 480 * 0.25 + (80 + 57) * 0.1 + 3 * 0.5)
    # resumed from step 160: 320 steps, evaluations at 240, 320, 400 and the full one, 2 saves
    assert c.run_s(cfg, 57, done=160) == pytest.approx(2 + 320 * 0.25 + (48 + 57) * 0.1 + 2 * 0.5)
    # evaluations happen at logging steps only (hooks.LogMetrics)
    odd = TrainConfig(steps=30, eval_every=5, log_every=10, eval_batches=2, ckpt_every=100)
    assert c.run_s(odd, 57) == pytest.approx(2 + 30 * 0.25 + 3 * 2 * 0.1 + 0.5)


def test_simulate_hands_each_run_to_the_first_free_worker():
    assert simulate([5, 3, 3], 2) == 6 and simulate([5, 3, 3], 1) == 11
    assert simulate([], 2) == 0 and simulate([4], 3) == 4


@pytest.mark.parametrize("seconds", [[513, 513, 513, 372, 372, 372, 340, 340, 340],
                                     [126, 126, 126, 94, 94, 94, 88, 88, 88], [7, 5, 4, 3, 3, 2]])
def test_best_order_is_the_best_of_every_order(seconds):
    order = best_order(seconds, 2)
    assert sorted(order) == list(range(len(seconds)))
    best = min(simulate([seconds[i] for i in p], 2)
               for p in itertools.permutations(range(len(seconds))))
    assert simulate([seconds[i] for i in order], 2) == pytest.approx(best)
    # better than slowest first where that leaves a worker idle at the end
    slowest = simulate(sorted(seconds, reverse=True), 2)
    assert simulate([seconds[i] for i in order], 2) <= slowest


def test_best_order_keeps_equal_runs_in_order_and_falls_back_when_too_many():
    order = best_order([1.0, 1.0, 1.0], 2)
    assert order == [0, 1, 2]
    many = [float(i % 7) for i in range(30)]
    assert best_order(many, 2, limit=10) == sorted(range(30), key=lambda i: -many[i])


def test_estimate_probes_real_runs_on_the_workers(tmp_path):
    jobs = [job(n, TINY, s, tmp_path) for n in ("a", "b") for s in (0, 1)]
    with Workers(2) as pool:
        pool.run(jobs[:1], train_run, "first")  # finished: it costs nothing
        est = estimate(pool, jobs, [j.name for j in jobs], started=0.0, steps=2, warmup=1,
                       eval_batches=1)
    assert est.per_job_s[0] == 0 and all(s > 0 for s in est.per_job_s[1:])
    assert set(est.costs) == {"a", "b"}
    for c in est.costs.values():
        assert c["step_s"] > 0 and c["startup_s"] > 0 and c["eval_batch_s"] > 0 and c["save_s"] > 0
    assert sorted(est.order) == [0, 1, 2, 3]
    assert est.total_s >= est.runs_s > 0
    assert json.dumps(est.__dict__)  # results.json keeps it
    assert "estimated wall time" in est.line()
