"""Train an Engram (or dense, or MoE) language model on the package corpus.

One flat dataclass config, `--key=value` overrides, warmup + cosine schedule, gradient accumulation,
periodic validation, JSONL metrics, tqdm progress, atomic safetensors checkpoints and exact resume:
batches depend on (seed, step) alone and the RNG state is saved, so a run killed at any point and
resumed reaches the same losses as one that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.layers import AdaptiveHead
from ..models.model import EngramLM, ModelConfig
from ..retrieval.compress import Compression, build_compression
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from .batches import Batch, TokenBatches, val_batches
from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .corpus import Corpus, DataConfig, build_corpus
from .optim import build_optimizers, clip_grad_norm_

# glibc gives every freed block above its mmap / trim thresholds back to the kernel, so each step's
# large activations (logits, attention, the FFN's hidden) page-fault in again, zeroed: ~20k minor
# faults and ~12% more CPU time per step of the compare models (benchmarks/train.py, "faults").
# Training processes keep freed memory for the next step instead; peak RSS stays what it was.
# glibc reads these at process start, so they apply to processes started while they are set.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


@contextmanager
def allocator_env():
    """Processes started inside keep freed memory (``ALLOCATOR_ENV``, unless already set)."""
    old = {k: os.environ.get(k) for k in ALLOCATOR_ENV}
    for k, v in ALLOCATOR_ENV.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class TrainConfig:
    out_dir: str = "runs/engram"  # checkpoints, metrics.jsonl, config.json
    seed: int = 0  # model init and batch order
    # -- data --
    sources: tuple[str, ...] = ("kjv", "peoples-daily")
    max_chars: int | None = None  # per source; None = all the text
    val_fraction: float = 0.05
    # -- backbone --
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int | None = None  # None: SwiGLU default (~8/3 d)
    seq_len: int = 128
    head: str = "adaptive"  # "full" softmax or "adaptive" (exact; ~4x faster training on CPU)
    head_cutoffs: tuple[int, ...] = (2048, 8192)  # adaptive: ranks >= the vocabulary are dropped
    tie_embeddings: bool = False  # full head only
    hc_mult: int = 1  # hyper-connection branches
    # -- MoE (replaces the FFN) --
    moe: bool = False
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    top_k: int = 1
    d_expert: int | None = None
    # -- Engram --
    engram: bool = True
    engram_layers: tuple[int, ...] = (1,)  # paper ablation: an early layer is best for one module
    table_size: int = 20_000  # rows per head before rounding up to a prime
    max_ngram_size: int = 3
    n_head_per_ngram: int = 4
    n_embed_per_ngram: int = 128  # d_ngram; head dim = d_ngram / heads
    engram_gate: str | None = None  # None: the profile's default
    # "demo-v1", or "v4.1": DeepSeek-V4.1's layout (one table size for all orders, global row ids,
    # fused bias-free keys, no short conv); its layers import and export as a V4.1 checkpoint's.
    engram_profile: str = "demo-v1"
    engram_norm_eps: float | None = None  # Engram gate norms' eps; None: the profile's (v4.1 1e-6)
    engram_conv: bool | None = None  # short conv on/off; None: the profile's default (on)
    engram_fixed_gate: bool = False  # ablation: gate alpha fixed at 1 (no keys)
    engram_shared_key: bool = False  # ablation: with hc_mult > 1, one key for all branches
    compress: bool = True  # tokenizer compression before hashing; False hashes raw ids (ablation)
    # Small table init: with N(0, 1) rows (the demo's nn.Embedding) the Engram residual starts ~16x
    # the token embeddings and costs the first steps; at 0.02 it starts near identity (a quick
    # A/B at step 40 of 160: val 6.248 at 0.02, 6.264 at 0.1, 6.421 at 1.0, dense 6.295).
    table_init_std: float = 0.02
    # -- Engram-Nine hot tier (arXiv 2601.16531; studies/nine.py) --
    # N_hot per n-gram order: that many most frequent training n-grams get a collision-free row.
    hot_rows: int = 0
    hot_index: str = "mphf"  # "mphf" (MPHF + fingerprint) or "exact" (sorted keys, no false hits)
    fingerprint_bits: int = 16  # mphf: bits per hot slot; non-members pass at ~2^-bits
    mphf_engine: str = "torch"  # "torch" (vectorised BBHash) or "bbhash" (the wheel; extra nine)
    shared_tables: bool = False  # one table set read by every Engram layer (the Nine paper)
    # -- optimisation --
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    table_lr_mult: float = 5.0  # paper: tables at 5x the learning rate, no weight decay
    weight_decay: float = 0.1
    warmup: int = 30
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    # -- bookkeeping --
    eval_every: int = 100
    eval_batches: int = 8  # validation batches per evaluation, spread over the whole val stream
    final_eval_full: bool = False  # evaluate the last step on every validation token
    ckpt_every: int = 100
    log_every: int = 10
    threads: int | None = None  # torch threads; None leaves the default

    def __post_init__(self) -> None:
        self.sources, self.engram_layers = tuple(self.sources), tuple(self.engram_layers)
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches",
                     "ckpt_every", "log_every", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1 and warmup >= 0")
        if self.hot_rows < 0:
            raise ValueError(f"hot_rows must be >= 0, got {self.hot_rows}")
        if self.nine and not self.engram:
            raise ValueError("hot_rows / shared_tables need engram=true")

    @property
    def nine(self) -> bool:
        """Whether the Engram layers read hot+cold stores (Engram-Nine) rather than plain tables."""
        return self.hot_rows > 0 or self.shared_tables

    def engram_config(self) -> EngramConfig | None:
        if not self.engram:
            return None
        sizes = (self.table_size if self.engram_profile == "v4.1"
                 else [self.table_size] * (self.max_ngram_size - 1))
        return EngramConfig(
            engram_vocab_size=sizes,
            max_ngram_size=self.max_ngram_size, n_embed_per_ngram=self.n_embed_per_ngram,
            n_head_per_ngram=self.n_head_per_ngram, layer_ids=list(self.engram_layers),
            pad_id=1, seed=self.seed,  # pad = DeepSeek's EOS, which also separates documents
            profile=self.engram_profile)

    def model_config(self, vocab_size: int) -> ModelConfig:
        # A small corpus (tests, --max_chars) may have fewer ids than the default cutoffs.
        cutoffs = tuple(c for c in self.head_cutoffs if c < vocab_size)
        head = self.head if cutoffs else "full"
        return ModelConfig(
            vocab_size=vocab_size, n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head,
            d_ff=self.d_ff, max_seq_len=self.seq_len, tie_embeddings=self.tie_embeddings,
            head=head, head_cutoffs=cutoffs,
            hc_mult=self.hc_mult, moe=self.moe, n_routed_experts=self.n_routed_experts,
            n_shared_experts=self.n_shared_experts, top_k=self.top_k, d_expert=self.d_expert,
            engram=self.engram_config(), engram_gate=self.engram_gate, sparse_tables=True,
            table_init_std=self.table_init_std, engram_conv=self.engram_conv,
            engram_norm_eps=self.engram_norm_eps,
            engram_fixed_gate=self.engram_fixed_gate, engram_shared_key=self.engram_shared_key)

    def hasher(self, tokenizer: Any = None) -> NgramHasher | None:
        """The run's hasher; compression always maps the full tokenizer (or is the identity)."""
        ecfg = self.engram_config()
        if ecfg is None:
            return None
        comp = build_compression(tokenizer)
        if not self.compress:  # paper table 5 "w/o tokenizer compression": raw ids are hashed
            comp = Compression(np.arange(comp.raw_vocab_size))
        return NgramHasher(ecfg, comp)

    def data_config(self) -> DataConfig:
        return DataConfig(sources=self.sources, max_chars=self.max_chars,
                          val_fraction=self.val_fraction)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


