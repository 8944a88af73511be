"""One runtime for a trained model: ``engram.open(path)`` and every front door runs it the same way.

``open_model`` opens a run folder (``engram train --out_dir``: its newest checkpoint and its
``model/`` files, artifacts/run.py), an ``engram export-hf`` folder, or a run with a
DeepSeek-V4.1 layer set in place of its Engram layers, with nothing else present: no training data,
no corpus re-hash, and nothing written. What it returns holds the model, the hasher, the
vocabulary map, the tokenizer and the policies, and the few operations every entry point needs:

    forward(raw, group)              prepare (on the CPU: model ids, hash ids; row ids come from
                                     token ids alone, paper 2.2), then run (move to the device,
                                     announce rows to the tables (prefetch), unseen ids -> the
                                     mean input embedding, autocast, the model); a caller that
                                     times the step alone (pool-budget) calls the two itself
    score(stream) / score_documents  next-token NLL over windows (``engram eval``, lm-eval)
    new_group(rows)                  a KV / conv cache and n-gram history for decoding;
                                     serving/generate.py's ``Generator(runtime)`` decodes batches
    fit_prompts(prompts, max_new)    the context check every front door shares

Front doors keep only what is truly theirs: transformers' cache object and padding
(serving/hf_model.py), vLLM's paged attention and flat batch (serving/paged.py), lm-eval's request
types (studies/harness.py), the command line's text (cli/serving.py).

Tokens a run never saw (one policy, everywhere): as inputs they read as the mean of the trained
input embeddings (no new parameter) and the hasher reads their raw ids as it reads every id, so
Engram still looks up their n-grams; a request that holds them is warned about once. As targets
they have no probability: logits over the tokenizer's ids are -inf there, and scoring leaves them
out (counted).

Shape legend: b rows, t positions, n tokens of a stream, d model width, V model vocabulary,
W tokenizer vocabulary, H hash heads of a layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..models.cache import DecodeGroup
from ..models.model import EngramLM, ModelOutput
from ..models.precision import autocast, model_device, resolve
from ..models.vocab import VocabMap, unknown_inputs
from ..retrieval.hashing import Hasher
from ..tables.cache import CacheStats
from ..tables.prefetch import prefetch_batch

IGNORE = -100  # target id left out of the loss (torch's cross-entropy convention)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=4)


@dataclass(frozen=True)
class Prepared:
    """One forward's inputs, made on the CPU from raw ids (``Runtime.prepare``)."""

    local: torch.Tensor  # [b, t] model ids (unseen ids at 0)
    unknown: torch.Tensor  # [b, t] bool: ids the run never saw
    ids: dict[int, torch.Tensor] | None  # {layer: [b, t, H]} hash ids; None without Engram


