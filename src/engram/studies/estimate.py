"""How long a study's training runs will take on this machine, measured before they start.

A wall-time figure taken on one machine is wrong on the next (issue 25: "~8 minutes" on a Zen 5
took 31 on a Zen 3, where an estimate from single-process CPU time said 15.6), so the runs are
timed here, in the layout they will run in: on the study's own worker processes
(common.Workers: one torch thread each, the allocator settings, the numba plan), all workers at
once, under whatever else loads the machine right now. Each worker builds one run of every kind
(start-up: corpus from the disk cache, model, GEMM routes, optimisers), then steps them in turn
until ``steps`` timed steps each, so every step is timed beside the other workers' steps (two runs
side by side share caches and memory bandwidth: a step there is slower than alone); halfway it
times a few validation batches and a checkpoint save. A run then costs

    start-up + steps x step + (evaluations' batches + the full sweep's) x batch + saves x save

and the study's runs are handed out as the runner does it, the next to the first free worker;
``best_order`` picks the hand-out order whose last worker finishes first (9 runs of 3 kinds
on 2 workers: 1,680 orders, simulated in a few milliseconds). The estimate is that finish time
plus what came before (corpus, workers' start, the probe itself) and a closing allowance.

What it cannot know: load that starts or stops after the probe. The probe measures the load
present at its start, and every figure is recorded with the load average beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..artifacts.checkpoint import FOLDER as CHECKPOINTS, LATEST
from ..training.loop import evaluate, lr_at, train_step
from ..training.train import FileCheckpoints, TrainConfig, build_run
from .common import Job, Workers, finished, sync_workers


@dataclass
class Costs:
    """What one kind of run costs here, in wall seconds, measured side by side (``probe``)."""
    startup_s: float  # build_run: corpus from the disk cache, model, GEMM routes, optimisers
    step_s: float  # one training step (batch + hash ids, forward, backward, clip, optimisers)
    eval_batch_s: float  # one validation batch (forward only)
    save_s: float  # one checkpoint save
    step_cpu_s: float  # the step's CPU seconds (wall / CPU > 1: the worker waited for a core)

    def run_s(self, cfg: TrainConfig, val_batches: int, done: int = 0) -> float:
        """Wall seconds of a run of ``cfg`` from step ``done`` (a checkpoint's) to its end."""
        left = range(done + 1, cfg.steps + 1)
        last = cfg.steps  # hooks.LogMetrics evaluates at logging steps; the last may be the full sweep
        evals = [s for s in left if (s % cfg.log_every == 0 or s == last)
                 and (s % cfg.eval_every == 0 or s == last)]
        full = bool(cfg.final_eval_full and evals and evals[-1] == last)
        batches = (len(evals) - full) * min(cfg.eval_batches, val_batches) + full * val_batches
        saves = sum(1 for s in left if s % cfg.ckpt_every == 0 or s == last)
        return (self.startup_s + len(left) * self.step_s + batches * self.eval_batch_s
                + saves * self.save_s)


def probe(task: tuple[int, list[tuple[str, TrainConfig]], int, int, int]) -> dict[str, dict]:
    """On worker ``rank`` (inside Workers.each): build one run of every kind, then ``warmup`` +
    ``steps`` steps of each in turn (starting at kind ``rank``, so the workers step different
    kinds side by side), timing steps after the warmup; halfway, ``eval_batches`` validation
    batches and a checkpoint save of each. Returns wall and CPU seconds per kind."""
    rank, kinds, steps, warmup, eval_batches = task
    kinds = kinds[rank % len(kinds):] + kinds[:rank % len(kinds)]
    out: dict[str, dict[str, Any]] = {}
    runs = {}
    for name, cfg in kinds:
        t0 = time.perf_counter()
        runs[name] = build_run(cfg)  # the corpus from the disk cache, as each run's own start
        val = len(runs[name].corpus.val)
        out[name] = {"startup_s": time.perf_counter() - t0, "step_s": [], "step_cpu_s": [],
                     "val_batches": -(-((val - 1) // cfg.seq_len) // cfg.batch_size)}
    sync_workers()  # every worker steps from here on: each step is timed beside the others
    with tempfile.TemporaryDirectory(prefix="engram-probe-") as tmp:
        for r in range(warmup + steps):
            for name, _ in kinds:
                run = runs[name]
                t0, c0 = time.perf_counter(), time.process_time()
                run.optim.set_lr(lr_at(run.step, run.cfg))
                train_step(run)
                run.step += 1
                if r >= warmup:
                    out[name]["step_s"].append(time.perf_counter() - t0)
                    out[name]["step_cpu_s"].append(time.process_time() - c0)
                if r == warmup + steps // 2:  # still beside the other workers' steps
                    cfg, t0 = run.cfg, time.perf_counter()
                    run.cfg = dataclasses.replace(cfg, eval_batches=eval_batches)
                    evaluate(run)
                    run.cfg = cfg
                    out[name]["eval_batch_s"] = ((time.perf_counter() - t0)
                                                 / min(eval_batches, out[name]["val_batches"]))
                    t0 = time.perf_counter()
                    FileCheckpoints(Path(tmp) / name).save(run)
                    out[name]["save_s"] = time.perf_counter() - t0
    for o in out.values():
        o["step_s"], o["step_cpu_s"] = statistics.mean(o["step_s"]), statistics.mean(o["step_cpu_s"])
    return out


def simulate(seconds: list[float], workers: int) -> float:
    """When the last of these runs ends, handed out in this order to the first free worker."""
    free = [0.0] * workers
    for s in seconds:
        free[free.index(min(free))] += s
    return max(free, default=0.0)


def _orders(left: dict[float, int]) -> Iterator[list[float]]:
    """Every distinct order of a multiset of costs (cost -> count), slowest first first."""
    if not any(left.values()):
        yield []
        return
    for cost in sorted(left, reverse=True):
        if left[cost]:
            left[cost] -= 1
            for rest in _orders(left):
                yield [cost, *rest]
            left[cost] += 1


def best_order(seconds: list[float], workers: int, limit: int = 20_000) -> list[int]:
    """The hand-out order (indices into ``seconds``) whose last run ends first. Runs of equal cost
    are interchangeable, so only distinct orders are tried (at most ``limit``; past it, and on
    ties, slowest first, which is also the order runs of equal cost keep among themselves)."""
    slowest_first = sorted(range(len(seconds)), key=lambda i: -seconds[i])
    counts = Counter(seconds)
    orders = math.factorial(len(seconds))
    for c in counts.values():
        orders //= math.factorial(c)
    if orders > limit:
        return slowest_first
    best = min(_orders(dict(counts)), key=lambda o: simulate(o, workers))  # the first of equals
    queues = {c: [i for i in slowest_first if seconds[i] == c] for c in counts}
    return [queues[c].pop(0) for c in best]


@dataclass
class Estimate:
    """A study's predicted wall time, how it was reached, and the hand-out order it assumes."""
    total_s: float  # the study's whole wall time, from its start
    before_s: float  # spent before the runs: corpus, the workers' start, the probe
    runs_s: float  # from the first run's hand-out to the last run's end
    after_s: float  # what follows the runs (the caller's allowance: figures, reports)
    order: list[int]  # hand-out order, indices into the jobs
    per_job_s: list[float]  # each job's predicted wall seconds (0: finished already)
    costs: dict[str, dict[str, float]]  # kind name -> Costs (dict), the probe's means
    workers: int
    load: tuple[float, float, float]  # os.getloadavg() as the probe started
    cpus: int  # os.cpu_count()

    def line(self) -> str:
        kinds = ", ".join(f"{n} {c['step_s'] * 1e3:.0f} ms" for n, c in self.costs.items())
        return (f"estimated wall time {self.total_s / 60:.1f} min: {sum(s > 0 for s in self.per_job_s)} "
                f"runs on {self.workers} workers (a step side by side here: {kinds}; load "
                f"average {self.load[0]:.1f} on {self.cpus} CPUs)")


def estimate(pool: Workers, jobs: list[Job], kinds: list[str], started: float,
             after: Callable[[dict[str, Costs]], float] = lambda costs: 0.0,
             steps: int = 8, warmup: int = 2, eval_batches: int = 4) -> Estimate:
    """Measure on every worker of ``pool`` at once (``probe``) and predict the wall time of
    ``jobs`` run on ``pool`` in the returned order, counted from ``started`` (a perf_counter
    time); ``kinds[i]`` names job i's kind (runs of a kind differ only in seed). Finished jobs
    cost nothing, interrupted ones their remaining steps. ``after(costs)``: the caller's seconds
    after the runs."""
    load = os.getloadavg()
    done = [finished(j) is not None for j in jobs]
    todo = {name: j.cfg for j, name, d in zip(jobs, kinds, done) if not d}
    measured: dict[str, dict[str, float]] = {}
    if todo:
        probes = pool.each(probe, [(r, list(todo.items()), steps, warmup, eval_batches)
                                   for r in range(pool.n)])
        measured = {name: {k: statistics.mean(p[name][k] for p in probes) for k in probes[0][name]}
                    for name in todo}
    costs = {name: Costs(**{f.name: m[f.name] for f in dataclasses.fields(Costs)})
             for name, m in measured.items()}
    seconds = [0.0 if d else costs[name].run_s(j.cfg, int(measured[name]["val_batches"]), _resumes_at(j))
               for j, name, d in zip(jobs, kinds, done)]
    order = best_order(seconds, pool.n)
    runs_s = simulate([seconds[i] for i in order], pool.n)
    after_s = after(costs) if costs else 0.0
    before_s = time.perf_counter() - started
    return Estimate(before_s + runs_s + after_s, before_s, runs_s, after_s, order, seconds,
                    {n: dataclasses.asdict(c) for n, c in costs.items()}, pool.n, load,
                    os.cpu_count() or 1)


def _resumes_at(j: Job) -> int:
    """The step an interrupted run resumes from (its newest checkpoint's), else 0."""
    try:
        return int(json.loads((Path(j.cfg.out_dir) / CHECKPOINTS / LATEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
