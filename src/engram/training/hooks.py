"""The stock hooks of ``loop.fit``: metrics records with a progress bar, checkpoints, and a
study's loss curve with a progress bar.

A run's folder carries the marker of a run (engram/outputs.py), so `engram train` may continue it
and no other command writes into it; metrics.jsonl holds JSON only (a non-finite value is null).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..artifacts.run import CONFIG
from ..files import disk_errors, publish_text
from ..interrupts import stderr_line
from ..outputs import finite, mark
from . import settings
from .loop import ONE_PROCESS, Checkpoints, Ranks, Run, evaluate


def log_record(run: Run, lr: float, last_loss: float, tokens_per_step: int, t_last: float,
               evaluate_fn: Callable[[bool], float]) -> dict[str, Any]:
    """The metrics record of a logging step; ``evaluate_fn(full)`` gives the validation loss."""
    cfg, (steps, summed) = run.cfg, run.window
    # The mean over the logging window: one batch's loss is too noisy to plot.
    rec = {"step": run.step, "loss": summed / steps, "last_loss": last_loss, "lr": lr,
           "tokens": run.step * tokens_per_step,
           "tok_s": steps * tokens_per_step / max(time.perf_counter() - t_last, 1e-9)}
    if run.step == cfg.steps and cfg.final_eval_full:
        rec["val_loss"] = evaluate_fn(True)
    elif run.step % cfg.eval_every == 0 or run.step == cfg.steps:
        rec["val_loss"] = evaluate_fn(False)
    return rec


def first_run_note(cfg: Any) -> None:
    """One line before a first run's one-time work, so a slow first step is no surprise (issue
    50): numba compiling the Engram module's kernels into its cache (~20 s, docs/speed.md)."""
    from ..compute import jit
    from ..module import kernels

    if cfg.engram and cfg.device == "cpu" and not jit.cached(kernels.__file__):
        stderr_line("engram: the first step compiles the Engram module's kernels once (~20 s; "
                    "numba keeps them for later runs)")


class LogMetrics:
    """A record every cfg.log_every steps and at the last (validation loss every cfg.eval_every),
    kept in run.history and, on the logging process, in out_dir/metrics.jsonl beside
    out_dir/config.json and out_dir/settings.json (settings.py); a tqdm bar when ``progress``."""

    def __init__(self, ranks: Ranks = ONE_PROCESS, progress: bool = True,
                 config: dict[str, Any] | None = None):
        self.ranks, self.progress, self.config = ranks, progress, config

    def start(self, run: Run) -> None:
        cfg, out = run.cfg, Path(run.cfg.out_dir)
        if self.ranks.logs:
            out.mkdir(parents=True, exist_ok=True)
            mark(out, "run", "engram train")
            publish_text(out / CONFIG, json.dumps(self.config or cfg.to_dict(), indent=2))
            write_model_files(run, out)
            self.settings = settings.write(out)  # GEMM routes and threads: a repeat reuses them
            # Records past a resumed checkpoint are dropped: they are written again, identically.
            publish_text(out / "metrics.jsonl", "".join(_line(r) for r in run.history))
            if run.step and self.progress:
                stderr_line(f"engram: resuming {out} from step {run.step} (of {cfg.steps})")
            elif self.progress and sys.stderr.isatty():  # beside the bar a person watches
                first_run_note(cfg)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=cfg.steps, initial=run.step, disable=not (self.progress and
                        self.ranks.logs), dynamic_ncols=True,
                        desc=out.name + (f" x{self.ranks.world}" if self.ranks.world > 1 else ""))
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum  # global
        self.t_last = time.perf_counter()

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        cfg = run.cfg
        self.bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == cfg.steps:
            rec = log_record(run, lr, loss, self.tokens_per_step, self.t_last,
                             lambda full: evaluate(run, full, self.ranks))
            run.history.append(rec)
            if self.ranks.logs:
                path = Path(cfg.out_dir) / "metrics.jsonl"  # a torn last line is rewritten
                with disk_errors(path), open(path, "a") as f:  # from the checkpoint on resume
                    f.write(_line(rec))
                self.settings = settings.write(cfg.out_dir, self.settings)  # new buckets, if any
            run.window, self.t_last = (0, 0.0), time.perf_counter()  # eval is not training time
            self.bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{rec['val_loss']:.3f}"}
                                                        if "val_loss" in rec else {}))

    def end(self, run: Run) -> None:
        self.bar.close()

    abort = end


def _line(rec: dict[str, Any]) -> str:
    """One metrics.jsonl line: NaN and Infinity are not JSON, so they are written as null."""
    return json.dumps(finite(rec), allow_nan=False) + "\n"


class LossCurve:
    """Every step's loss in ``losses`` (a study's curve: fine-tuning, concept binding, the digits'
    UNet), and a tqdm bar showing the mean of the last ``every`` each ``every`` steps."""

    def __init__(self, desc: str, progress: bool = True, every: int = 20):
        self.desc, self.progress, self.every = desc, progress, every
        self.losses: list[float] = []

    def start(self, run: Run) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=run.cfg.steps, initial=run.step, desc=self.desc, file=sys.stderr,
                        disable=not self.progress, dynamic_ncols=True, mininterval=2.0)

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        self.losses.append(loss)
        self.bar.update(1)
        if run.step % self.every == 0:
            recent = self.losses[-self.every:]
            self.bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}")

    def end(self, run: Run) -> None:
        self.bar.close()


class SaveCheckpoints:
    """A checkpoint every ``every`` steps and at the last, and of the step reached when a signal
    stops the loop early (``end`` saves what is not saved yet)."""
    saves = True

    def __init__(self, checkpoints: Checkpoints, every: int):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {every}")
        self.checkpoints, self.every = checkpoints, every

    def start(self, run: Run) -> None:
        self.saved = run.step  # a resumed run's checkpoint is this step's

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        if run.step % self.every == 0 or run.step == run.cfg.steps:
            self.checkpoints.save(run)
            self.saved = run.step

    def end(self, run: Run) -> None:
        if run.step > self.saved:  # stopped early (a signal): keep the steps done
            self.checkpoints.save(run)
            self.saved = run.step


def write_model_files(run: Run, out: Path) -> None:
    """``out/model/`` (artifacts/run.py): what opening the run needs besides a checkpoint, so
    it opens with its data gone. A resume finds the same files there and keeps them (the row
    counts cost a pass over the training text)."""
    from ..artifacts.run import identity, read_identity, write_run_files

    corpus, hasher, cfg = run.corpus, run.hasher, run.cfg
    comp = hasher.compression if hasher is not None else corpus.compression()
    nine = cfg.shared_tables if getattr(cfg, "nine", False) else None
    data = {"fingerprint": corpus.fingerprint, "tokenizer": corpus.tokenizer_fingerprint}
    if read_identity(out) == identity(run.model.config, comp, nine, data):
        return
    counts = None
    if hasher is not None:  # the hot cache's; a shared table set once, under its owner
        reads = hasher.count_reads(corpus.train)
        counts = {lid: reads[lid] for lid in hasher.owners}
    write_run_files(out, config=run.model.config, vocab=corpus.vocab, compression=comp,
                    tokenizer_file=corpus.folder / "tokenizer.json", eos_id=corpus.eos_id,
                    nine_shared=nine, data=data, row_counts=counts)