@dataclass
class Runtime:
    """A trained model ready to serve (``engram.open(path)``): model, hasher, vocabulary map,
    tokenizer and tables on a tier, with the operations every front door shares (``forward``,
    ``score``, ``encode`` / ``decode``, ``new_group``, ``fit_prompts``; see the module docstring)."""

    model: EngramLM
    hasher: Hasher | None  # None for a model without Engram
    ids: VocabMap  # raw (tokenizer) ids <-> the model's ids
    tokenizer: Any = None  # tokenizers.Tokenizer the model was trained with (None: ids only)
    eos_id: int | None = None  # the token that ends every training document
    source: Path | None = None  # the folder it was opened from
    checkpoint: str = ""  # the checkpoint's name (a run's file, an export's tag)
    tier: str = "memory"
    tables: dict[int, Any] = field(default_factory=dict)  # stores from a tier, by layer
    row_counts: dict[int, dict[str, torch.Tensor]] | None = None  # reads on the training text
    precision: str = "fp32"  # forwards under autocast in this precision
    tokenizer_file: Path | None = None
    checkpoint_file: Path | None = None  # a run's checkpoint file (None for an export)
    on_unseen: Callable[[str], None] = _warn  # how a request with unseen ids is told

    @classmethod
    def from_parts(cls, model: EngramLM, hasher: Hasher | None, vocab: Any = None,
                   raw_vocab_size: int | None = None, **kw: Any) -> Runtime:
        """A runtime over a model in hand; ``vocab`` [V] model id -> raw id (None: the identity)."""
        if model.config.engram is not None and hasher is None:
            raise ValueError("this model has Engram layers: pass the hasher it was trained with")
        if vocab is None:
            vocab = torch.arange(model.config.vocab_size)
        vocab = torch.as_tensor(np.asarray(vocab), dtype=torch.long)
        if vocab.numel() != model.config.vocab_size:
            raise ValueError(f"vocab maps {vocab.numel()} ids, the model has "
                             f"{model.config.vocab_size}")
        size = raw_vocab_size if raw_vocab_size is not None else int(vocab.max()) + 1
        return cls(model, hasher, VocabMap(vocab, size), **kw)

    # -- what front doors read ---------------------------------------------------------------------
    @property
    def vocab(self) -> np.ndarray:
        """[V] model id -> raw id (sorted)."""
        return self.ids.vocab.numpy()

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    def to(self, device: str | torch.device) -> Runtime:
        self.model.to(resolve(str(device), self.precision))
        return self

    def cache_stats(self) -> dict[str, Any] | None:
        """Hot-cache lookups and hit rate over every cached table part (None: no cache)."""
        stats = [t.stats for t in _stores(self.tables)
                 if isinstance(getattr(t, "stats", None), CacheStats)]
        if not stats:
            return None
        lookups, hits = sum(s.lookups for s in stats), sum(s.hits for s in stats)
        return {"lookups": lookups, "hits": hits, "hit_rate": hits / lookups if lookups else 0.0}

    # -- the one hash-then-step --------------------------------------------------------------------
    def forward(self, raw: torch.Tensor, group: DecodeGroup | None = None, *, warn: bool = True,
                announce: bool = True, gates: bool = False) -> ModelOutput:
        """Raw ids [b, t] (CPU) -> the model's output (hidden [b, t, d]); with ``group``,
        continuing its decode. ``prepare`` then ``run`` (see both)."""
        return self.run(self.prepare(raw, group, warn=warn), group, announce=announce, gates=gates)

    def prepare(self, raw: torch.Tensor, group: DecodeGroup | None = None, *,
                warn: bool = True) -> Prepared:
        """The CPU side of a forward, before the step (the engine's side): raw ids [b, t] -> model
        ids and the hash ids (row ids from token ids alone, paper 2.2; with ``group``, its n-gram
        history continues)."""
        raw = torch.as_tensor(raw).long().cpu()
        local, unknown = self.local_ids(raw, warn)  # [b, t]
        ids = None
        if self.hasher is not None:
            ids = self.hasher.hash(raw) if group is None else group.stream.step(raw)  # [b, t, H]
        return Prepared(local, unknown, ids)

    def run(self, x: Prepared, group: DecodeGroup | None = None, *, announce: bool = True,
            gates: bool = False) -> ModelOutput:
        """The step: ``x``'s inputs to the model's device, the rows announced to the tables first
        (``announce``: a prefetching tier starts gathering them), the model under autocast, with
        ``group``'s cache; ``gates``: the output keeps each Engram layer's gate (analyze)."""
        dev = self.device
        ids = None
        if x.ids is not None:
            ids = {k: v.to(dev) for k, v in x.ids.items()}
            if announce:
                prefetch_batch(self.model, ids)  # a prefetching tier starts gathering now
        extra = {"return_gates": True} if gates else {}
        with unknown_inputs(self.model, x.unknown), autocast(self.precision, dev):
            return self.model(x.local.to(dev), ids, cache=None if group is None else group.cache,
                              **extra)

    def local_ids(self, raw: torch.Tensor, warn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ids [...] -> (model ids [...] with unseen ones at 0, the unseen mask [...]), on
        raw's device; ``warn``: the policy's one warning when the request holds unseen ids."""
        local = self.ids.to_local(raw)
        unknown = local < 0
        if warn and bool(unknown.any()):
            ids = sorted(set(raw.cpu()[unknown].tolist()))[:10]
            self.on_unseen(f"token ids {ids} never occurred in training: they read as the mean "
                           "input embedding")
        return local.clamp_min(0).to(raw.device), unknown.to(raw.device)

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits over the tokenizer's ids [..., W] (-inf where unseen)."""
        return self.ids.scatter(self.model.logits(hidden).float())

    def new_group(self, rows: Any, max_len: int | None = None) -> DecodeGroup:
        """A ``DecodeGroup`` for ``rows`` (a list or tensor of the caller's row indices)."""
        n = len(rows)
        return DecodeGroup(rows, self.model.new_cache(n, max_len),
                           None if self.hasher is None else self.hasher.stream(n))

    # -- requests ----------------------------------------------------------------------------------
    def fit_prompts(self, prompts: list[list[int]], max_new_tokens: int,
                    cut: bool = False, say: Callable[[str], None] | None = None
                    ) -> list[list[int]]:
        """Each prompt fits the context with ``max_new_tokens`` after it, or a UserError naming the
        lengths; with ``cut`` a prompt too long loses its oldest tokens (``say`` is told how
        many)."""
        n = self.max_seq_len
        if any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        # The last new token is never fed back, so a row uses len(prompt) + max_new - 1 positions.
        room = n - max(0, max_new_tokens - 1)
        if room < 1:
            raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt: the "
                            f"model's context is max_seq_len={n} positions (prompt + new tokens "
                            f"- 1); ask for at most {n} new tokens")
        out = []
        for p in prompts:
            if len(p) > room:
                if not cut:
                    raise UserError(f"a prompt of {len(p)} tokens with max_new_tokens="
                                    f"{max_new_tokens} needs {len(p) + max_new_tokens - 1} "
                                    f"positions; the model has max_seq_len={n}")
                if say is not None:
                    say(f"keeping the last {room} of {len(p)} prompt tokens (max_seq_len={n}, "
                        f"max_new_tokens={max_new_tokens})")
                p = p[-room:]
            out.append(list(p))
        return out

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- scoring -----------------------------------------------------------------------------------
    def score(self, raw: np.ndarray, seq_len: int, batch_size: int = 16,
              progress: bool = False) -> dict[str, Any]:
        """Next-token loss on the raw-id stream [n] in consecutive windows of ``seq_len``; unseen
        ids are context only (left out as targets, counted)."""
        raw = np.asarray(raw, dtype=np.int64)
        if len(raw) < 2:
            raise UserError("need at least two tokens to score")
        plan = [(0, s, t, t) for s, t in windows(len(raw), seq_len)]
        (total,), (scored,) = self.score_windows([raw], plan, seq_len, batch_size,
                                                 per_row=False, progress=progress)
        targets = len(raw) - 1
        unseen = self.ids.to_local(raw) < 0
        return {"loss": total / max(scored, 1), "tokens": int(len(raw)), "targets": targets,
                "scored": scored, "left_out": targets - scored,
                "left_out_fraction": (targets - scored) / targets,
                "unseen_positions": int(unseen.sum()),
                "unseen_ids": int(len(np.unique(raw[unseen])))}

    def score_documents(self, docs: list[list[int]], start_id: int, seq_len: int,
                        batch_size: int = 16) -> list[dict[str, Any]]:
        """Each document (raw ids, no EOS) scored alone as ``[start_id] + doc`` in rolling windows
        (lm-evaluation-harness's loglikelihood_rolling): per document the log-likelihood in nats of
        its scored tokens, unseen ids context only, as in ``score``."""
        streams = [np.asarray([start_id, *d], dtype=np.int64) for d in docs]
        plan = sorted(((i, *w) for i, s in enumerate(streams)
                       for w in rolling_windows(len(s), seq_len)), key=lambda w: w[2])
        total, scored = self.score_windows(streams, plan, seq_len, batch_size, per_row=True)
        return [{"loglikelihood": -total[i], "targets": len(d), "scored": scored[i]}
                for i, d in enumerate(docs)]

    @torch.no_grad()
    def score_windows(self, streams: list[np.ndarray], plan: list[tuple[int, int, int, int]],
               seq_len: int, batch_size: int, per_row: bool, progress: bool = False,
               greedy: list[bool] | None = None) -> tuple[list[float], list[int]]:
        """Summed NLL and scored targets per stream over ``plan``'s windows (stream, start, length
        t, scored k): inputs ``stream[start:start + t]``, the last k targets count. Windows of one
        length run as one batch shape; ``per_row`` sums each window in float64 (per document),
        else each batch in float32 (a stream's loss, as it has always been summed). ``greedy``
        (one flag per stream) is cleared where a scored target is not the model's argmax."""
        from tqdm.auto import tqdm

        if seq_len > self.max_seq_len:
            raise UserError(f"seq_len={seq_len} exceeds the model's max_seq_len={self.max_seq_len}")
        locs = [self.ids.to_local(s) for s in streams]
        groups: dict[int, list[tuple[int, int, int, int]]] = {}
        for w in plan:
            groups.setdefault(w[2], []).append(w)
        total, scored = [0.0] * len(streams), [0] * len(streams)
        self.model.eval()
        bar = tqdm(total=len(plan), disable=not progress, desc="eval windows")
        for t, wins in groups.items():
            for a in range(0, len(wins), batch_size):
                batch = wins[a:a + batch_size]
                x = torch.stack([torch.from_numpy(streams[i][s:s + t]) for i, s, _, _ in batch])
                y = torch.stack([torch.from_numpy(locs[i][s + 1:s + t + 1])
                                 for i, s, _, _ in batch])  # [b, t]
                keep = torch.arange(t)[None, :] >= torch.tensor([t - k for *_, k in batch])[:, None]
                y = torch.where((y < 0) | ~keep, IGNORE, y)
                out = self.forward(x, warn=False)
                nll = self.token_nll(out, y).cpu()  # [b, t]
                if greedy is not None:
                    hit = (self.model.logits(out.hidden).argmax(-1).cpu() == y) | (y == IGNORE)
                    for j, (i, *_) in enumerate(batch):
                        greedy[i] = greedy[i] and bool(hit[j].all())
                if not per_row:
                    total[batch[0][0]] += float(nll.sum())
                for j, (i, *_) in enumerate(batch):
                    total[i] += float(nll[j].double().sum()) if per_row else 0.0
                    scored[i] += int((y[j] != IGNORE).sum())
                bar.update(len(batch))
        bar.close()
        return total, scored

    def token_nll(self, out: ModelOutput, targets: torch.Tensor) -> torch.Tensor:
        """NLL [b, t] of model-id targets (IGNORE: 0) under an output of ``forward``."""
        with autocast(self.precision, self.device):
            return self.model.token_nll(out, targets.to(self.device), ignore_index=IGNORE)


