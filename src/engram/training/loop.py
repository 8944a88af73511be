"""The training loop, once: ``engram train``, torchrun training and the studies all run ``fit``.

    run = build_run(cfg)                        # train.py: model, optimisers, batch source
    restore(run, FileCheckpoints(cfg.out_dir))  # the newest checkpoint, if any
    fit(run, [LogMetrics(...), SaveCheckpoints(...)], ranks=ONE_PROCESS)

A study that trains something other than an EngramLM on a corpus (memory-only fine-tuning, concept
binding, the digits' UNet) gives fit its own loss: ``loss_run(LoopConfig(...), model, optim, batch,
loss)``, with ``hooks.LossCurve`` for its curve and progress bar. Its learning rate follows the same
``schedule`` (warmup + cosine) as every other run.

What differs between ways of training is passed in as small objects, not subclasses:

- ``ranks`` (``Ranks``): how a global batch is cut for this process, how sums are reduced over
  processes, which module runs the forward (DDP or the model), how gradients are finished and
  clipped, whether this process logs, how a failure is worded. ``ONE_PROCESS`` here;
  ``distributed.DataParallel`` under torchrun.
- ``hooks`` (``Hook``), called in order at the start, after every step and at the end:
  metrics records (``hooks.LogMetrics``; the Nine study's tier watch), checkpoints
  (``hooks.SaveCheckpoints`` over a ``Checkpoints``: ``train.FileCheckpoints`` or
  ``dist_checkpoint.ShardedCheckpoints``).
- ``run.batches`` (``BatchSource``): global batch i for step i // grad_accum, a pure function
  of (seed, i), so a resumed run gets exactly the batches it would have had.

Step, evaluation and clipping exist only here (clipping's arithmetic in ``optim.clip_grad_norm_``).

Device, precision and compile (cfg.device / precision / compile; models/precision.py):
batches are made on the CPU and reach the model's device in ``Ranks.cut``; the forward and loss
of ``train_step`` and ``evaluate`` run under the precision's autocast (none for fp32); under
fp16 the loss scale (``run.optim.scaler``) scales the loss before ``backward`` and unscales the
grads before ``ranks.clip``, and a step whose grads are not finite on any rank is skipped. The
model is placed and compiled in place by ``train.build_run`` (``train.place``), so
``Ranks.forward_module``'s module (the model, or DDP around it) and evaluation run it compiled.

Where later changes plug in, one place each:
- a non-finite loss or gradient: ``train_step`` checks the step's loss and the global grad
  norm ``ranks.clip`` returns before ``run.optim.step()`` (``errors.NonFinite``, naming the step;
  nothing of it is applied or saved); under fp16 a step the loss scale skips on purpose (its
  gradient overflowed at a scale above 1) is not one; SIGINT/SIGTERM: a flag (engram/interrupts.py)
  read at the head of ``fit``'s loop and summed over the ranks, then ``Hook.end``
  (``SaveCheckpoints`` saves the step reached), then ``errors.Interrupted``.
- memory-mapped token shards: ``run.batches`` (a ``BatchSource``) and ``validation``.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from .. import interrupts
from ..artifacts.checkpoint import CheckpointError
from ..errors import Interrupted, NonFinite
from ..models.precision import autocast, model_device
from ..retrieval.hashing import NgramHasher
from .batches import Batch, val_batches
from .corpus import Corpus
from .optim import Optimizers, clip_grad_norm_

STOPPING = ("engram: stopping after this step and saving a checkpoint (Ctrl-C again: stop now, "
            "without saving)")
STOPPING_UNSAVED = "engram: stopping after this step (Ctrl-C again: stop now)"


class BatchSource(Protocol):
    """Where training batches come from (``batches.TokenBatches``; memory-mapped shards later)."""
    # what batch() hashes with; None: Ranks.cut hashes each rank's rows (or slices the ids the file
    # tier hashed whole, training/tier_tables.py)
    hasher: NgramHasher | None

    def batch(self, i: int) -> Batch:
        """Global batch i (all ranks' rows), a pure function of (seed, i)."""
        ...


@dataclass
class LoopConfig:
    """What ``fit`` and ``train_step`` read of a run's config (``train.TrainConfig`` has
    all of it, and more); a study training its own loss builds one."""
    steps: int
    lr: float  # the peak of the schedule; Optimizers.set_lr applies it (tables: x table_lr_mult)
    warmup: int = 0
    min_lr_ratio: float = 1.0  # 1 with warmup 0: a constant lr
    grad_accum: int = 1
    grad_clip: float = math.inf  # inf: the norm is still checked (NonFinite), nothing is scaled
    # The autocast fit puts around the loss; a loss that places its own (finetune's keeps the
    # cross entropy in float32 outside it) leaves this fp32.
    precision: str = "fp32"


@dataclass
class Run:
    """Everything one training run holds."""
    cfg: Any  # train.TrainConfig or a LoopConfig: steps, grad_accum, grad_clip, the schedule, eval_*
    corpus: Corpus | None  # validation (evaluate); None for a study's own loss
    hasher: NgramHasher | None
    model: nn.Module  # an EngramLM unless ``loss`` is given
    batches: BatchSource
    optim: Optimizers
    step: int = 0
    history: list[dict] = field(default_factory=list)
    window: tuple[int, float] = (0, 0.0)  # steps and summed loss since the last record
    hook_state: dict[str, Any] = field(default_factory=dict)  # JSON; hooks' own, in checkpoints
    # loss(module, batch): the mean loss of one micro-batch of ``batches`` through ``module`` (the
    # model, or DDP around it); None: the EngramLM's next-token loss on a Batch.
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None


class StepBatches:
    """A ``BatchSource`` for a custom loss: micro-batch i is ``make(i)`` (unlike
    TokenBatches this may draw from the caller's generator: such runs are not resumed)."""
    hasher = None

    def __init__(self, make: Callable[[int], Any]):
        self.make = make

    def batch(self, i: int) -> Any:
        return self.make(i)


def loss_run(cfg: LoopConfig, model: nn.Module, optim: Optimizers, batch: Callable[[int], Any],
             loss: Callable[[nn.Module, Any], torch.Tensor]) -> Run:
    """A run of a study's own loss for ``fit``: ``batch(i)`` is micro-batch i, ``loss(module,
    batch)`` its mean loss; ``model`` holds the parameters clipped (those with a grad)."""
    return Run(cfg, None, None, model, StepBatches(batch), optim, loss=loss)


class Ranks(Protocol):
    """This process's part in a step: the whole of it (``ONE_PROCESS``) or one rank's rows."""
    world: int  # processes sharing each global batch
    logs: bool  # whether this process writes records and progress (rank 0)

    def cut(self, batch: Batch, model: nn.Module) -> Batch:
        """This process's rows of a global batch, hashed, on the model's device."""
        ...

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the processes."""
        ...

    def forward_module(self, model: nn.Module) -> nn.Module:
        """The module a training forward goes through (the model, or DDP around it)."""
        ...

    def sync_grads(self, last: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward; grads are reduced on the last one."""
        ...

    def clip(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        """Make the grads those of the global batch's mean loss, clip them; returns their norm."""
        ...

    def explain(self, error: RuntimeError, where: str) -> RuntimeError:
        """The error to raise for ``error`` during ``where`` (itself, or reworded)."""
        ...


class OneProcess:
    """``Ranks`` of a single-process run: the whole batch, nothing to reduce."""
    world = 1
    logs = True

    def cut(self, batch: Batch, model: nn.Module) -> Batch:
        # Batches (and their hash ids) are made on the CPU; a model moved to a GPU gets them there.
        # A custom loss's batches (Run.loss) are its own to place.
        if not isinstance(batch, Batch):
            return batch
        device = next(model.parameters()).device
        return batch if device.type == "cpu" else batch.to(device)

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def forward_module(self, model: nn.Module) -> nn.Module:
        return model

    def sync_grads(self, last: bool) -> AbstractContextManager:
        return nullcontext()

    def clip(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)

    def explain(self, error: RuntimeError, where: str) -> RuntimeError:
        return error


ONE_PROCESS = OneProcess()


class Checkpoints(Protocol):
    """Where a run's checkpoints live (one file per save, or one shard per rank)."""

    def latest(self) -> Any | None:
        """A handle on the newest complete checkpoint (checked), or None."""
        ...

    def load(self, run: Run, found: Any) -> None:
        """Put checkpoint ``found`` into ``run``: weights, optimisers, RNG, step, history, window,
        hook_state. Refuses (CheckpointError) one written with another config."""
        ...

    def save(self, run: Run) -> Any:
        """Write run's state as the checkpoint of run.step (a collective under torchrun)."""
        ...


class Hook(Protocol):
    """Something ``fit`` calls; state a hook needs back on resume goes in run.hook_state.
    A hook that keeps the step reached when a signal stops the loop sets ``saves = True`` (the
    stop message says so); one that opens something in ``start`` (a progress bar) may have
    ``abort(run)``, called instead of ``end`` when a step or a hook fails."""

    def start(self, run: Run) -> None:
        """Before the first step (of this process: a resumed run starts at its checkpoint)."""
        ...

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        """After each step; run.step counts the steps done, ``loss`` is the global batch's."""
        ...

    def end(self, run: Run) -> None:
        """After the last step."""
        ...


def schedule(step: int, steps: int, warmup: int, min_ratio: float, peak: float = 1.0) -> float:
    """The learning rate of every run at ``step`` (0-based) of ``steps``: linear warmup to
    ``peak`` over ``warmup`` steps, then cosine decay to ``min_ratio * peak`` at the last step.
    ``peak`` is multiplied in here, in this order, so ``engram train``'s rates stay bit for bit
    those of the formula it always had."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
    return peak * (min_ratio + (1 - min_ratio) * cos)


def lr_at(step: int, cfg: Any) -> float:
    """``schedule`` of a run's config (cfg.lr, warmup, min_lr_ratio, steps)."""
    return schedule(step, cfg.steps, cfg.warmup, cfg.min_lr_ratio, cfg.lr)


def restore(run: Run, checkpoints: Checkpoints, resume: bool = True) -> bool:
    """Load the newest checkpoint into ``run``, if any; with resume=False, refuse to start over it."""
    found = checkpoints.latest()
    if found is None:
        return False
    if not resume:
        raise CheckpointError(f"{Path(run.cfg.out_dir)} already holds a checkpoint; pass "
                              "resume=True or use another out_dir (nothing was overwritten)")
    checkpoints.load(run, found)
    if run.step > run.cfg.steps:  # training nothing and rewriting config.json would hide it
        raise CheckpointError(f"{Path(run.cfg.out_dir)} holds a checkpoint at step {run.step}, "
                              f"past steps={run.cfg.steps}: pass --steps {run.step} or more to "
                              "continue it, or use another out_dir (nothing was changed)")
    return True


def train_step(run: Run, ranks: Ranks = ONE_PROCESS) -> float:
    """One optimiser step at ``run.step`` (its micro-batches, clip, update); returns the loss of
    the global batch (the mean over ranks of each rank's mean). Under fp16 a step whose gradient
    is not finite (on any rank) at a loss scale above 1 is skipped and the scale backs off;
    otherwise a non-finite loss or gradient norm raises NonFinite."""
    cfg, loss_sum = run.cfg, 0.0
    module = ranks.forward_module(run.model)
    scaler = run.optim.scaler
    for micro in range(cfg.grad_accum):
        b = ranks.cut(run.batches.batch(run.step * cfg.grad_accum + micro), run.model)
        with ranks.sync_grads(last=micro == cfg.grad_accum - 1):
            with _autocast(run):  # the forward and loss only: backward runs as autocast recorded
                loss = (run.loss(module, b) if run.loss is not None else
                        run.model.loss(module(b.inputs, b.hash_ids), b.targets)) / cfg.grad_accum
            (loss if scaler is None else scaler.scale_loss(loss)).backward()
        loss_sum += float(loss.detach())
    # fp16: a gradient that overflowed at a loss scale above 1 is the scale's doing (skip the step,
    # back off); one at a scale of 1 or less, or a non-finite loss, is the run's.
    scaled = scaler is not None and scaler.may_overflow
    finite = scaler is None or scaler.unscale_(run.model.parameters(), ranks.sum)
    norm = float(ranks.clip(run.model, cfg.grad_clip)) if finite else math.inf  # global
    mean = ranks.sum([loss_sum])[0] / ranks.world
    if not math.isfinite(mean) or not (math.isfinite(norm) or scaled):  # would poison the weights
        raise NonFinite(f"step {run.step + 1}: the loss is {mean:g} and the gradient norm "
                        f"{norm:g}; training stopped before applying it (lower --lr, or check "
                        "the data)", run.step + 1)
    if math.isfinite(norm):
        run.optim.step()
    if scaler is not None:
        scaler.update(math.isfinite(norm))
    run.optim.zero_grad(set_to_none=True)
    return mean


def _autocast(run: Run) -> AbstractContextManager:
    """The precision's autocast on the model's device (none for fp32)."""
    precision = getattr(run.cfg, "precision", "fp32")
    return nullcontext() if precision == "fp32" else autocast(precision, model_device(run.model))


def validation(run: Run, full: bool = False) -> Iterator[Batch]:
    """The fixed validation sweep (all of it if full), hashed like the training batches."""
    cfg = run.cfg
    return val_batches(run.corpus.streams["val"], cfg.batch_size, cfg.seq_len, run.corpus,
                       run.batches.hasher, max_batches=None if full else cfg.eval_batches)


@torch.no_grad()
def evaluate(run: Run, full: bool = False, ranks: Ranks = ONE_PROCESS) -> float:
    """Mean next-token cross entropy (nats) over the validation sweep, each batch's rows split
    across the ranks."""
    run.model.eval()
    total, count = 0.0, 0
    for b in validation(run, full):
        b = ranks.cut(b, run.model)  # may be empty on a rank: it still joins the lookups
        with _autocast(run):
            total += float(run.model.token_nll(run.model(b.inputs, b.hash_ids), b.targets).sum())
        count += b.targets.numel()
    run.model.train()
    total, count = ranks.sum([total, count])
    return total / max(count, 1)


def fit(run: Run, hooks: Sequence[Hook] = (), ranks: Ranks = ONE_PROCESS) -> Run:
    """Train ``run`` from run.step to run.cfg.steps, calling every hook after every step.

    SIGINT / SIGTERM stop it at the head of the next step (on every rank at the same one); the
    hooks' ``end`` still runs (the checkpoint hook saves the step reached), then Interrupted."""
    say = STOPPING if any(getattr(h, "saves", False) for h in hooks) else STOPPING_UNSAVED
    with interrupts.stop_requests(say if ranks.logs else None):
        stopped = _fit(run, hooks, ranks)
    if stopped:
        interrupts.clear()
        raise Interrupted(f"stopped at step {run.step} of {run.cfg.steps}")
    return run


def _fit(run: Run, hooks: Sequence[Hook], ranks: Ranks) -> bool:
    """``fit``'s loop; True when a signal stopped it."""
    stopped = False
    run.optim.zero_grad(set_to_none=True)  # a grad left on a parameter would join the first step
    for h in hooks:
        h.start(run)
    try:
        while run.step < run.cfg.steps:
            if ranks.sum([float(interrupts.requested())])[0]:  # any rank's signal stops them all
                stopped = True
                break
            try:
                lr = lr_at(run.step, run.cfg)
                run.optim.set_lr(lr)
                loss = train_step(run, ranks)
                run.step += 1
                run.window = (run.window[0] + 1, run.window[1] + loss)
                for h in hooks:
                    h.after_step(run, lr, loss)
            except RuntimeError as e:
                err = ranks.explain(e, f"step {run.step + 1}")
                if err is e:
                    raise
                raise err from e
    except BaseException:  # a failed step or save (a full disk): close what start() opened, so
        for h in hooks:  # the error's line is the last printed; save nothing
            abort = getattr(h, "abort", None)
            if abort is not None:
                abort(run)
        raise
    for h in hooks:
        h.end(run)
    return stopped