@dataclass
class Run:
    """Everything one training run holds."""
    cfg: TrainConfig
    corpus: Corpus
    hasher: NgramHasher | None
    model: EngramLM
    batches: TokenBatches
    optim: Any
    step: int = 0
    history: list[dict] = field(default_factory=list)
    window: tuple[int, float] = (0, 0.0)  # steps and summed loss since the last log record


def build_model(cfg: TrainConfig, corpus: Corpus,
                tables: dict[int, Any] | None = None) -> EngramLM:
    """The model of ``cfg`` for ``corpus``; an adaptive head gets the training set's id counts."""
    if cfg.nine:
        from ..models.nine_model import build_nine_lm

        model = build_nine_lm(cfg.model_config(corpus.vocab_size),
                              (cfg.max_ngram_size - 1) * cfg.hot_rows, shared=cfg.shared_tables,
                              tables=tables)
    else:
        model = EngramLM(cfg.model_config(corpus.vocab_size), tables=tables)
    if isinstance(model.head, AdaptiveHead):
        counts = np.bincount(corpus.to_local(corpus.train), minlength=corpus.vocab_size)
        model.head.set_frequencies(torch.from_numpy(counts))
    return model


def build_run(cfg: TrainConfig, corpus: Corpus | None = None) -> Run:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    corpus = corpus if corpus is not None else build_corpus(cfg.data_config())
    hasher = cfg.hasher()  # compression from the full tokenizer, whatever the model's vocabulary
    if cfg.nine:  # hot slots, like hash ids, come from token ids in the data pipeline
        from ..retrieval.hot import NineHasher, build_hot_index

        index = build_hot_index(hasher, corpus.train, cfg.hot_rows, cfg.hot_index,
                                cfg.fingerprint_bits, cfg.mphf_engine, seed=cfg.seed)
        hasher = NineHasher(hasher, index, shared=cfg.shared_tables)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, corpus)
    batches = TokenBatches(corpus.train, cfg.batch_size, cfg.seq_len, corpus, hasher, seed=cfg.seed)
    optim = build_optimizers(model, cfg.lr, weight_decay=cfg.weight_decay,
                             table_lr_mult=cfg.table_lr_mult)
    return Run(cfg, corpus, hasher, model, batches, optim)


