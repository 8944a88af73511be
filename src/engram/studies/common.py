"""What every study shares: how its runs are trained, when a difference counts as resolved, and
figures drawn without touching the caller's matplotlib.

Runs. A study lists its runs as ``Job`` s (name, seed, config; the seed is carried, never read
back from a folder name) and hands them with a work function to ``run_jobs``. Every study's
runs get the same worker processes (spawned; one torch thread and one numba thread each, on 2 cores
that beats one process with 2 threads for these small matmuls; glibc keeping freed memory, see
``training.settings.allocator_env``) and the same resumption: a run whose ``result.json`` matches
its job is read back instead of trained again, and one interrupted mid-way resumes from its
checkpoint (``train()`` does that, for the studies that train through it).

Resolved. One rule, ``RULE``, for every report: a difference between configurations is resolved
when it exceeds 2x the largest seed spread. Rounding alone moves a compare run by ~0.02 nats
(benchmarks/ulp_noise.py) and two or three seeds underestimate the spread, hence the factor 2.

Figures. ``subplots`` gives a ``matplotlib.figure.Figure`` on its own Agg canvas: no pyplot, so
the caller's backend and open figures stay as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from .. import interrupts
from ..errors import Interrupted
from ..files import publish_text
from ..training.settings import allocator_env
from ..training.train import TrainConfig, train

RESULT = "result.json"  # in each run's out_dir once it finished: its job and its result
STOPPING = ("engram: stopping: each run in progress saves a checkpoint after its current step "
            "(Ctrl-C again: stop now, without saving)")


# -- runs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    name: str  # the configuration's name, as the study's report shows it
    seed: int  # model init and batch order; cfg.seed is this
    cfg: TrainConfig  # the run's config; its out_dir is the run's own folder
    args: dict[str, Any] = field(default_factory=dict)  # the work function's own arguments (JSON)

    def __post_init__(self) -> None:
        if self.cfg.seed != self.seed:
            raise ValueError(f"job {self.name}: seed {self.seed} but its config has seed "
                             f"{self.cfg.seed}")

    def key(self) -> dict[str, Any]:
        """What a finished run's result.json must hold to stand for this job (the folder aside:
        a study folder that moved keeps its runs)."""
        cfg = {k: v for k, v in self.cfg.to_dict().items() if k != "out_dir"}
        return json.loads(json.dumps({"name": self.name, "seed": self.seed, "config": cfg,
                                      "args": self.args}))


def job(name: str, cfg: TrainConfig, seed: int, runs: Path, **args: Any) -> Job:
    """The run of ``cfg`` at ``seed`` in ``runs/<name>-s<seed>``."""
    return Job(name, seed, dataclasses.replace(cfg, seed=seed, out_dir=str(runs / f"{name}-s{seed}")),
               args)


def train_run(j: Job) -> dict[str, Any]:
    """The work of compare, the sweeps and ablate: train the job's config (resuming from its
    checkpoint) and keep the numbers their reports read."""
    cfg = j.cfg
    t0 = time.perf_counter()
    run = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    pc = run.model.param_counts()
    return {"val_loss": run.history[-1]["val_loss"], "total_params": pc["total"],
            "active_params": pc["active"], "table_params": pc["table"],
            "tokens": cfg.steps * cfg.batch_size * cfg.seq_len * cfg.grad_accum, "wall_s": wall,
            "tokens_per_s": sum(r["tok_s"] for r in run.history) / len(run.history),
            "history": run.history, "out_dir": cfg.out_dir}


def trained_line(r: dict[str, Any]) -> str:
    """The progress line of a ``train_run`` result."""
    return f"{r['name']} seed {r['seed']}: val loss {r['val_loss']:.4f} ({r['wall_s']:.0f}s)"


def finished(j: Job) -> dict[str, Any] | None:
    """The result of ``j`` read back from its folder, or None when it has not finished. A result
    of another configuration in that folder is an error: nothing is overwritten."""
    path = Path(j.cfg.out_dir) / RESULT
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    want = j.key()
    got = saved.get("job") or {}
    if isinstance(got.get("config"), dict):  # a field added since reads as its default there
        # (as a checkpoint's config does, training/train.check_same_config)
        added = {k: v for k, v in _defaults(j.cfg).items()
                 if k in want["config"] and k not in got["config"]}
        got = {**got, "config": {**added, **got["config"]}}
    if got != want:
        diff = sorted(k for k in ({*want["config"], *got.get("config", {})})
                      if want["config"].get(k) != got.get("config", {}).get(k))
        diff += [k for k in ("name", "seed", "args") if want[k] != got.get(k)]
        raise ValueError(f"{path} holds a finished run of another configuration (differs in "
                         f"{diff}); use another --out_dir or remove that folder")
    return saved["result"]


def _defaults(cfg: Any) -> dict[str, Any]:
    """A config class's default values as a job key holds them (JSON); {} if it has required
    fields."""
    try:
        return json.loads(json.dumps(type(cfg)().to_dict()))
    except TypeError:
        return {}


@contextlib.contextmanager
def worker_env() -> Iterator[None]:
    """The environment worker processes start with: glibc keeps freed memory (allocator_env) and
    numba's pool has one thread (a started pool keeps a thread spinning beside the other workers:
    training ran 10x slower, engram/compute/jit.py)."""
    old = os.environ.get("NUMBA_NUM_THREADS")
    os.environ["NUMBA_NUM_THREADS"] = "1"
    try:
        with allocator_env():
            yield
    finally:
        if old is None:
            os.environ.pop("NUMBA_NUM_THREADS", None)
        else:
            os.environ["NUMBA_NUM_THREADS"] = old


_barrier = None  # in a worker: the pool's barrier (Workers.each, sync_workers)


def _start_worker(barrier) -> None:
    global _barrier
    torch.set_num_threads(1)
    # SIGINT (Ctrl-C reaches every process of the terminal's group; the parent forwards its own
    # SIGINT or SIGTERM as one) only sets the flag: the job in hand stops at its next step and
    # saves a checkpoint (loop.fit), the jobs after it do not start. A KeyboardInterrupt here would
    # kill the worker and leave the pool waiting for its result. SIGTERM keeps ending the worker:
    # it is how the pool stops its workers (a checkpoint being written then stays the old one).
    interrupts.install(signals=(signal.SIGINT,))
    _barrier = barrier
    # A job's progress bar (training/hooks.py) would make tqdm's default lock, a multiprocessing
    # semaphore registered with the parent's resource tracker; the pool ends its workers with
    # SIGTERM, so it is never released and the study's last line was a "leaked semaphore" warning.
    # Jobs run one at a time in a worker: a thread lock is all a bar needs.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def sync_workers(timeout: float = 600.0) -> None:
    """Inside ``Workers.each``: wait until every worker of the pool reaches this point."""
    _barrier.wait(timeout)


_stopped: list[bool] = []  # in a worker: a signal stopped one of its jobs


def _call(task: tuple[int, Callable[[Job], dict], Job]) -> tuple[int, dict[str, Any]]:
    i, work, j = task
    if _stopped or interrupts.requested():
        raise Interrupted(f"{j.name} seed {j.seed} not started")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        r = work(j)
    except Interrupted:
        _stopped.append(True)
        raise
    # Where the runner's time went (the compare estimate is judged by these): this process's CPU
    # seconds and the wall seconds of the job, start-up included.
    return i, {"name": j.name, "seed": j.seed, **r, "job_cpu_s": time.process_time() - c0,
               "job_wall_s": time.perf_counter() - t0}


def _forward(signum: int) -> None:
    """A signal to the parent reaches every worker (a Ctrl-C already has: once more is harmless)."""
    for child in mp.active_children():
        if child.pid is not None:
            try:
                os.kill(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass


def _each(task: tuple[Callable[[Any], Any], Any]) -> Any:
    fn, arg = task
    try:
        _barrier.wait(600.0)  # every worker holds one task before any starts: one task a worker
        return fn(arg)
    except BaseException:
        _barrier.abort()  # the others' sync_workers() raise instead of waiting for this one
        raise


class Workers:
    """The worker processes of a study (see the module docstring): ``n`` spawned processes, one
    torch thread and one numba thread each, glibc keeping freed memory; started once, used for
    a measurement on every worker (``each``) and then the jobs (``run``).

        with Workers(2) as pool:
            probes = pool.each(probe, [args_0, args_1])  # side by side, one on each worker
            results = pool.run(jobs, train_run, "compare runs")
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        self.n = n

    def __enter__(self) -> "Workers":
        self._env = worker_env()
        self._env.__enter__()
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(self.n)
        self.pool = ctx.Pool(self.n, initializer=_start_worker, initargs=(barrier,))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.pool.__exit__(*exc)
        finally:
            self._env.__exit__(*exc)

    def each(self, fn: Callable[[Any], Any], args: list[Any]) -> list[Any]:
        """``fn(args[k])`` on worker k, all at the same time (``fn`` a module-level function that
        may call ``sync_workers``); one argument per worker."""
        if len(args) != self.n:
            raise ValueError(f"{self.n} workers need {self.n} arguments, got {len(args)}")
        return self.pool.map(_each, [(fn, a) for a in args], chunksize=1)

    def run(self, jobs: list[Job], work: Callable[[Job], dict[str, Any]], desc: str,
            line: Callable[[dict[str, Any]], str] = trained_line,
            order: list[int] | None = None) -> list[dict[str, Any]]:
        """As ``run_jobs``, on these workers; ``order`` (indices into ``jobs``) is the order the
        jobs are handed out in, each to the first free worker (results stay in job order)."""
        return _run(jobs, work, desc, line, order, lambda: self.pool)


