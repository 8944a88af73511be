"""Training on several processes: DDP for the dense parameters, row-sharded Engram tables.

    torchrun --nproc-per-node 2 -m engram train --steps=300 --batch_size=16 ...

The global batch (``batch_size`` rows of ``TokenBatches.batch(step)``) is split by row across ranks,
so a run at world size w sees the same tokens as a single-process run and reaches the same losses
(up to float summation order). The dense parameters are replicated and averaged by DDP; each Engram
table is a ``engram.tables.sharded.ShardedTable``, one slice of rows per rank, with its table
optimiser state local to the shard (spec section 4: sharded by row, active rows exchanged by all-to-all).
The loop, its records and checkpoint schedule are ``loop.fit``'s, as for ``engram train``; this
file supplies ``DataParallel``, this rank's part of a step (``loop.Ranks``).

Checkpoints (``out_dir/checkpoints``), one directory per save, published by ``latest.json`` only
once every rank's file is on disk, so a run killed at any moment resumes from a complete one:
    step_XXXXXXXX/dense/        the dense model, AdamW, RNG, config and history (train.py's format)
    step_XXXXXXXX/shard-RRRRR-of-WWWWW.safetensors   rank R's table rows and their optimiser state
A checkpoint loads at any world size (each rank reads the slices of the shards its range overlaps),
or into a single-process model (``consolidate``).

Tables in files (``--table_tier file``, training/tier_shards.py): each rank's shard of every table
and its optimiser state live in the rank's own tier folder, ``<table_dir>/rank-RRRRR-of-WWWWW``;
a step holds only the rows of the shard the global batch reads (a ``WorkingShard``), and the shard
files then hold no rows. Such a run resumes at its own world size only.

Several machines: the same command on each, with a rendezvous and an out_dir on a filesystem every
node sees (each rank writes its own shard there):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        --rdzv-id RUN --max-restarts 3 -m engram train --out_dir=/shared/runs/x ...

Faults: every collective has the process-group timeout, so a rank that dies (connection reset) or
hangs (timeout) makes the others raise ``DistributedError`` naming the step, instead of
waiting forever; torchrun then stops the rest. Relaunching the same command resumes.

Shape legend: b global batch rows, b/w rows per rank, t sequence length.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..artifacts.checkpoint import CheckpointError
from ..errors import UserError
from ..models.model import EngramLM
from ..models.precision import LossScaler
from ..retrieval.hashing import NgramHasher
from ..retrieval.primes import rows_per_layer
from ..tables.sharded import ShardedTable
from . import settings as run_settings
from .batches import Batch, TokenBatches
from .corpus import Corpus, build_corpus
from .dist_checkpoint import (  # noqa: F401
    LATEST,
    ShardedCheckpoints,
    consolidate,
    latest_distributed,
    load_distributed,
    save_distributed,
)
from .hooks import LogMetrics, SaveCheckpoints
from .loop import fit, restore
from .optim import Optimizers, build_optimizers, clip_grad_norm_, make_table_optimizer
from .process_group import (  # noqa: F401
    Dist,
    DistributedError,
    backend_for,
    free_port,
    init_distributed,
    spawn_local,
)
from .tier_shards import Shard, check_world
from .tier_tables import TierBatches, TierCheckpoints
from .train import Run, TrainConfig, build_model, build_run, place, resolve_machine

# -- building the run ------------------------------------------------------------------------------

def shard_tables(model: EngramLM, group) -> None:
    """Swap every in-memory Engram table for this rank's shard of it (same rows, same init)."""
    for engram in model.engrams().values():
        full = engram.table
        engram.table = ShardedTable(full.num_rows, full.dim, group=group, sparse=True,
                                    dtype=full.weight.dtype).load_rows_(full.weight.detach())


