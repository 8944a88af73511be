"""Training on several processes: DDP for the dense parameters, row-sharded Engram tables.

    torchrun --nproc-per-node 2 -m engram train --steps=300 --batch_size=16 ...

The global batch (``batch_size`` rows of ``TokenBatches.batch(step)``) is split by row across ranks,
so a run at world size w sees the same tokens as a single-process run and reaches the same losses
(up to float summation order). The dense parameters are replicated and averaged by DDP; each Engram
table is a :class:`engram.tables.sharded.ShardedTable`, one slice of rows per rank, with its RowAdam state
local to the shard (spec section 4: sharded by row, active rows exchanged by all-to-all).

Checkpoints (``out_dir/checkpoints``), one directory per save, published by ``latest.json`` only
once every rank's file is on disk, so a run killed at any moment resumes from a complete one:
    step_XXXXXXXX/dense/        the dense model, AdamW, RNG, config and history (train.py's format)
    step_XXXXXXXX/shard-RRRRR-of-WWWWW.safetensors   rank R's table rows and their RowAdam state
A checkpoint loads at any world size (each rank reads the slices of the shards its range overlaps),
or into a single-process model (:func:`consolidate`).

Several machines: the same command on each, with a rendezvous and an out_dir on a filesystem every
node sees (each rank writes its own shard there):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        --rdzv-id RUN --max-restarts 3 -m engram train --out_dir=/shared/runs/x ...

Faults: every collective has the process-group timeout, so a rank that dies (connection reset) or
hangs (timeout) makes the others raise :class:`DistributedError` naming the step, instead of
waiting forever; torchrun then stops the rest. Relaunching the same command resumes.

Shape legend: b global batch rows, b/w rows per rank, t sequence length.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import UserError
from ..models.model import EngramLM
from ..retrieval.compress import build_compression
from ..retrieval.hashing import NgramHasher
from ..retrieval.primes import rows_per_layer
from ..tables.sharded import ShardedTable
from .batches import Batch, TokenBatches, val_batches
from .checkpoint import CheckpointError
from .corpus import Corpus, build_corpus
from .dist_checkpoint import (  # noqa: F401
    LATEST,
    consolidate,
    latest_distributed,
    load_distributed,
    save_distributed,
)
from .optim import Optimizers, RowAdam, build_optimizers
from .process_group import (  # noqa: F401
    Dist,
    DistributedError,
    free_port,
    init_distributed,
    spawn_local,
)
from .train import Run, TrainConfig, build_model, build_run, log_record, lr_at

# -- building the run ------------------------------------------------------------------------------

def shard_tables(model: EngramLM, group) -> None:
    """Swap every in-memory Engram table for this rank's shard of it (same rows, same init)."""
    for engram in model.engrams().values():
        full = engram.table
        engram.table = ShardedTable(full.num_rows, full.dim, group=group, sparse=True,
                                    dtype=full.weight.dtype).load_rows_(full.weight.detach())


def sharded_optimizers(model: EngramLM, cfg: TrainConfig) -> Optimizers:
    """train.py's optimisers (same groups, same order), with RowAdam on the local shards."""
    base = build_optimizers(model, cfg.lr, weight_decay=cfg.weight_decay,
                            table_lr_mult=cfg.table_lr_mult)  # puts the shards in AdamW: refiled
    shards = [e.table.weight for e in model.engrams().values() if isinstance(e.table, ShardedTable)]
    ids = {id(p) for p in shards}
    betas, eps = base.dense.defaults["betas"], base.dense.defaults["eps"]
    groups = [{"params": [p for p in g["params"] if id(p) not in ids],
               "weight_decay": g["weight_decay"]} for g in base.dense.param_groups]
    dense = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=betas, eps=eps)
    rows = RowAdam(shards, lr=cfg.lr * cfg.table_lr_mult, betas=betas, eps=eps) if shards else None
    return Optimizers(dense, rows, cfg.table_lr_mult)


