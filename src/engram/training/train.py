"""Train an Engram (or dense, or MoE) language model on the package corpus.

One flat dataclass config (config.py), `--key=value` overrides, warmup + cosine schedule, gradient
accumulation, periodic validation, JSONL metrics, tqdm progress, atomic safetensors checkpoints and
exact resume: batches depend on (seed, step) alone and the RNG state is saved, so a run killed at
any point and resumed reaches the same losses as one that was never interrupted. The loop itself is
loop.py's (shared with torchrun training and the studies); this file builds a run and its
checkpoints.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from ..compute import gemm
from ..artifacts.checkpoint import (
    FOLDER as CHECKPOINTS,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ..models import precision as precision_
from ..models.layers import AdaptiveHead
from ..models.model import EngramLM
from ..models.precision import LossScaler
from ..module import fused
from ..tables.store import deferred_rows
from . import settings as run_settings
from . import tier_attach, tier_tables
from .batches import TokenBatches
from .config import TrainConfig, saved_config  # noqa: F401  (their old home)
from .corpus import Corpus, build_corpus
from .hooks import LogMetrics, SaveCheckpoints, log_record  # noqa: F401  (log_record: its old home)
from .loop import ONE_PROCESS, Run, evaluate, fit, lr_at, restore, train_step  # noqa: F401
from .optim import build_optimizers
from .settings import ALLOCATOR_ENV, allocator_env  # noqa: F401  (their old home)


def build_model(cfg: TrainConfig, corpus: Corpus,
                tables: dict[int, Any] | None = None) -> EngramLM:
    """The model of ``cfg`` for ``corpus``; an adaptive head gets the training set's id counts."""
    from ..models.nine_model import build_lm

    # Engram-Nine's slots and sharing (none in a plain run: hot_rows 0, shared_tables off)
    model = build_lm(cfg.model_config(corpus.vocab_size), tables=tables,
                     hot_slots=(cfg.max_ngram_size - 1) * cfg.hot_rows, shared=cfg.shared_tables)
    if isinstance(model.head, AdaptiveHead):
        model.head.set_frequencies(torch.from_numpy(corpus.frequencies()))
    return model


def resolve_machine(threads: int | None, device: str = "cpu", precision: str = "fp32",
                    compile: bool = False) -> torch.device:
    """This process's machine choices, made once before any model runs, never inside a forward:
    the device (a UserError if this machine lacks it, its autocast lacks the precision or
    torch.compile cannot build code for it when asked),
    torch's thread count, the numba kernels' plan (module/fused.py) and the GEMM route
    (``ENGRAM_GEMM`` and the decisions already measured on this machine, compute/gemm.py)."""
    dev = precision_.resolve(device, precision, compile)
    if threads:
        torch.set_num_threads(threads)
    gemm.resolve()
    fused.resolve()
    return dev


def place(model: EngramLM, cfg: TrainConfig, device: torch.device) -> EngramLM:
    """The model on its device, tables in the run's precision, compiled if asked (in place, so
    DDP, checkpoints and evaluation see the one module)."""
    precision_.cast_tables(model, cfg.precision).to(device)
    if cfg.compile:
        model.compile()
    return model


def build_run(cfg: TrainConfig, corpus: Corpus | None = None,
              device: torch.device | None = None,
              shard: tier_attach.Shard | None = None) -> Run:
    """The run of ``cfg``: model (on cfg.device, or ``device``: a torchrun rank's), optimisers,
    batches. On the file tier, the tables go to its files (``shard``: a torchrun rank's, whose
    caller replaces the batches and optimisers and rewires the tier to them)."""
    resolved = resolve_machine(cfg.threads, cfg.device, cfg.precision, cfg.compile)
    if shard is None:  # a torchrun rank holds its shard alone (tier_shards)
        tier_attach.check_fits_memory(cfg)
    device = resolved if device is None else device
    corpus = corpus if corpus is not None else build_corpus(cfg.data_config())
    hasher = cfg.hasher(compression=corpus.compression())  # the data's own, over the full tokenizer
    if cfg.nine:  # hot slots, like hash ids, come from token ids in the data pipeline
        from ..retrieval.hot import NineHasher, build_hot_index

        index = build_hot_index(hasher, corpus.train, cfg.hot_rows, cfg.hot_index,
                                cfg.fingerprint_bits, cfg.mphf_engine, seed=cfg.seed)
        hasher = NineHasher(hasher, index, shared=cfg.shared_tables)
    torch.manual_seed(cfg.seed)
    with deferred_rows() if cfg.table_tier == "file" else nullcontext():  # rows: in the tier's files
        model = place(build_model(cfg, corpus), cfg, device)
    if cfg.freeze_tables:  # no gradient, so no optimiser state: the rows stay as drawn
        for p in model.table_parameters():
            p.requires_grad_(False)
    if device.type == "cpu" and cfg.precision == "fp32":  # the only products gemm routes
        run_settings.reuse(cfg.out_dir)  # the routes this run took before, whatever the cache says
        gemm.prepare(model, [cfg.batch_size * cfg.seq_len])  # routes measured now, not in a step
    tier = None
    if cfg.table_tier == "file":  # the tables, initialised straight into their files
        fresh = shard.fresh if shard is not None else FileCheckpoints(cfg.out_dir).latest() is None
        tier = tier_attach.attach(cfg, model, fresh, shard)
    batches = TokenBatches(corpus.streams["train"], cfg.batch_size, cfg.seq_len, corpus, hasher,
                           seed=cfg.seed, sampling=cfg.sampling)
    optim = build_optimizers(model, cfg.lr, weight_decay=cfg.weight_decay,
                             table_lr_mult=cfg.table_lr_mult, table_optimizer=cfg.table_optimizer)
    optim.scaler = LossScaler() if cfg.precision == "fp16" else None
    if tier is not None:
        tier.optim, optim.after_step = optim, tier.write_back
        batches = tier_tables.TierBatches(batches, tier)
    return Run(cfg, corpus, hasher, model, batches, optim)


