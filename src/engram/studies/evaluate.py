"""`engram eval RUN_DIR --text FILE | --source NAME | --data DIR`: a trained run's loss on any text.

A run's output layer covers only the ids of its training corpus (its restricted vocabulary), so text
from elsewhere holds tokens it has never seen. Those tokens stay in the input as context: their
input embedding is the mean of the trained input embeddings (an unknown-token input; no new
parameter), and the hasher reads their raw ids as it reads every id, so Engram still looks up their
n-grams. They are left out as targets (the model cannot assign them probability), and counted.

Shape legend:
    n tokens in the stream, b windows per batch, t positions per window, d model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..outputs import read_text, write_json
from ..ranges import AT_LEAST_1, check_ranges
from ..serving.vocab import unknown_inputs
from ..training.precision import (
    PRECISIONS,
    autocast,
    check_names,
    model_device,
    resolve,
)

IGNORE = -100  # target id left out of the loss (torch's cross-entropy convention)


@dataclass
class EvalConfig:
    text: str | None = None  # a UTF-8 text file; paragraphs (blank-line separated) are documents
    # or a corpus source by name
    source: str | None = field(default=None, metadata={"choices": "engram.training.corpus:SOURCES"})
    data: str | None = None  # or a folder written by `engram prepare`: its held-out documents
    max_chars: int | None = None  # keep the first max_chars characters (None: all)
    batch_size: int = 16  # windows per forward pass
    seq_len: int | None = None  # window length; None: the run's training length
    json: str | None = None  # also write the result here
    # Also score each document alone, after EOS (lm-evaluation-harness's rolling log-likelihood):
    # per-document log-likelihoods in nats under "per_document" (`engram lm-eval` gives the same).
    per_document: bool = False
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:N or auto
    # fp32, or bf16 / fp16: the forward under autocast (a bf16 run's checkpoint loads either way)
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})

    def __post_init__(self) -> None:
        check_ranges(self, max_chars=AT_LEAST_1, batch_size=AT_LEAST_1, seq_len=AT_LEAST_1)
        check_names(self.device, self.precision)


def read_documents(ec: EvalConfig) -> list[str]:
    """The text to score as documents, from ``text`` or ``source`` (``data`` is read as tokens)."""
    if sum(x is not None for x in (ec.text, ec.source, ec.data)) != 1:
        raise UserError("give exactly one of --text FILE, --source NAME or --data DIR")
    if ec.source is not None:
        from ..training.corpus import load_documents

        return [d.text for d in load_documents(ec.source, ec.max_chars)]
    path = Path(ec.text)
    text = read_text(path, "--text")[:ec.max_chars]  # a binary file is refused, not scored
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not docs:
        raise UserError(f"--text {path} holds no text")
    return docs


def encode(tokenizer: Any, docs: list[str], eos_id: int) -> np.ndarray:
    """Documents -> one raw-id stream [n], each document followed by EOS (as the corpus does)."""
    encs = tokenizer.encode_batch(docs, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos_id], dtype=np.int64) for e in encs])


def held_out(folder: str, tokenizer: Any) -> tuple[np.ndarray, int]:
    """The validation stream [n] (raw ids, int64) of a prepared folder and its document count; the
    folder must have been tokenised as the run was."""
    from ..retrieval.compress import tokenizer_fingerprint
    from ..training.corpus import open_corpus
    from ..training.shards import DataError

    corpus = open_corpus(folder)
    if corpus.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
        raise DataError(f"--data {folder} was tokenised with another tokenizer than the run's: "
                        "prepare it with the run's --tokenizer")
    return np.asarray(corpus.val, dtype=np.int64), corpus.manifest["stats"]["total"]["val"]["docs"]


def local_ids(raw: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """Raw ids [n] -> the model's ids [n], -1 where the run never saw the id."""
    pos = np.searchsorted(vocab, raw).clip(0, len(vocab) - 1)  # vocab is sorted
    return np.where(vocab[pos] == raw, pos, -1)