def _device(run: Run) -> torch.device:
    return next(run.model.parameters()).device


def _to(batch: Batch, device: torch.device) -> Batch:
    """Batches (and their hash ids) are made on the CPU; a model moved to a GPU (gpu_check) gets
    them there."""
    return batch if device.type == "cpu" else batch.to(device)


@torch.no_grad()
def evaluate(run: Run, full: bool = False) -> float:
    """Mean next-token cross entropy (nats) over the fixed validation sweep (all of it if full)."""
    run.model.eval()
    total, count = 0.0, 0
    device = _device(run)
    for b in val_batches(run.corpus.val, run.cfg.batch_size, run.cfg.seq_len, run.corpus,
                         run.hasher, max_batches=None if full else run.cfg.eval_batches):
        b = _to(b, device)
        total += float(run.model.token_nll(run.model(b.inputs, b.hash_ids), b.targets).sum())
        count += b.targets.numel()
    run.model.train()
    return total / max(count, 1)


def _state(run: Run) -> dict[str, Any]:
    state = {"model": run.model.state_dict(), "optim": run.optim.state_dict(),
             "rng": torch.get_rng_state()}
    if hasattr(run.hasher, "index"):  # Engram-Nine: the hot tier's keys, MPHF and fingerprints
        state["hot_index"] = run.hasher.index.state_dict()
    return state


def save(run: Run) -> Path:
    return save_checkpoint(Path(run.cfg.out_dir) / "checkpoints", run.step, _state(run),
                           {"config": run.cfg.to_dict(), "history": run.history,
                            "window": list(run.window)})


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    """Fields that must match to resume: everything but the bookkeeping."""
    skip = {"out_dir", "steps", "eval_every", "eval_batches", "ckpt_every", "log_every", "threads"}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k not in skip}