def sharded_optimizers(model: EngramLM, cfg: TrainConfig) -> Optimizers:
    """train.py's optimisers (same groups, same order), with the table optimiser on the local
    shards."""
    base = build_optimizers(model, cfg.lr, weight_decay=cfg.weight_decay,
                            table_lr_mult=cfg.table_lr_mult)  # puts the shards in AdamW: refiled
    shards = [e.table.weight for e in model.engrams().values() if isinstance(e.table, ShardedTable)]
    ids = {id(p) for p in shards}
    betas, eps = base.dense.defaults["betas"], base.dense.defaults["eps"]
    groups = [{"params": [p for p in g["params"] if id(p) not in ids],
               "weight_decay": g["weight_decay"]} for g in base.dense.param_groups]
    dense = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=betas, eps=eps)
    rows = make_table_optimizer(cfg.table_optimizer, shards, cfg.lr * cfg.table_lr_mult, betas,
                                eps) if shards else None
    return Optimizers(dense, rows, cfg.table_lr_mult,
                      LossScaler() if cfg.precision == "fp16" else None)


def build_distributed_run(cfg: TrainConfig, d: Dist, corpus: Corpus | None = None,
                          table_init: str = "replicated") -> tuple[Run, DDP]:
    """The model of train.build_run with sharded tables, wrapped in DDP (on the file tier: each
    rank's shard in its own tier folder; table_init must be "replicated" there, the rows drawn
    chunk by chunk straight into the files).

    ``table_init="replicated"`` builds the whole single-process model first (every rank holds the
    full table for a moment), so step 0 is exactly train.py's; ``"sharded"`` initialises each shard
    alone (``engram.tables.sharded.init_rows``): the only choice for tables larger than one machine,
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
    if cfg.table_tier == "file":  # each rank's shard of the tables in its own tier folder
        if table_init != "replicated":
            raise UserError("table_tier=file under torchrun draws each rank's rows from the "
                            "whole table's init (never in memory): drop --table_init=sharded")
        shard = Shard(d.rank, d.world, rows_per_layer(cfg.engram_config()),
                      check_world(cfg.out_dir, d.world), d.tables, d.control)
        run = build_run(cfg, corpus, d.device, shard)
    elif table_init == "replicated":
        run = build_run(cfg, corpus, d.device)
        shard_tables(run.model, d.tables)
    elif table_init == "sharded":
        resolve_machine(cfg.threads, str(d.device), cfg.precision, cfg.compile)
        run_settings.reuse(cfg.out_dir)  # routes decided on first use: the recorded ones first
        ecfg = cfg.engram_config()
        torch.manual_seed(cfg.seed)
        tables = {} if ecfg is None else {
            L: ShardedTable(n, ecfg.head_dim, group=d.tables, init_std=cfg.table_init_std,
                            seed=cfg.seed * 10_007 + L) for L, n in rows_per_layer(ecfg).items()}
        model = place(build_model(cfg, corpus, tables), cfg, d.device)
        hasher = NgramHasher(ecfg, corpus.compression()) if ecfg is not None else None
        run = Run(cfg, corpus, hasher, model, None, None)
    else:
        raise UserError(f"table_init must be 'replicated' or 'sharded', got {table_init!r}")
    run.model.to(d.device)
    build_batches = run.batches
    # Unhashed: each rank hashes only its own rows of the global batch (on the file tier the
    # tier hashes the whole batch, to find its shard's rows, and local_batch slices those ids).
    # Every rank reads the global batch's windows from the same memory-mapped shards, then its rows.
    run.batches = TokenBatches(corpus.streams["train"], cfg.batch_size, cfg.seq_len, corpus,
                               seed=cfg.seed, sampling=cfg.sampling)
    run.optim = sharded_optimizers(run.model, cfg)
    tier = getattr(build_batches, "tier", None)
    if tier is not None:  # the tier's working sets, on these batches and optimisers
        tier.hash, tier.optim, run.optim.after_step = run.hasher.hash, run.optim, tier.write_back
        run.batches = TierBatches(run.batches, tier)
    # The shards differ per rank: DDP must neither broadcast nor average them.
    DDP._set_params_and_buffers_to_ignore_for_model(run.model, [
        f"{n}.weight" for n, m in run.model.named_modules() if isinstance(m, ShardedTable)])
    # No buffer sync in forward: torch 2.13 names it forward_sync_buffers (broadcast_buffers is
    # deprecated there); older releases know only broadcast_buffers (2.11 on a lent H200 refused
    # the new name).
    new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    ddp = DDP(run.model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
              find_unused_parameters=cfg.moe,  # unrouted experts
              **{"forward_sync_buffers" if new else "broadcast_buffers": False})
    return run, ddp


def local_batch(b: Batch, hasher: NgramHasher | None, d: Dist) -> Batch:
    """This rank's rows of a global batch, hashed here; a batch the file tier hashed whole (to
    find its shard's rows) gives its slice of those ids instead (a row's hash ids depend on its
    tokens alone, so the slice of the batch's ids is the hash of the slice)."""
    n = b.raw.shape[0]
    s = slice(d.rank * n // d.world, (d.rank + 1) * n // d.world)
    raw = b.raw[s]  # [b/w, t]
    if b.hash_ids:
        ids = {lid: h[s] for lid, h in b.hash_ids.items()}  # [b/w, t, H]
    else:
        ids = hasher.hash(raw) if hasher is not None else {}
    out = Batch(raw, b.inputs[s], b.targets[s], ids)
    return out.to(d.device)


def _sum(values: list[float], d: Dist) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=d.control)
    return t.tolist()


