"""`engram finetune MODEL --data DIR`: Engram memory for a pretrained transformers model, trained on
your own prepared text, saved as a self-contained adapter.

    engram prepare --input ~/notes --tokenizer smollm2 --out corpus/
    engram finetune smollm2 --data corpus/ --out_dir run/
    engram generate run/ --prompt "..."            # or engram.open("run/"), engram eval, lm-eval

The backbone stays frozen; Engram is injected at the chosen layers (models/hf.py) and only the
memory trains: tables with the project's table optimiser at ``table_lr_mult`` x lr, projections,
norms and conv with AdamW (training/optim.py ``build_optimizers``; paper recipe, spec section 4).
At the first step the model equals the base model (the value projection starts at zero).

One training loop: ``loop.fit`` with the corpus's ``TokenBatches`` (batch i is a pure function of
(seed, i)), checkpoints every ``ckpt_every`` steps in OUT/checkpoints holding the Engram tensors,
the optimiser state and the loop's position only (not the frozen base), so the same command resumes
exactly, and refuses a checkpoint of another config, model or data. At the end OUT holds the
adapter (artifacts/adapter.py: engram.safetensors with the base model's name and fingerprint, the
tokenizer and its compression map) and finetune.json (held-out loss before and after).

Checks before any work, one line each: a model folder of another family (models/pretrained.py), a
corpus prepared with another tokenizer than the model's.

Shape legend: b batch, t positions (seq_len).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..artifacts.adapter import SUMMARY, save_engram
from ..artifacts.checkpoint import (
    FOLDER as CHECKPOINTS,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ..errors import UserError
from ..files import publish_text
from ..models.adapter import base_fingerprint, engram_state_dict, load_engram_state_dict
from ..models.hf import engram_runtime, freeze_base, inject
from ..models.precision import (
    PRECISIONS,
    LossScaler,
    autocast,
    cast_tables,
    check_names,
    model_device,
    resolve,
)
from ..models.pretrained import check_model, load_pretrained
from ..ranges import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Range, check_ranges
from ..retrieval.compress import Compression, tokenizer_fingerprint
from ..retrieval.config import EngramConfig
from .batches import TokenBatches, val_batches
from .corpus import Corpus, open_corpus
from .hooks import LossCurve, SaveCheckpoints
from .loop import Run, fit, restore
from .optim import Optimizers, build_optimizers

ADAPTER_KIND = "adapter"


@dataclass
class FinetuneConfig:
    data: str  # a folder written by `engram prepare --tokenizer MODEL` (the model's own tokenizer)
    out_dir: str = "runs/finetune"  # the adapter; rerunning the same command resumes it
    # Decoder layers that get Engram; empty: layer 1 and the middle layer (paper: early + middle).
    layers: tuple[int, ...] = ()
    steps: int = 500
    batch_size: int = 4
    seq_len: int = 128
    # Dense Engram parameters; tables take table_lr_mult x this. SmolLM2, 60 steps (held-out
    # KJV / python-doc delta): 1e-3 -0.10 / -0.02, 5e-3 -0.30 / -0.02, 2e-2 -0.30 / +0.13.
    lr: float = 5e-3
    table_lr_mult: float = 5.0
    warmup: int = 10
    min_lr_ratio: float = 0.1  # the cosine schedule's floor, a fraction of lr
    grad_clip: float = 1.0
    seed: int = 0  # batch order, Engram's hash multipliers and init
    # -- the memory --
    table_size: int = 20_000  # rows per head before rounding up to a prime
    max_ngram_size: int = 3
    n_head_per_ngram: int = 4
    n_embed_per_ngram: int = 128
    table_init_std: float = 0.02
    # -- bookkeeping --
    ckpt_every: int = 50
    log_every: int = 10
    eval_batches: int = 8  # held-out batches scored before and after (spread over the val split)
    threads: int | None = None  # torch threads; None leaves the default
    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    # fp32, or bf16 / fp16 (forwards under autocast; the frozen base stays float32)
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})

    grad_accum = 1  # what loop.fit reads; one micro-batch per step

    def __post_init__(self) -> None:
        self.layers = tuple(int(i) for i in self.layers)
        for name in ("steps", "batch_size", "seq_len", "ckpt_every", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup < 0:
            raise UserError("need lr > 0 and warmup >= 0")
        check_ranges(self, seed=NON_NEGATIVE, threads=AT_LEAST_1, grad_clip=POSITIVE,
                     layers=NON_NEGATIVE, table_size=Range(2), max_ngram_size=Range(2),
                     n_head_per_ngram=AT_LEAST_1, n_embed_per_ngram=AT_LEAST_1,
                     table_init_std=NON_NEGATIVE, table_lr_mult=NON_NEGATIVE,
                     min_lr_ratio=Range(0, 1, True, True))
        check_names(self.device, self.precision)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- what the command and the study (studies/finetune.py) share ------------------------------------

def memory_config(layers: list[int], pad_id: int, seed: int, table_size: int, max_ngram_size: int,
                  n_head_per_ngram: int, n_embed_per_ngram: int) -> EngramConfig:
    return EngramConfig(engram_vocab_size=[table_size] * (max_ngram_size - 1),
                        max_ngram_size=max_ngram_size, n_embed_per_ngram=n_embed_per_ngram,
                        n_head_per_ngram=n_head_per_ngram, layer_ids=list(layers), pad_id=pad_id,
                        seed=seed)


def attach_memory(model: nn.Module, config: EngramConfig, compression: Compression,
                  init_std: float, precision: str, seed: int) -> list[nn.Parameter]:
    """Inject Engram (initialised from ``seed``), cast its tables to ``precision``, freeze the
    rest; the trainable parameters."""
    torch.manual_seed(seed)
    inject(model, config, compression=compression, init_std=init_std)
    cast_tables(model, precision)  # on the model's device already (inject put them there)
    return freeze_base(model)


def memory_optimizers(model: nn.Module, lr: float, table_lr_mult: float,
                      precision: str) -> Optimizers:
    """The project's optimisers over the trainable (Engram) parameters. No weight decay: a short
    adaptation, nothing to regularise towards zero."""
    opt = build_optimizers(model, lr, weight_decay=0.0, table_lr_mult=table_lr_mult)
    if precision == "fp16":
        opt.scaler = LossScaler()  # a step whose scaled gradient overflows is skipped
    return opt


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of a transformers LM; the loss in float32."""
    dev = model_device(model)
    logits = model(input_ids=inputs.to(dev), use_cache=False).logits  # [b, t, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.to(dev).flatten())