def windows(n: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive windows covering every target of a stream of n ids once."""
    out, s = [], 0
    while s < n - 1:
        t = min(seq_len, n - 1 - s)
        out.append((s, t))
        s += t
    return out


@torch.no_grad()
def score_stream(model: torch.nn.Module, hasher: Any, vocab: np.ndarray, raw: np.ndarray,
                 seq_len: int, batch_size: int = 16, progress: bool = False,
                 precision: str = "fp32") -> dict[str, Any]:
    """Next-token loss of ``model`` (on any device; forwards under ``precision``'s autocast) on
    the raw-id stream [n]; unseen ids are context only."""
    from tqdm.auto import tqdm

    if len(raw) < 2:
        raise UserError("need at least two tokens to score")
    loc = local_ids(raw, vocab)  # [n]
    spans = windows(len(raw), seq_len)
    groups: dict[int, list[int]] = {}  # window length -> starts: one batch shape per length
    for s, t in spans:
        groups.setdefault(t, []).append(s)
    total, scored = 0.0, 0
    model.eval()
    dev = model_device(model)
    bar = tqdm(total=len(spans), disable=not progress, desc="eval windows")
    for t, starts in groups.items():
        for i in range(0, len(starts), batch_size):
            idx = np.asarray(starts[i:i + batch_size])[:, None] + np.arange(t + 1)  # [b, t+1]
            x_raw = torch.from_numpy(raw[idx[:, :-1]])  # [b, t]
            x_loc = torch.from_numpy(loc[idx[:, :-1]])  # [b, t]
            y = torch.from_numpy(loc[idx[:, 1:]])  # [b, t]
            y = torch.where(y < 0, IGNORE, y)
            ids = hasher.hash(x_raw) if hasher is not None else None
            if dev.type != "cpu":  # hashed on the CPU, from token ids, as in training
                x_loc, y = x_loc.to(dev), y.to(dev)
                ids = None if ids is None else {k: v.to(dev) for k, v in ids.items()}
            with unknown_inputs(model, x_loc < 0), autocast(precision, dev):
                out = model(x_loc.clamp_min(0), ids)
                total += float(model.token_nll(out, y, ignore_index=IGNORE).sum())
            scored += int((y != IGNORE).sum())
            bar.update(len(idx))
    bar.close()
    targets = len(raw) - 1
    unseen = loc < 0
    return {"loss": total / max(scored, 1), "tokens": int(len(raw)), "targets": targets,
            "scored": scored, "left_out": targets - scored,
            "left_out_fraction": (targets - scored) / targets,
            "unseen_positions": int(unseen.sum()), "unseen_ids": int(len(np.unique(raw[unseen])))}


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


@torch.no_grad()
def score_documents(model: torch.nn.Module, hasher: Any, vocab: np.ndarray,
                    docs: list[list[int]], start_id: int, seq_len: int, batch_size: int = 16,
                    precision: str = "fp32") -> list[dict[str, Any]]:
    """Each document (raw ids, no EOS) scored alone as ``[start_id] + doc`` in rolling windows:
    per document the log-likelihood in nats of its scored tokens, with unseen ids context only
    (left out as targets, counted), as in :func:`score_stream` (any device, ``precision``)."""
    streams = [np.asarray([start_id, *d], dtype=np.int64) for d in docs]
    locs = [local_ids(s, vocab) for s in streams]
    groups: dict[int, list[tuple[int, int, int]]] = {}  # window length -> (doc, start, scored)
    for i, s in enumerate(streams):
        for start, t, k in rolling_windows(len(s), seq_len):
            groups.setdefault(t, []).append((i, start, k))
    ll = [0.0] * len(docs)
    scored = [0] * len(docs)
    model.eval()
    dev = model_device(model)
    for t, wins in sorted(groups.items()):
        for a in range(0, len(wins), batch_size):
            batch = wins[a:a + batch_size]
            x_raw = torch.stack([torch.from_numpy(streams[i][s:s + t]) for i, s, _ in batch])
            x_loc = torch.stack([torch.from_numpy(locs[i][s:s + t]) for i, s, _ in batch])
            y = torch.stack([torch.from_numpy(locs[i][s + 1:s + t + 1]) for i, s, _ in batch])
            keep = torch.arange(t)[None, :] >= torch.tensor([t - k for _, _, k in batch])[:, None]
            y = torch.where((y < 0) | ~keep, IGNORE, y)  # [b, t]
            ids = hasher.hash(x_raw) if hasher is not None else None
            if dev.type != "cpu":  # hashed on the CPU, as in score_stream
                x_loc, y = x_loc.to(dev), y.to(dev)
                ids = None if ids is None else {k: v.to(dev) for k, v in ids.items()}
            with unknown_inputs(model, x_loc < 0), autocast(precision, dev):
                out = model(x_loc.clamp_min(0), ids)
                nll = model.token_nll(out, y, ignore_index=IGNORE).double()  # [b, t]
            for j, (i, _, _) in enumerate(batch):
                ll[i] -= float(nll[j].sum())
                scored[i] += int((y[j] != IGNORE).sum())
    return [{"loglikelihood": ll[i], "targets": len(d), "scored": scored[i]}
            for i, d in enumerate(docs)]


def run_eval(run_dir: str, ec: EvalConfig, progress: bool = True) -> dict[str, Any]:
    from ..serving.loader import load_run
    from ..training.corpus import EOS_TOKEN

    device = resolve(ec.device, ec.precision)  # before any work
    served = load_run(run_dir)
    served.model.to(device)
    eos = served.tokenizer.token_to_id(EOS_TOKEN)
    if ec.data is not None:
        raw, n_docs = held_out(ec.data, served.tokenizer)
        docs = None
    else:
        docs = read_documents(ec)
        raw, n_docs = encode(served.tokenizer, docs, eos), len(docs)
    seq_len = ec.seq_len or served.model.config.max_seq_len
    if seq_len > served.model.config.max_seq_len:
        raise UserError(f"seq_len={seq_len} exceeds the run's max_seq_len="
                         f"{served.model.config.max_seq_len}")
    res = score_stream(served.model, served.hasher, served.vocab, raw, seq_len, ec.batch_size,
                       progress, ec.precision)
    res.update({"run": str(run_dir), "checkpoint": served.checkpoint.name, "documents": n_docs,
                "text": ec.text, "source": ec.source, "data": ec.data, "seq_len": seq_len})
    if ec.per_document:
        if docs is None:  # the held-out stream: each document is followed by its EOS
            ends = np.flatnonzero(raw == eos)
            ids = [raw[a + 1:b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]
        else:
            ids = [e.ids for e in served.tokenizer.encode_batch(docs, add_special_tokens=False)]
        res["per_document"] = score_documents(served.model, served.hasher, served.vocab, ids, eos,
                                              seq_len, ec.batch_size, ec.precision)
    if ec.json:
        write_json(ec.json, res, "engram eval", indent=2)
    return res