# -- faults --------------------------------------------------------------------------------------

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


# -- this rank's part in the loop ------------------------------------------------------------------

@dataclass
class DataParallel:
    """``loop.Ranks`` under torchrun: each rank takes its rows of the global batch and hashes
    them, DDP averages the dense grads, each table is sharded by row (its grads stay local)."""
    d: Dist
    ddp: DDP
    hasher: NgramHasher | None
    out_dir: str  # named in the error a peer's failure raises

    @property
    def world(self) -> int:
        return self.d.world

    @property
    def logs(self) -> bool:
        return self.d.rank == 0

    def cut(self, batch: Batch, model: EngramLM) -> Batch:
        return local_batch(batch, self.hasher, self.d)

    def sum(self, values: list[float]) -> list[float]:
        return _sum(values, self.d)

    def forward_module(self, model: EngramLM) -> DDP:
        return self.ddp

    def sync_grads(self, last: bool) -> AbstractContextManager:
        # DDP averages the dense grads once, on the last micro-batch.
        return nullcontext() if last else self.ddp.no_sync()

    def clip(self, model: EngramLM, max_norm: float) -> float:
        # A shard's grad is the sum over ranks of each rank's mean loss; DDP's dense grads are the
        # average. Dividing makes both the gradient of the global-batch mean, as in train.py.
        for m in model.modules():
            if isinstance(m, ShardedTable) and m.weight.grad is not None:
                m.weight.grad.mul_(1.0 / self.d.world)
        shards = [p for m in model.modules() if isinstance(m, ShardedTable) for p in m.parameters()]
        return clip_grad_norm_(model.parameters(), max_norm, sharded=shards, sum_ranks=self.sum)

    def explain(self, error: RuntimeError, where: str) -> RuntimeError:
        return _explain(error, self.d, where, self.out_dir)


def train_distributed(cfg: TrainConfig, corpus: Corpus | None = None, progress: bool = True,
                      resume: bool = True, table_init: str = "replicated",
                      timeout_s: float = 300.0) -> Run:
    """train.train on every rank of a torchrun job; same metrics, sharded checkpoints.

    Joins the job from the environment (or uses the process group already set up), trains to
    cfg.steps, resuming from out_dir's newest sharded checkpoint (saved at any world size).
    Rank 0 writes metrics.jsonl and config.json. Returns this rank's Run.
    """
    d = init_distributed(timeout_s, backend_for(cfg.device))
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
    run, ddp = build_distributed_run(cfg, d, corpus, table_init)
    checkpoints = ShardedCheckpoints(d, cfg.out_dir)
    if isinstance(run.batches, TierBatches):  # the checkpoints between its sync and its journal
        checkpoints = TierCheckpoints(checkpoints, run.batches.tier)
    restore(run, checkpoints, resume)
    ranks = DataParallel(d, ddp, run.hasher, cfg.out_dir)
    config = {**cfg.to_dict(), "world_size": d.world, "table_init": table_init}
    # The records and their schedule are train.train's: the same loop and hooks.
    return fit(run, [LogMetrics(ranks, progress, config), SaveCheckpoints(checkpoints,
                                                                          cfg.ckpt_every)], ranks)

