"""Generation: batched incremental decoding with the KV cache, n-gram history and Engram conv state.

Each step feeds only the new token: attention reads the KV cache (``DecodeCache``), the hasher's
stream keeps the last N-1 tokens so the new position's n-grams match the full sequence's, and each
Engram layer's short conv continues from its saved context (``EngramState``). Greedy output equals
recomputing the whole sequence every step (tested). Tables may sit on any tier; rows are announced
to the tables (``prefetch``) before each forward.

Prompts of different lengths: the reference model has no padding mask, so rather than left-pad
(padding keys would leak into attention and into the Engram conv), rows are grouped by length.
The shortest group starts first; when its position reaches the next group's prompt length, that
group is prefilled and the two caches are concatenated into one batch, and so on. From then on all
rows decode together. Finished rows (length budget or a stop id) are dropped from the batch.

Shape legend: b rows, g rows of one group, L a prompt length, V model vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..models.cache import DecodeGroup
from ..models.model import EngramLM
from ..models.precision import (
    PRECISIONS,
    autocast,
    check_names,
    check_precision,
    model_device,
    resolve,
)
from ..ranges import check_ranges
from ..retrieval.hashing import Hasher
from .runtime import Runtime, row_spans


@dataclass
class GenerationConfig:
    """How ``Generator`` decodes: new tokens, temperature, top-k, stop ids, seed
    (the options of ``engram generate``)."""

    # New tokens per row (a row stops earlier at a stop id).
    max_new_tokens: int = 32
    # 0: greedy (argmax); > 0: sample from softmax(logits / temperature).
    temperature: float = 0.0
    # Sample only among the k most likely tokens (None: all).
    top_k: int | None = None
    # Raw token ids that end a row (kept in its output), e.g. the EOS id.
    stop_ids: tuple[int, ...] = ()
    # Seed of the sampler (greedy ignores it).
    seed: int = 0
    # Announce each batch's rows to the tables before the forward (lets a PrefetchTable overlap).
    prefetch: bool = True
    # Where the model runs: cpu, cuda, cuda:N or auto; None: where it already is (the CPU for
    # `engram generate`). Device and precision belong to the runtime (``engram.open``'s): a
    # Generator on a Runtime takes them from it and refuses a different one; on a model given as
    # parts its own runtime takes them from here.
    device: str | None = None
    # fp32, or bf16 / fp16: each forward under autocast (weights stay as loaded, e.g. a bf16
    # run's tables in float32); None: the runtime's (fp32 for a model given as parts).
    precision: str | None = field(default=None, metadata={"choices": PRECISIONS})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1 or None, got {self.top_k}")
        self.stop_ids = tuple(int(i) for i in self.stop_ids)
        check_ranges(self)  # temperature nan / inf: a NaN passes every comparison above
        check_names(self.device or "cpu", self.precision or "fp32")


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # per row: the new raw token ids
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class Generator:
    """Decode a batch of prompts on a ``Runtime``; prompts and outputs
    are raw tokenizer ids. ``Generator(model, hasher, vocab, config)`` builds the runtime from
    parts (``vocab`` [V] maps the model's ids to raw ids; None: the model reads raw ids)."""

    def __init__(self, model: Runtime | EngramLM, hasher: Hasher | None = None, vocab: Any = None,
                 config: GenerationConfig | None = None):
        cfg = self.config = config or GenerationConfig()
        if isinstance(model, Runtime):  # its settings are its own (house style 19): checked
            rt = model
            if cfg.precision is not None and cfg.precision != rt.precision:
                raise UserError(f"GenerationConfig(precision={cfg.precision!r}) but the runtime "
                                f"runs in {rt.precision!r}: precision belongs to the runtime "
                                "(engram.open(path, precision=...)); leave it None here")
            if cfg.device is not None and resolve(cfg.device, rt.precision) != rt.device:
                raise UserError(f"GenerationConfig(device={cfg.device!r}) but the runtime's model "
                                f"is on {rt.device}: the device belongs to the runtime "
                                "(engram.open(path, device=...)); leave it None here")
        else:  # this Generator's own runtime, set up from the config
            rt = Runtime.from_parts(model, hasher, vocab)
            rt.precision = cfg.precision or "fp32"
            if cfg.device is not None:
                rt.to(cfg.device)
        check_precision(rt.precision, rt.device)
        self.runtime, self.model, self.hasher = rt, rt.model, rt.hasher

    # -- decoding ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Any, attention_mask: Any = None) -> GenerationOutput:
        """``prompts``: a list of raw-id lists, or a left-padded tensor [b, t] with its mask."""
        seqs = _prompt_lists(prompts, attention_mask)
        cfg = self.config
        out = GenerationOutput([[] for _ in seqs])
        if cfg.max_new_tokens == 0 or not seqs:
            return out
        seqs = self.runtime.fit_prompts(seqs, cfg.max_new_tokens)  # or a UserError naming why
        max_len = max(map(len, seqs)) + cfg.max_new_tokens - 1
        self._rng = torch.Generator().manual_seed(cfg.seed)
        self.model.eval()
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_len.setdefault(len(s), []).append(i)
        active: DecodeGroup | None = None
        for length in sorted(by_len):
            while active is not None and active.cache.pos < length:
                active = self._step(active, out)
            rows = by_len[length]
            raw = torch.tensor([seqs[i] for i in rows], dtype=torch.long)  # [g, L]
            t0 = time.perf_counter()
            group = self.runtime.new_group(rows, max_len)
            group.pending = self._choose(self._forward(group, raw, warn=True))
            out.prefill_s += time.perf_counter() - t0
            out.prefill_tokens += raw.numel()
            group = self._record(group, out)
            active = _merge(active, group)
        while active is not None:
            active = self._step(active, out)
        return out

    def _forward(self, group: DecodeGroup, raw: torch.Tensor, warn: bool = False) -> torch.Tensor:
        """Feed raw ids [g, s] (CPU) at the group's position; logits of the last one [g, V]."""
        out = self.runtime.forward(raw, group, warn=warn, announce=self.config.prefetch)
        with autocast(self.runtime.precision, model_device(self.model)):
            return self.model.logits(out.hidden[:, -1])  # [g, V]: only the last position is sampled

    def _step(self, group: DecodeGroup, out: GenerationOutput) -> DecodeGroup | None:
        t0 = time.perf_counter()
        logits = self._forward(group, self.runtime.ids.to_raw(group.pending)[:, None])
        group.pending = self._choose(logits)
        out.decode_s += time.perf_counter() - t0
        out.decode_tokens += len(group.rows)
        return self._record(group, out)

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Next model ids [g] (CPU) from logits [g, V]."""
        cfg = self.config
        if cfg.temperature == 0:
            return logits.argmax(-1).cpu()
        logits = logits.float() / cfg.temperature
        if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
            kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1).cpu(), 1, generator=self._rng)[:, 0]

    def _record(self, group: DecodeGroup, out: GenerationOutput) -> DecodeGroup | None:
        """Append the pending tokens; drop rows that are done. None when no row is left."""
        raw = self.runtime.ids.to_raw(group.pending).tolist()
        keep = []
        for j, (i, tok) in enumerate(zip(group.rows, raw)):
            out.tokens[i].append(tok)
            if len(out.tokens[i]) < self.config.max_new_tokens and tok not in self.config.stop_ids:
                keep.append(j)
        if not keep:
            return None
        if len(keep) < len(group.rows):
            index = torch.tensor(keep)
            group.keep(index)
            group.rows = [group.rows[j] for j in keep]
            group.pending = group.pending[index]
        return group


def _merge(a: DecodeGroup | None, b: DecodeGroup | None) -> DecodeGroup | None:
    """One group of both (same position): caches, n-gram histories and pending tokens stacked."""
    if a is None or b is None:
        return a or b
    assert a.cache.pos == b.cache.pos, "groups merge only at the same position"
    cache = a.cache.cat(b.cache)  # DecodeCache, or an adapter's InjectedCache
    stream = None
    if a.stream is not None:
        stream = a.stream.hasher.stream(len(a.rows) + len(b.rows))
        stream.history = torch.cat([a.stream.history, b.stream.history])  # [g, N-1]
    return DecodeGroup(a.rows + b.rows, cache, stream, torch.cat([a.pending, b.pending]))


def _prompt_lists(prompts: Any, attention_mask: Any) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) or isinstance(prompts, np.ndarray):
        x = torch.as_tensor(prompts)
        if x.dim() != 2:
            raise ValueError(f"prompts must be [batch, seq], got {tuple(x.shape)}")
        mask = torch.ones_like(x, dtype=torch.bool) if attention_mask is None else \
            torch.as_tensor(attention_mask).bool()
        if mask.shape != x.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} != prompts {tuple(x.shape)}")
        seqs: list[list[int]] = [[] for _ in range(len(x))]
        for (a, s), rows in row_spans(mask, left_only=True).items():  # or a ValueError naming why
            for r in rows:
                seqs[r] = x[r, a:a + s].tolist()
        return seqs
    if attention_mask is not None:
        raise ValueError("attention_mask goes with a padded tensor of prompts, not lists")
    return [list(map(int, p)) for p in prompts]