def default_layers(model: nn.Module) -> tuple[int, ...]:
    from ..models.hf import decoder_stack

    n = len(decoder_stack(model)[1])
    return tuple(sorted({min(1, n - 1), n // 2}))


# -- checkpoints ---------------------------------------------------------------------------------

_BOOKKEEPING = {"out_dir", "steps", "ckpt_every", "log_every", "eval_batches", "threads", "device",
                "precision", "data"}


class AdapterCheckpoints:
    """``loop.Checkpoints`` of a finetune: the Engram tensors, the optimiser state, the RNG
    and the loop's position (the frozen base is not saved; the base fingerprint says it is the
    same one)."""

    def __init__(self, out_dir: str | Path, identity: dict[str, Any], keep: int = 2):
        self.dir, self.identity, self.keep = Path(out_dir) / CHECKPOINTS, identity, keep

    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir)

    def load(self, run: Run, found: Path) -> None:
        state, meta, step = load_checkpoint(found)
        if meta.get("identity") != self.identity:
            saved = meta.get("identity") or {}
            diff = sorted(k for k in set(saved) | set(self.identity)
                          if saved.get(k) != self.identity.get(k))
            raise CheckpointError(f"checkpoint {found} was written for another finetune (differs "
                                  f"in {diff}); use another --out_dir or the same model, data and "
                                  "config")
        try:
            load_engram_state_dict(run.model, state["engram"])
            run.optim.load_state_dict(state["optim"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {found} does not fit this model: {e}") from e
        torch.set_rng_state(state["rng"])
        run.step, run.history = step, meta["history"]
        run.window = tuple(meta.get("window", (0, 0.0)))
        run.hook_state = meta.get("hook_state", {})

    def save(self, run: Run) -> Path:
        state = {"engram": engram_state_dict(run.model), "optim": run.optim.state_dict(),
                 "rng": torch.get_rng_state()}
        meta = {"identity": self.identity, "config": run.cfg.to_dict(), "history": run.history,
                "window": list(run.window), "hook_state": run.hook_state}
        return save_checkpoint(self.dir, run.step, state, meta, keep=self.keep)


class StepRecords:
    """Every step's loss and lr in run.history (kept in checkpoints, so a resumed run's records are
    the uninterrupted run's) and in OUT/metrics.jsonl."""

    def start(self, run: Run) -> None:
        self.path = Path(run.cfg.out_dir) / "metrics.jsonl"
        publish_text(self.path, "".join(json.dumps(r) + "\n" for r in run.history))

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        rec = {"step": run.step, "loss": loss, "lr": lr}
        run.history.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def end(self, run: Run) -> None:
        pass


# -- the command ---------------------------------------------------------------------------------

def check_inputs(model: str, cfg: FinetuneConfig) -> tuple[str, Corpus]:
    """(the model's recorded name, the corpus): the one-line refusals that come before any weight
    is read."""
    from .tokenizer import load_tokenizer

    name = check_model(model)
    corpus = open_corpus(cfg.data, vocab="full")  # model ids are the tokenizer's ids
    tok, _ = load_tokenizer(name)
    if tokenizer_fingerprint(tok) != corpus.tokenizer_fingerprint:
        raise UserError(f"{cfg.data} was prepared with another tokenizer than {model}'s: run "
                        f"`engram prepare --tokenizer {model} ...` for it")
    if len(corpus.streams["train"]) <= cfg.seq_len:
        raise UserError(f"{cfg.data} holds {len(corpus.streams['train'])} training tokens, too few "
                        f"for seq_len={cfg.seq_len}")
    return name, corpus


@torch.no_grad()
def held_out_loss(model: nn.Module, corpus: Corpus, cfg: FinetuneConfig) -> float:
    """Mean next-token loss over ``eval_batches`` batches spread over the validation split."""
    model.eval()
    total, n = 0.0, 0
    dev = model_device(model)
    for b in val_batches(corpus.streams["val"], cfg.batch_size, cfg.seq_len, corpus,
                         max_batches=cfg.eval_batches):
        with autocast(cfg.precision, dev):
            total += float(lm_loss(model, b.inputs, b.targets)) * b.targets.numel()
        n += b.targets.numel()
    return total / max(n, 1)


def finetune(model: str, cfg: FinetuneConfig, progress: bool = True,
             resume: bool = True) -> dict[str, Any]:
    """Train the memory of ``model`` (a packaged name or a folder) on ``cfg.data``; write the
    adapter into cfg.out_dir. Returns the summary written to finetune.json."""
    device = resolve(cfg.device, cfg.precision)  # this machine can run it: before any work
    name, corpus = check_inputs(model, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    hf, _ = load_pretrained(name, tokenizer=False)
    hf.to(device).eval()  # no dropout: the memory trains a deterministic function
    for p in hf.parameters():
        p.requires_grad_(False)
    base = base_fingerprint(hf)
    layers = cfg.layers or default_layers(hf)
    ecfg = memory_config(list(layers), corpus.eos_id, cfg.seed, cfg.table_size, cfg.max_ngram_size,
                         cfg.n_head_per_ngram, cfg.n_embed_per_ngram)
    params = attach_memory(hf, ecfg, corpus.compression(), cfg.table_init_std, cfg.precision,
                           cfg.seed)
    opt = memory_optimizers(hf, cfg.lr, cfg.table_lr_mult, cfg.precision)
    batches = TokenBatches(corpus.streams["train"], cfg.batch_size, cfg.seq_len, corpus,
                           seed=cfg.seed)
    run = Run(cfg, corpus, None, hf, batches, opt,
              loss=lambda module, b: lm_loss(module, b.inputs, b.targets))
    identity = {**{k: v for k, v in cfg.to_dict().items() if k not in _BOOKKEEPING},
                "model": name, "base": base, "data": corpus.fingerprint,
                "tokenizer": corpus.tokenizer_fingerprint, "layers": list(layers)}
    identity = json.loads(json.dumps(identity))  # as a checkpoint's meta reads back
    checkpoints = AdapterCheckpoints(cfg.out_dir, identity)
    restore(run, checkpoints, resume)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "base_val_loss" not in run.hook_state:  # the model is the base model before step 1
        run.hook_state["base_val_loss"] = held_out_loss(hf, corpus, cfg)
    start, t0, c0 = run.step, time.perf_counter(), time.process_time()
    fit(run, [LossCurve("finetune", progress, cfg.log_every), StepRecords(),
              SaveCheckpoints(checkpoints, cfg.ckpt_every)])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    val = held_out_loss(hf, corpus, cfg)
    save_engram(hf, out, base_model=name, tokenizer=corpus.tokenizer(), eos_id=corpus.eos_id,
                base=base)
    rt = engram_runtime(hf)
    n_table = sum(e.table.weight.numel() for e in rt.engrams.values())
    trained = run.step - start
    summary = {
        "model": name, "data": str(Path(cfg.data).resolve()), "layers": list(layers),
        "steps": run.step,
        "base_val_loss": run.hook_state["base_val_loss"], "val_loss": val,
        "val_gain": val - run.hook_state["base_val_loss"],
        "trainable_params": sum(p.numel() for p in params), "table_params": n_table,
        "train_seconds": seconds, "train_cpu_seconds": cpu,
        "tokens_per_second": trained * cfg.batch_size * cfg.seq_len / seconds if trained else None,
        "config": cfg.to_dict()}
    publish_text(out / SUMMARY, json.dumps(summary, indent=2))
    return summary


__all__ = ["ADAPTER_KIND", "AdapterCheckpoints", "FinetuneConfig", "attach_memory", "check_inputs",
           "default_layers", "finetune", "held_out_loss", "lm_loss", "memory_config",
           "memory_optimizers"]