def windows(n: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive windows covering every target of a stream of n ids once."""
    out, s = [], 0
    while s < n - 1:
        t = min(seq_len, n - 1 - s)
        out.append((s, t))
        s += t
    return out


def rolling_windows(n: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(start, length, scored) windows over a stream of n ids that score each of its targets
    1..n-1 once: inputs ``stream[start:start + length]``, the last ``scored`` positions' targets
    count. Every window after the first sees a full ``seq_len`` of context, so the last one
    overlaps its predecessor (lm-evaluation-harness's rolling windows with context_len=1)."""
    out, done = [], 0  # targets 1..done are scored
    while done < n - 1:
        k = min(seq_len, n - 1 - done)
        start = max(0, done + k - seq_len)
        out.append((start, done + k - start, k))
        done += k
    return out


def row_spans(mask: torch.Tensor, left_only: bool) -> dict[tuple[int, int], list[int]]:
    """{(first position, length): rows} of each row's one run of 1s in mask [b, t]. With
    ``left_only`` the run must end at the last position (left padding, to continue from it)."""
    out: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(mask):
        on = torch.nonzero(row).flatten()
        if on.numel() == 0:
            if left_only:
                raise ValueError(f"row {r} is all padding: nothing to continue from")
            continue
        a, s = int(on[0]), on.numel()
        if int(on[-1]) != a + s - 1:
            raise ValueError(f"row {r}'s attention_mask has holes: pad on one side only")
        if left_only and a + s != mask.shape[1]:
            raise ValueError(f"row {r} is padded on the right: generation needs left padding "
                             "(tokenizer.padding_side = 'left')")
        out.setdefault((a, s), []).append(r)
    return out


def _stores(tables: dict[int, Any]) -> list[Any]:
    """Every distinct store under a model's tier tables (cached parts of hot+cold sets too)."""
    seen: dict[int, Any] = {}
    todo = list(tables.values())
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen[id(t)] = t
        todo += [getattr(t, a) for a in ("inner", "hot", "cold")  # cache/prefetch, Nine
                 if getattr(t, a, None) is not None and not isinstance(getattr(t, a), torch.Tensor)]
    return list(seen.values())