def build_distributed_run(cfg: TrainConfig, d: Dist, corpus: Corpus | None = None,
                          table_init: str = "replicated") -> tuple[Run, DDP]:
    """The model of train.build_run with sharded tables, wrapped in DDP.

    ``table_init="replicated"`` builds the whole single-process model first (every rank holds the
    full table for a moment), so step 0 is exactly train.py's; ``"sharded"`` initialises each shard
    alone (:func:`engram.tables.sharded.init_rows`): the only choice for tables larger than one machine,
    identical across world sizes but not to a single-process ``engram train`` run.
    """
    if cfg.batch_size % d.world:
        raise UserError(f"batch_size={cfg.batch_size} (the global batch) must divide evenly over "
                         f"{d.world} ranks")
    if corpus is None:  # rank 0 tokenises and caches; the others then read the cache
        if d.rank == 0:
            corpus = build_corpus(cfg.data_config())
        dist.barrier(group=d.control)
        corpus = corpus or build_corpus(cfg.data_config())
    if table_init == "replicated":
        run = build_run(cfg, corpus)
        shard_tables(run.model, d.tables)
    elif table_init == "sharded":
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        ecfg = cfg.engram_config()
        torch.manual_seed(cfg.seed)
        tables = {} if ecfg is None else {
            L: ShardedTable(n, ecfg.head_dim, group=d.tables, init_std=cfg.table_init_std,
                            seed=cfg.seed * 10_007 + L) for L, n in rows_per_layer(ecfg).items()}
        model = build_model(cfg, corpus, tables)
        hasher = NgramHasher(ecfg, build_compression()) if ecfg is not None else None
        run = Run(cfg, corpus, hasher, model, None, None)
    else:
        raise UserError(f"table_init must be 'replicated' or 'sharded', got {table_init!r}")
    run.model.to(d.device)
    # Unhashed: each rank hashes only its own rows of the global batch.
    run.batches = TokenBatches(corpus.train, cfg.batch_size, cfg.seq_len, corpus, seed=cfg.seed)
    run.optim = sharded_optimizers(run.model, cfg)
    # The shards differ per rank: DDP must neither broadcast nor average them.
    DDP._set_params_and_buffers_to_ignore_for_model(run.model, [
        f"{n}.weight" for n, m in run.model.named_modules() if isinstance(m, ShardedTable)])
    ddp = DDP(run.model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
              forward_sync_buffers=False, find_unused_parameters=cfg.moe)  # unrouted experts
    return run, ddp


def local_batch(b: Batch, hasher: NgramHasher | None, d: Dist) -> Batch:
    """This rank's rows of a global batch, hashed here (a row's hash ids depend on its tokens)."""
    n = b.raw.shape[0]
    s = slice(d.rank * n // d.world, (d.rank + 1) * n // d.world)
    raw = b.raw[s]  # [b/w, t]
    out = Batch(raw, b.inputs[s], b.targets[s], hasher.hash(raw) if hasher is not None else {})
    return out.to(d.device)


def _sum(values: list[float], d: Dist) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=d.control)
    return t.tolist()


@torch.no_grad()
def evaluate_distributed(run: Run, d: Dist, full: bool = False) -> float:
    """train.evaluate over the same windows, each batch's rows split across ranks."""
    run.model.eval()
    total = count = 0.0
    for b in val_batches(run.corpus.val, run.cfg.batch_size, run.cfg.seq_len, run.corpus, None,
                         max_batches=None if full else run.cfg.eval_batches):
        lb = local_batch(b, run.hasher, d)  # may be empty: the rank still joins the lookups
        total += float(run.model.token_nll(run.model(lb.inputs, lb.hash_ids), lb.targets).sum())
        count += lb.targets.numel()
    run.model.train()
    total, count = _sum([total, count], d)
    return total / max(count, 1)


def clip_grad_norm_sharded(model: EngramLM, max_norm: float, d: Dist) -> float:
    """optim.clip_grad_norm_ over the dense grads (equal on all ranks after DDP) and all shards."""
    shards = {id(p) for m in model.modules() if isinstance(m, ShardedTable) for p in m.parameters()}
    dense_sq = shard_sq = 0.0
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()  # a row asked for by several ranks counts once, summed
        g = p.grad.values() if p.grad.is_sparse else p.grad
        sq = float(torch.linalg.vector_norm(g.float()) ** 2)
        if id(p) in shards:
            shard_sq += sq
        else:
            dense_sq += sq
        grads.append(p.grad)
    total = (dense_sq + _sum([shard_sq], d)[0]) ** 0.5
    coef = min(max_norm / (total + 1e-6), 1.0)  # the same guard and clamp as torch
    for g in grads:
        g.mul_(coef)
    return total




# -- the loop --------------------------------------------------------------------------------------

_PEER_FAILURE = ("gloo", "nccl", "connection", "timed out", "timeout", "monitoredbarrier",
                 "peer", "broken pipe")