def run_jobs(jobs: list[Job], work: Callable[[Job], dict[str, Any]], workers: int, desc: str,
             line: Callable[[dict[str, Any]], str] = trained_line,
             order: list[int] | None = None) -> list[dict[str, Any]]:
    """``work(job)`` for every job, in ``workers`` spawned processes (``work`` a module-level
    function); results in job order, each with its job's name and seed, as saved to and read
    back from the run's result.json (so a fresh and a reused run look the same). ``order``: as
    ``Workers.run``. No process starts when every job has finished."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    with contextlib.ExitStack() as stack:
        def pool():
            todo = sum(finished(j) is None for j in jobs)
            return stack.enter_context(Workers(min(workers, todo))).pool
        return _run(jobs, work, desc, line, order, pool)


def _run(jobs, work, desc, line, order, pool) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    folders = [j.cfg.out_dir for j in jobs]
    if len(set(folders)) != len(folders):
        raise ValueError("two jobs share a run folder: give each (name, seed) its own")
    order = list(range(len(jobs))) if order is None else list(order)
    if sorted(order) != list(range(len(jobs))):
        raise ValueError(f"order must list every job once, got {order}")
    results = [finished(j) for j in jobs]
    todo = [(i, work, jobs[i]) for i in order if results[i] is None]
    with tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc) as bar:
        if not todo:
            return results
        workers = pool()
        try:
            with interrupts.stop_requests(STOPPING, also=_forward):
                for i, r in workers.imap_unordered(_call, todo):
                    text = json.dumps(r)
                    publish_text(Path(jobs[i].cfg.out_dir) / RESULT,
                                 json.dumps({"job": jobs[i].key(), "result": json.loads(text)}))
                    results[i] = json.loads(text)
                    bar.update(1)
                    tqdm.write("  " + line(results[i]))
        except Interrupted:
            workers.close()
            workers.join()  # the workers save their checkpoints; jobs not started stay so
            interrupts.clear()
            done = sum(r is not None for r in results)
            raise Interrupted(f"{done} of {len(jobs)} runs finished and are kept; the runs in "
                              "progress saved a checkpoint of the step they reached; the same "
                              "command resumes") from None
    return results


# -- resolved ----------------------------------------------------------------------------------------
RESOLVE = 2.0  # a difference must exceed this many times the largest seed spread
RULE = (f"A difference is resolved when it exceeds {RESOLVE:g}x the largest seed spread (a seed "
        "spread: the max - min of one configuration's result over its seeds; the largest over the "
        "configurations compared). One seed resolves nothing.")


def seed_spread(values: Iterable[float | None]) -> float | None:
    """max - min over seeds (None below two seeds)."""
    xs = [x for x in values if x is not None]
    return max(xs) - min(xs) if len(xs) > 1 else None


def largest_spread(spreads: Iterable[float | None]) -> float | None:
    xs = [s for s in spreads if s is not None]
    return max(xs) if xs else None


def spread_note(spread: float | None) -> str:
    """What a report adds to ``RULE``: the spread its verdicts were judged by."""
    return "" if spread is None else f" The largest seed spread here: {spread:.4f} nats."


def resolved(difference: float | None, spread: float | None) -> bool:
    """Whether ``difference`` is resolved against the largest seed spread ``spread`` (``RULE``).
    No spread (one seed) or a zero one (identical runs) gives nothing to judge by: not resolved."""
    return (difference is not None and spread is not None and spread > 0
            and abs(difference) > RESOLVE * spread)


# -- figures -----------------------------------------------------------------------------------------
def figure(**kw: Any):
    """A Figure drawn by its own Agg canvas (``figsize`` etc. as ``Figure``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **kw: Any):
    """(figure, axes) as pyplot.subplots gives them, on a ``figure``."""
    fig = figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kw)


def save(fig, path: Path, dpi: int = 120) -> None:
    """Lay out and write ``fig``; nothing is left open (no pyplot figure manager holds it)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
