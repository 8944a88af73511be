"""A training run's options: one flat dataclass (``engram train --key=value``, config files,
RUN/config.json) and what they build (the model's config, the hasher, the data's config); the
run itself is built in train.py from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..models.model import ModelConfig
from ..models.precision import PRECISIONS, check_names
from ..ranges import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Range, check_ranges
from ..retrieval.compress import Compression, build_compression
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from . import tier_attach
from .corpus import DataConfig
from .optim import check_table_optimizer


@dataclass
class TrainConfig:
    out_dir: str = "runs/engram"  # checkpoints, metrics.jsonl, config.json
    seed: int = 0  # model init and batch order
    # -- data --
    sources: tuple[str, ...] = field(default=("kjv", "peoples-daily"),
                                    metadata={"choices": "engram.training.corpus:SOURCES"})
    max_chars: int | None = None  # per source; None = all the text
    val_fraction: float = 0.05
    # A folder written by `engram prepare` (replaces sources, max_chars and val_fraction).
    data: str | None = None
    # Output ids: "corpus" (those the data uses) or "full" (the whole tokenizer: any text scores).
    vocab: str = field(default="corpus", metadata={"choices": ("corpus", "full")})
    # -- backbone --
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int | None = None  # None: SwiGLU default (~8/3 d)
    seq_len: int = 128
    # "full" softmax or "adaptive" (exact; ~4x faster training on CPU)
    head: str = field(default="adaptive", metadata={"choices": ("full", "adaptive")})
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
    # None: the profile's default
    engram_gate: str | None = field(default=None, metadata={"choices": "engram.module.gate:GATES"})
    # "demo-v1", or "v4.1": DeepSeek-V4.1's layout (one table size for all orders, global row ids,
    # fused bias-free keys, no short conv); its layers import and export as a V4.1 checkpoint's.
    engram_profile: str = field(default="demo-v1",
                                metadata={"choices": "engram.retrieval.config:PROFILES"})
    engram_norm_eps: float | None = None  # Engram gate norms' eps; None: the profile's (v4.1 1e-6)
    engram_conv: bool | None = None  # short conv on/off; None: the profile's default (on)
    engram_fixed_gate: bool = False  # ablation: gate alpha fixed at 1 (no keys)
    engram_shared_key: bool = False  # ablation: with hc_mult > 1, one key for all branches
    compress: bool = True  # tokenizer compression before hashing; False hashes raw ids (ablation)
    # -- controls for "is it the memory?" (studies/compare.py's arms; demo-v1 only) --
    # What rows are keyed on: "ngram" (the paper's), "unigram" (the current token alone) or
    # "constant" (one row per head, read at every position: capacity 1).
    engram_lookup: str = field(default="ngram",
                               metadata={"choices": "engram.retrieval.config:LOOKUPS"})
    engram_prime_sizes: bool = True  # False: each head's table exactly table_size rows
    freeze_tables: bool = False  # the tables keep their initial rows (never trained)
    engram_head_gain: bool = False  # a learned gain per hash head on the rows read (frozen-scaled)
    # Small table init: with N(0, 1) rows (the demo's nn.Embedding) the Engram residual starts ~16x
    # the token embeddings and costs the first steps; at 0.02 it starts near identity (a quick
    # A/B at step 40 of 160: val 6.248 at 0.02, 6.264 at 0.1, 6.421 at 1.0, dense 6.295).
    table_init_std: float = 0.02
    # -- Engram-Nine hot tier (arXiv 2601.16531; studies/nine.py) --
    # N_hot per n-gram order: that many most frequent training n-grams get a collision-free row.
    hot_rows: int = 0
    # "mphf" (MPHF + fingerprint) or "exact" (sorted keys, no false hits)
    hot_index: str = field(default="mphf", metadata={"choices": "engram.retrieval.hot:KINDS"})
    fingerprint_bits: int = 16  # mphf: bits per hot slot; non-members pass at ~2^-bits
    # "torch" (vectorised BBHash) or "bbhash" (the wheel; extra nine)
    mphf_engine: str = field(default="torch", metadata={"choices": "engram.retrieval.mphf:ENGINES"})
    shared_tables: bool = False  # one table set read by every Engram layer (the Nine paper)
    # -- optimisation --
    steps: int = 300
    batch_size: int = 16
    # How a batch's windows are drawn: "uniform" (anywhere in the stream) or "stratified" (window i
    # of a batch in the i-th b-th of the stream: each batch holds the sources in proportion;
    # training/batches.py).
    sampling: str = field(default="uniform",
                          metadata={"choices": "engram.training.batches:SAMPLINGS"})
    grad_accum: int = 1
    lr: float = 3e-3
    table_lr_mult: float = 5.0  # paper: tables at 5x the learning rate, no weight decay
    # The tables' optimiser: "adam" (RowAdam, the paper's: 2 moments per element, state 2x a
    # touched row), "adagrad" (row-wise Adagrad, DLRM/TorchRec) or "rmsprop" (one Adam second
    # moment per row): O(1) state per row (training/optim.py).
    table_optimizer: str = field(default="adam",
                                 metadata={"choices": "engram.training.optim:TABLE_OPTIMIZERS"})
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
    # Where to train: cpu, cuda (under torchrun each rank's own GPU), cuda:N, or auto (CUDA when
    # torch sees a GPU, else the CPU).
    device: str = "cpu"
    # fp32, or bf16 / fp16: the dense model under autocast (weights and AdamW state stay float32),
    # the Engram tables stored in it (RowAdam's state stays float32); fp16 scales the loss.
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    compile: bool = False  # torch.compile the model (first steps slower while it compiles)
    # -- tables past memory (training/tier_tables.py) --
    # "memory" (each table one parameter in RAM) or "file": rows and their optimiser state in
    # files (read and written by row id, never mapped), a step's rows read ahead and written back
    # sparse, journaled; under torchrun each rank's shard in its own folder (tier_shards.py).
    table_tier: str = field(default="memory", metadata={"choices": ("memory", "file")})
    # file tier: its folder (None: out_dir/tier; torchrun: rank-RRRRR-of-WWWWW folders in it)
    table_dir: str | None = None
    # file tier: most MB of rows in memory (None: 2 steps'; under torchrun per rank, its shard's)
    table_budget_mb: float | None = None

    def __post_init__(self) -> None:
        self.sources, self.engram_layers = tuple(self.sources), tuple(self.engram_layers)
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches",
                     "ckpt_every", "log_every", "seq_len"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup < 0:
            raise UserError("need lr > 0, 0 <= min_lr_ratio <= 1 and warmup >= 0")
        if self.hot_rows < 0:
            raise UserError(f"hot_rows must be >= 0, got {self.hot_rows}")
        check_ranges(  # every float finite, too (a NaN passes every comparison above)
            self, seed=NON_NEGATIVE, max_chars=AT_LEAST_1, val_fraction=Range(0, 1, True, True),
            n_layer=AT_LEAST_1, d_model=AT_LEAST_1, n_head=AT_LEAST_1, d_ff=AT_LEAST_1,
            head_cutoffs=AT_LEAST_1, hc_mult=AT_LEAST_1, n_routed_experts=AT_LEAST_1,
            n_shared_experts=NON_NEGATIVE, top_k=AT_LEAST_1, d_expert=AT_LEAST_1,
            engram_layers=NON_NEGATIVE, table_size=Range(2), max_ngram_size=Range(2),
            n_head_per_ngram=AT_LEAST_1, n_embed_per_ngram=AT_LEAST_1, engram_norm_eps=POSITIVE,
            table_init_std=NON_NEGATIVE, fingerprint_bits=Range(1, 32), lr=POSITIVE,
            table_lr_mult=NON_NEGATIVE, weight_decay=NON_NEGATIVE, grad_clip=POSITIVE,
            threads=AT_LEAST_1)
        if self.nine and not self.engram:
            raise UserError("hot_rows / shared_tables need engram=true")
        controls = (self.engram_lookup != "ngram" or not self.engram_prime_sizes
                    or self.freeze_tables or self.engram_head_gain)
        if controls and (self.nine or self.table_tier != "memory"):
            raise UserError("the memory controls (engram_lookup, engram_prime_sizes, "
                            "freeze_tables, engram_head_gain) train plain in-memory tables: "
                            "not with hot_rows, shared_tables or table_tier=file")
        check_names(self.device, self.precision)  # whether this machine has them: build_run
        check_table_optimizer(self.table_optimizer)
        if self.table_budget_mb is not None and not self.table_budget_mb > 0:
            raise UserError(f"table_budget_mb must be > 0, got {self.table_budget_mb}")
        tier_attach.check_tier(self)

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
            profile=self.engram_profile, lookup=self.engram_lookup,
            prime_sizes=self.engram_prime_sizes)

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
            engram_fixed_gate=self.engram_fixed_gate, engram_shared_key=self.engram_shared_key,
            engram_head_gain=self.engram_head_gain)

    def hasher(self, tokenizer: Any = None, compression: Compression | None = None
               ) -> NgramHasher | None:
        """The run's hasher; compression (``compression``, else built from ``tokenizer``) always
        maps the full tokenizer (or is the identity)."""
        ecfg = self.engram_config()
        if ecfg is None:
            return None
        comp = compression if compression is not None else build_compression(tokenizer)
        if not self.compress:  # paper table 5 "w/o tokenizer compression": raw ids are hashed
            comp = Compression(np.arange(comp.raw_vocab_size))
        return NgramHasher(ecfg, comp)

    def data_config(self) -> DataConfig:
        return DataConfig(sources=self.sources, max_chars=self.max_chars,
                          val_fraction=self.val_fraction, data=self.data, vocab=self.vocab)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any], source: str | Path) -> TrainConfig:
        """The options a run recorded (its config.json, a checkpoint's meta) as a TrainConfig: the
        one reader of them (issue 48: four readers, two of which disagreed). torchrun's records
        (RUN_RECORDS) are passed over; an option this engram does not know is refused in one line,
        not dropped: it may have changed what was trained."""
        from ..artifacts import RUN_RECORDS

        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - names - set(RUN_RECORDS))
        if unknown:
            raise UserError(f"{source} records options this engram does not know "
                            f"({', '.join(unknown)}): it was written by another version of engram "
                            "(use that version to read it)")
        # JSON keeps a tuple as a list: read back, a field is what the run was built with
        tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples and isinstance(v, list) else v
                      for k, v in record.items() if k in names})


def saved_config(run_dir: str | Path) -> TrainConfig:
    """The options run folder ``run_dir`` was trained with (RUN/config.json)."""
    from ..artifacts.run import CONFIG

    path = Path(run_dir) / CONFIG
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir}: {CONFIG} is missing (the options the run was trained with): "
                        "copy the run back from a copy") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {e}): copy the run back "
                        "from a copy") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is not a run's options (a JSON object): copy the run back "
                        "from a copy")
    return TrainConfig.from_record(record, path)