def _state(run: Run) -> dict[str, Any]:
    state = {"model": run.model.state_dict(), "optim": run.optim.state_dict(),
             "rng": torch.get_rng_state()}
    if run.hasher is not None:  # what the hasher needs back (Engram-Nine: its hot index)
        state.update(run.hasher.checkpoint_state())
    return state


def checkpoint_meta(run: Run) -> dict[str, Any]:
    """What a checkpoint keeps beside the tensors: config and the loop's position."""
    return {"config": run.cfg.to_dict(), "history": run.history, "window": list(run.window),
            "hook_state": run.hook_state, "data": data_identity(run.corpus),
            "settings": run_settings.record()}  # GEMM routes, threads: put back on resume


def data_identity(corpus: Corpus) -> dict[str, str]:
    """What a checkpoint records of the data it was trained on (``check_same_data``)."""
    return {"fingerprint": corpus.fingerprint, "tokenizer": corpus.tokenizer_fingerprint}


def check_same_data(corpus: Corpus, meta: dict[str, Any], where: Any) -> None:
    """Refuse to resume on other data than the checkpoint's (its folder may have moved; its
    tokens may not have changed). Checkpoints from before this record pass."""
    saved = meta.get("data")
    if saved is None or saved == data_identity(corpus):
        return
    why = ("was tokenised with another tokenizer" if saved["tokenizer"] != corpus.tokenizer_fingerprint
           else "holds other tokens (prepared again from changed input, or another corpus)")
    raise CheckpointError(f"checkpoint {where} was trained on other data: {corpus.folder} {why}; "
                          "use the data it was trained on, or another --out_dir")


def load_position(run: Run, meta: dict[str, Any], step: int) -> None:
    """The loop's position from a checkpoint's meta (older ones lack window and hook_state)."""
    run.step, run.history = step, meta["history"]
    run.window = tuple(meta.get("window", (0, 0.0)))
    run.hook_state = meta.get("hook_state", {})


def save(run: Run) -> Path:
    return FileCheckpoints(run.cfg.out_dir).save(run)


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    """Fields that must match to resume: everything but the bookkeeping."""
    # A run may resume on another device, in another precision (tables are cast on load, a loss
    # scale starts or is dropped) or compiled or not; data: a folder's path may change, its tokens
    # may not (``check_same_data``).
    skip = {"out_dir", "steps", "eval_every", "eval_batches", "ckpt_every", "log_every", "threads",
            "device", "precision", "compile", "data", "table_dir", "table_budget_mb"}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k not in skip}


def check_same_config(cfg: TrainConfig, saved: dict[str, Any], where: Any) -> None:
    """Refuse to resume from a checkpoint written with another config (bookkeeping aside)."""
    # A field added after the checkpoint was written reads as its default there.
    ours, theirs = _comparable(cfg.to_dict()), _comparable({**TrainConfig().to_dict(), **saved})
    if ours != theirs:
        diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"checkpoint {where} was written with another config (differs in "
                              f"{diff}); use another --out_dir or the same config")


class FileCheckpoints:
    """``loop.Checkpoints`` of one process: a safetensors file per save in out_dir/checkpoints
    (checkpoint.py), the newest ``keep`` kept."""

    def __init__(self, out_dir: str | Path, keep: int = 2):
        self.dir, self.keep = Path(out_dir) / CHECKPOINTS, keep

    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir)

    def load(self, run: Run, found: Path) -> None:
        state, meta, step = load_checkpoint(found)
        check_same_config(run.cfg, meta["config"], found)
        check_same_data(run.corpus, meta, found)
        try:
            run.model.load_state_dict(state["model"])
            run.optim.load_state_dict(state["optim"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {found} does not fit this model: {e}") from e
        if run.hasher is not None:  # the saved hot tier is the one the hot rows were trained for
            run.hasher.load_checkpoint_state(state)
        torch.set_rng_state(state["rng"])
        load_position(run, meta, step)

    def save(self, run: Run) -> Path:
        return save_checkpoint(self.dir, run.step, _state(run), checkpoint_meta(run),
                               keep=self.keep)


def checkpoints_of(run: Run) -> Any:
    """The run's checkpoints: FileCheckpoints, around the tier's journal on the file tier."""
    files = FileCheckpoints(run.cfg.out_dir)
    tier = getattr(run.batches, "tier", None)
    return files if tier is None else tier_tables.TierCheckpoints(files, tier)


def try_resume(run: Run) -> bool:
    """Load the newest checkpoint of run.cfg.out_dir, if any. Refuses one from another config."""
    return restore(run, checkpoints_of(run))


def train(cfg: TrainConfig, corpus: Corpus | None = None, progress: bool = True,
          resume: bool = True) -> Run:
    """Train to cfg.steps; resumes from out_dir's checkpoint when there is one (and resume=True)."""
    run = build_run(cfg, corpus)
    checkpoints = checkpoints_of(run)
    restore(run, checkpoints, resume)
    return fit(run, [LogMetrics(ONE_PROCESS, progress), SaveCheckpoints(checkpoints, cfg.ckpt_every)])