def _explain(e: RuntimeError, d: Dist, where: str, out_dir: str) -> RuntimeError:
    """A collective's failure, reworded: which rank saw it, where, and how to go on."""
    if isinstance(e, (DistributedError, CheckpointError)) or not any(
            k in str(e).lower() for k in _PEER_FAILURE):
        return e  # already explained, or a local error (a bug, bad input): keep it as it is
    found = latest_distributed(out_dir)
    last = f"step {found[1]['step']}" if found else "none yet"
    return DistributedError(
        f"rank {d.rank}/{d.world}: a collective failed during {where}: another rank died "
        f"or stopped answering within the {d.timeout_s:g}s timeout. Last complete checkpoint: "
        f"{last}; relaunch the same command to resume from it. "
        f"Cause: {str(e).splitlines()[0][:300]}")


def _train_step(run: Run, ddp: DDP, d: Dist) -> float:
    cfg = run.cfg
    loss_sum = 0.0
    for micro in range(cfg.grad_accum):
        b = local_batch(run.batches.batch(run.step * cfg.grad_accum + micro), run.hasher, d)
        # DDP averages the dense grads once, on the last micro-batch.
        with ddp.no_sync() if micro < cfg.grad_accum - 1 else nullcontext():
            loss = run.model.loss(ddp(b.inputs, b.hash_ids), b.targets) / cfg.grad_accum
            loss.backward()
        loss_sum += float(loss.detach())
    # A shard's grad is the sum over ranks of each rank's mean loss; DDP's dense grads are the
    # average. Dividing makes both the gradient of the global-batch mean, as in train.py.
    for m in run.model.modules():
        if isinstance(m, ShardedTable) and m.weight.grad is not None:
            m.weight.grad.mul_(1.0 / d.world)
    clip_grad_norm_sharded(run.model, cfg.grad_clip, d)
    run.optim.step()
    run.optim.zero_grad(set_to_none=True)
    return _sum([loss_sum], d)[0] / d.world


def train_distributed(cfg: TrainConfig, corpus: Corpus | None = None, progress: bool = True,
                      resume: bool = True, table_init: str = "replicated",
                      timeout_s: float = 300.0) -> Run:
    """train.train on every rank of a torchrun job; same metrics, sharded checkpoints.

    Joins the job from the environment (or uses the process group already set up), trains to
    cfg.steps, resuming from out_dir's newest sharded checkpoint (saved at any world size).
    Rank 0 writes metrics.jsonl and config.json. Returns this rank's Run.
    """
    d = init_distributed(timeout_s)
    try:
        return _train(cfg, d, corpus, progress, resume, table_init)
    except RuntimeError as e:  # a failure while starting or resuming, before the first step
        err = _explain(e, d, "start-up", cfg.out_dir)
        if err is e:
            raise
        raise err from e
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, d: Dist, corpus: Corpus | None, progress: bool, resume: bool,
           table_init: str) -> Run:
    out = Path(cfg.out_dir)
    run, ddp = build_distributed_run(cfg, d, corpus, table_init)
    found = latest_distributed(out)
    if found is not None:
        if not resume:
            raise CheckpointError(f"{out} already holds a checkpoint; pass resume=True or use "
                                  "another out_dir (nothing was overwritten)")
        load_distributed(run, *found)
    if d.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": d.world,
                                                     "table_init": table_init}, indent=2))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.history))
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=run.step, disable=not progress or d.rank != 0,
               desc=f"{out.name} x{d.world}", dynamic_ncols=True)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum  # global
    t_last = time.perf_counter()
    while run.step < cfg.steps:  # the records and their schedule are train.train's
        try:
            lr = lr_at(run.step, cfg)
            run.optim.set_lr(lr)
            loss = _train_step(run, ddp, d)
            run.step += 1
            run.window = (run.window[0] + 1, run.window[1] + loss)
            bar.update(1)
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                rec = log_record(run, lr, loss, tokens_per_step, t_last,
                                 lambda full: evaluate_distributed(run, d, full=full))
                run.history.append(rec)
                if d.rank == 0:
                    with open(out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
                run.window, t_last = (0, 0.0), time.perf_counter()  # eval is not training time
                bar.set_postfix(loss=f"{loss:.3f}")
            if run.step % cfg.ckpt_every == 0 or run.step == cfg.steps:
                save_distributed(run, d)
        except RuntimeError as e:
            err = _explain(e, d, f"step {run.step + 1}", cfg.out_dir)
            if err is e:
                raise
            raise err from e
    bar.close()
    return run