def check_same_config(cfg: TrainConfig, saved: dict[str, Any], where: Any) -> None:
    """Refuse to resume from a checkpoint written with another config (bookkeeping aside)."""
    # A field added after the checkpoint was written reads as its default there.
    ours, theirs = _comparable(cfg.to_dict()), _comparable({**TrainConfig().to_dict(), **saved})
    if ours != theirs:
        diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"checkpoint {where} was written with another config (differs in "
                              f"{diff}); use another --out_dir or the same config")


def log_record(run: Run, lr: float, last_loss: float, tokens_per_step: int, t_last: float,
               evaluate_fn) -> dict[str, Any]:
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


def try_resume(run: Run) -> bool:
    """Load the newest checkpoint of run.cfg.out_dir, if any. Refuses one from another config."""
    path = latest_checkpoint(Path(run.cfg.out_dir) / "checkpoints")
    if path is None:
        return False
    state, meta, step = load_checkpoint(path)
    check_same_config(run.cfg, meta["config"], path)
    try:
        run.model.load_state_dict(state["model"])
        run.optim.load_state_dict(state["optim"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e
    if "hot_index" in state:  # the saved hot tier is the one the hot rows were trained for
        from ..retrieval.hot import HotIndex

        run.hasher.index = HotIndex.from_state_dict(state["hot_index"])
    torch.set_rng_state(state["rng"])
    run.step, run.history = step, meta["history"]
    run.window = tuple(meta.get("window", (0, 0.0)))
    return True


def _log(run: Run, record: dict) -> None:
    run.history.append(record)
    with open(Path(run.cfg.out_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def train_step(run: Run) -> float:
    """One optimiser step at ``run.step`` (its micro-batches, clip, update); returns the loss."""
    cfg, loss_sum = run.cfg, 0.0
    device = _device(run)
    for micro in range(cfg.grad_accum):
        b = _to(run.batches.batch(run.step * cfg.grad_accum + micro), device)
        loss = run.model.loss(run.model(b.inputs, b.hash_ids), b.targets) / cfg.grad_accum
        loss.backward()
        loss_sum += float(loss.detach())
    clip_grad_norm_([p for p in run.model.parameters() if p.grad is not None], cfg.grad_clip)
    run.optim.step()
    run.optim.zero_grad(set_to_none=True)
    return loss_sum


def train(cfg: TrainConfig, corpus: Corpus | None = None, progress: bool = True,
          resume: bool = True) -> Run:
    """Train to cfg.steps; resumes from out_dir's checkpoint when there is one (and resume=True)."""
    out = Path(cfg.out_dir)
    run = build_run(cfg, corpus)
    if latest_checkpoint(out / "checkpoints") is not None:
        if not resume:
            raise CheckpointError(f"{out} already holds a checkpoint; pass resume=True or use "
                                  "another out_dir (nothing was overwritten)")
        try_resume(run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    if run.step == 0:
        (out / "metrics.jsonl").write_text("")
    else:  # drop records past the checkpoint: they will be written again, identically
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.history))
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=run.step, disable=not progress, desc=Path(cfg.out_dir).name,
               dynamic_ncols=True)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    t_last = time.perf_counter()
    while run.step < cfg.steps:
        lr = lr_at(run.step, cfg)
        run.optim.set_lr(lr)
        loss_sum = train_step(run)
        run.step += 1
        run.window = (run.window[0] + 1, run.window[1] + loss_sum)
        bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == cfg.steps:
            rec = log_record(run, lr, loss_sum, tokens_per_step, t_last,
                             lambda full: evaluate(run, full=full))
            _log(run, rec)
            run.window, t_last = (0, 0.0), time.perf_counter()  # eval is not training time
            bar.set_postfix(loss=f"{loss_sum:.3f}", **({"val": f"{rec['val_loss']:.3f}"}
                                                      if "val_loss" in rec else {}))
        if run.step % cfg.ckpt_every == 0 or run.step == cfg.steps:
            save(run)
    bar.close()
    return run
