"""What a lossy table format costs, measured (issue 47): the same checkpoint scores the same tokens
teacher-forced twice through the one runtime (serving/runtime.py's ``forward``), with its own fp32
tables in memory and reading the lossy files. Per scored token the paired loss change (lossy -
fp32), KL(p_fp32 || p_lossy) and whether the two argmaxes agree; the mean change gets a 95%
block-bootstrap interval. The tokens are the run's held-out split (the checkpoint's own data,
checked against its recorded fingerprint) or a ``--text`` file, refused where it overlaps the
training stream. studies/table_cost.py is the gate that records and judges the result.

Shape legend: b windows per batch, t positions per window, V the model's vocabulary, n scored
tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError

MAX_TOKENS = 32_768  # tokens scored by default: well under a minute on compare's default model
# The interval resamples blocks of 64 consecutive scored tokens, not tokens: neighbouring tokens
# share context (and n-grams, so rows), and their loss changes are correlated; a per-token
# bootstrap would be too narrow.
BLOCK_TOKENS = 64
RESAMPLES = 2000
SEED = 0  # the bootstrap's: the same files and tokens give the same interval
# --text is refused when a run of this many tokens occurs verbatim in the training stream: long
# enough that no common phrase matches, short enough to catch a paragraph copied from training.
OVERLAP_TOKENS = 32
IGNORE = -100  # a target left out (the runtime's convention)


def measure(run_dir: str | Path, table_dir: str | Path, dtype: str, *,
            text: str | Path | None = None, max_tokens: int = MAX_TOKENS,
            batch_size: int = 8) -> dict[str, Any]:
    """The cost of the ``dtype`` table files in ``table_dir`` against the run's fp32 tables in
    memory, on at most ``max_tokens`` scored tokens of the held-out split (or ``text``):
    mean loss change and its interval, KL, top-1 agreement, tokens (module docstring)."""
    from ..serving.loader import open_model

    exact = open_model(run_dir)
    lossy = open_model(run_dir, tier="file", table_dir=table_dir, table_dtype=dtype)
    if exact.checkpoint != lossy.checkpoint:  # the same dense weights, or nothing is paired
        raise UserError(f"{table_dir} serves {lossy.checkpoint}, the run's newest checkpoint is "
                        f"{exact.checkpoint}")
    raw = held_out_tokens(exact) if text is None else text_tokens(exact, Path(text))
    seq_len = min(window(exact), max_tokens)
    wins = spread_windows(len(raw), seq_len, max_tokens)
    diff, kl, agree, nll = _score(exact, lossy, raw, wins, batch_size)
    if diff.size == 0:
        raise UserError("no token to score: every target is a token the run never saw")
    lo, hi = block_interval(diff)
    return {"format": dtype, "checkpoint": exact.checkpoint, "tokens": int(diff.size),
            "loss_fp32": float(nll.mean()), "loss": float(nll.mean() + diff.mean()),
            "mean": float(diff.mean()),
            "interval": {"low": lo, "high": hi, "level": 0.95, "method": "block bootstrap",
                         "block_tokens": BLOCK_TOKENS, "resamples": RESAMPLES, "seed": SEED},
            "kl": float(kl.mean()), "top1": float(agree.mean()), "seq_len": seq_len}


def window(rt) -> int:
    """The window scored at once: a run's context, or the windows an adapter was finetuned on
    (its base model's context is the pretrained one, often 8k, which the memory never saw)."""
    from ..artifacts import adapter

    if rt.checkpoint_file is None and rt.source is not None and adapter.detect(rt.source):
        try:
            return min(rt.max_seq_len, int(adapter.read_summary(rt.source)["config"]["seq_len"]))
        except (UserError, KeyError, TypeError, ValueError):
            pass  # an adapter save_engram wrote: no record of its windows
    return rt.max_seq_len


def spread_windows(n: int, seq_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(start, length) of at most ``max_tokens`` targets of a stream of n ids: whole windows of
    ``seq_len``, evenly spread over the stream when it holds more (a held-out split is one
    language after another: every part is read)."""
    from ..serving.runtime import windows

    wins = windows(n, seq_len)
    keep = max(1, max_tokens // seq_len)
    if len(wins) > keep:
        wins = [wins[i] for i in np.unique(np.linspace(0, len(wins) - 1, keep).round().astype(int))]
    return wins


@torch.no_grad()
def _score(exact, lossy, raw: np.ndarray, wins: list[tuple[int, int]], batch_size: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per scored target, in stream order: loss change (lossy - fp32), KL(fp32 || lossy), argmax
    agreement, fp32 loss; each [n]."""
    out: list[list[np.ndarray]] = [[], [], [], []]
    by_len: dict[int, list[int]] = {}
    for s, t in wins:
        by_len.setdefault(t, []).append(s)
    for t, starts in by_len.items():
        for a in range(0, len(starts), batch_size):
            ss = starts[a:a + batch_size]
            x = torch.stack([torch.from_numpy(raw[s:s + t]) for s in ss])  # [b, t]
            y = torch.stack([torch.from_numpy(raw[s + 1:s + t + 1]) for s in ss])  # [b, t]
            y = exact.ids.to_local(y)
            y = torch.where(y < 0, IGNORE, y)  # an unseen target has no probability
            keep = (y != IGNORE).numpy()
            oe, ol = exact.forward(x, warn=False), lossy.forward(x, warn=False)
            # log_softmax: the adaptive head's logits are log-probabilities already (unchanged),
            # a plain head's are not
            le = exact.model.logits(oe.hidden).float().log_softmax(-1)  # [b, t, V]
            ll = lossy.model.logits(ol.hidden).float().log_softmax(-1)  # [b, t, V]
            at = y.clamp_min(0).unsqueeze(-1).to(le.device)  # [b, t, 1]
            ne, nl = -le.gather(-1, at).squeeze(-1), -ll.gather(-1, at).squeeze(-1)  # [b, t]
            same = le.argmax(-1) == ll.argmax(-1)  # [b, t]
            ll.neg_().add_(le)  # le - ll, in place: [b, t, V] is the largest tensor here
            kl = ll.mul_(le.exp_()).sum(-1).clamp_min_(0)  # [b, t]; float32 sums dip below 0
            for i, v in enumerate((nl.double() - ne.double(), kl, same, ne)):
                out[i].append(v.cpu().numpy()[keep])
    return tuple(np.concatenate(v).astype(np.float64) for v in out)  # type: ignore[return-value]


def block_interval(diff: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` percentile interval of the mean of ``diff`` [n] (in stream order) over
    ``RESAMPLES`` resamples of its blocks of ``BLOCK_TOKENS`` consecutive values, seed ``SEED``."""
    starts = np.arange(0, len(diff), BLOCK_TOKENS)
    sums = np.add.reduceat(diff, starts)  # [blocks]
    counts = np.diff(np.r_[starts, len(diff)])  # [blocks]: the last may be short
    pick = np.random.default_rng(SEED).integers(0, len(starts), (RESAMPLES, len(starts)))
    means = sums[pick].sum(1) / counts[pick].sum(1)  # [resamples]
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


# -- the tokens ------------------------------------------------------------------------------------

def run_corpus(rt) -> Any:
    """The corpus the run's checkpoint was trained on (its recorded config and data identity:
    another folder's tokens are refused by ``check_same_data``)."""
    from ..artifacts.checkpoint import load_checkpoint
    from ..training.corpus import build_corpus
    from ..training.train import TrainConfig, check_same_data

    _, meta, _ = load_checkpoint(rt.checkpoint_file, parts=())  # the metadata, no tensors
    cfg = TrainConfig.from_record(meta["config"], rt.checkpoint_file)
    try:
        corpus = build_corpus(cfg.data_config(), rt.tokenizer)
        check_same_data(corpus, meta, rt.checkpoint_file)
    except UserError as e:  # the data moved or changed: say what it was needed for
        raise UserError(f"measuring a lossy table format needs the data {rt.source} was trained "
                        f"on (its held-out split, or its training stream to check --text "
                        f"against): {e}") from e
    return corpus


def adapter_corpus(rt) -> Any:
    """The corpus an ``engram finetune`` adapter was finetuned on: the folder its finetune.json
    names, checked against the data fingerprint its newest checkpoint records (so that a
    re-prepared folder, whose split may differ, is refused)."""
    from ..artifacts.adapter import read_summary
    from ..artifacts.checkpoint import FOLDER, latest_checkpoint, load_checkpoint
    from ..training.corpus import open_corpus

    need = (f"measuring a lossy table format on the adapter {rt.source} needs the data it was "
            "finetuned on (its held-out split, or its training stream to check --text against)")
    try:
        data = read_summary(rt.source)["data"]
        found = latest_checkpoint(Path(rt.source) / FOLDER)
        if found is None:
            raise UserError(f"{rt.source}/{FOLDER} holds no checkpoint (it records the data's "
                            "fingerprint)")
        _, meta, _ = load_checkpoint(found, parts=())  # the metadata, no tensors
        corpus = open_corpus(data, vocab="full")  # an adapter's model ids are the tokenizer's
        recorded = (meta.get("identity") or {}).get("data")
        if corpus.fingerprint != recorded:
            raise UserError(f"{data} is not the data it was finetuned on (fingerprint "
                            f"{corpus.fingerprint}, its checkpoint records {recorded})")
    except (UserError, KeyError, TypeError) as e:
        raise UserError(f"{need}: {e}") from e
    return corpus


def _corpus(rt) -> Any:
    """The corpus behind ``rt``: a run's or an adapter's (None: an export, which has none)."""
    from ..artifacts import adapter

    if rt.checkpoint_file is not None:
        return run_corpus(rt)
    if rt.source is not None and adapter.detect(rt.source):
        return adapter_corpus(rt)
    return None


def held_out_tokens(rt) -> np.ndarray:
    """The validation stream [n] (raw ids, int64) of a run's corpus or an adapter's finetune data:
    never trained on (training/corpus.py)."""
    corpus = _corpus(rt)
    if corpus is None:
        raise UserError(f"{rt.source} is neither a run folder nor an adapter: its held-out split "
                        "is unknown; measure on --text FILE")
    return np.asarray(corpus.val, dtype=np.int64)


def text_tokens(rt, path: Path) -> np.ndarray:
    """``path`` read as ``engram eval --text`` reads it (paragraphs are documents, each followed
    by EOS) [n]; refused where it overlaps the training stream of a run or an adapter
    (``check_unseen``)."""
    from .evaluate import EvalConfig, encode, read_documents

    raw = encode(rt.tokenizer, read_documents(EvalConfig(text=str(path))), rt.eos_id)
    if len(raw) < 2:
        raise UserError(f"--text {path} holds fewer than two tokens: nothing to score")
    corpus = _corpus(rt)
    if corpus is not None:
        check_unseen(raw, corpus.streams["train"], rt.tokenizer, path)
    return raw


def check_unseen(raw: np.ndarray, train: Any, tokenizer: Any, path: Path,
                 k: int = OVERLAP_TOKENS, chunk: int = 1 << 22) -> None:
    """Refuse (one line) a text ``raw`` [n] of which ``k`` consecutive tokens (all of it, when
    shorter) occur verbatim in the training stream ``train`` (a TokenStream), read in chunks:
    a loss on trained text says nothing of what the format costs on new text."""
    k = min(k, len(raw))
    want = _kgram_hashes(raw, k)  # [n - k + 1]
    for lo in range(0, max(1, len(train) - k + 1), chunk):
        part = np.asarray(train.read(lo, min(len(train), lo + chunk + k - 1)), dtype=np.int64)
        if len(part) < k:
            break
        hit = np.flatnonzero(np.isin(want, _kgram_hashes(part, k)))
        if hit.size:
            i = int(hit[0])
            snippet = tokenizer.decode(raw[i:i + k].tolist()).replace("\n", " ")[:60]
            raise UserError(f"--text {path} overlaps the run's training stream: {k} consecutive "
                            f"tokens (from token {i}, {snippet!r}) occur verbatim in the text it "
                            "was trained on; measure on text it never saw, or leave --text out "
                            "(the run's held-out split)")


def _kgram_hashes(a: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit polynomial hash of every run of ``k`` consecutive ids in a [n] -> [n - k + 1]."""
    a = a.astype(np.uint64)
    h = np.zeros(len(a) - k + 1, dtype=np.uint64)
    mult = np.uint64(0x9E3779B97F4A7C15)
    for j in range(k):  # wraps mod 2^64, as a hash may
        h = h * mult + a[j:j + len(h)] + np.uint64(1)
    return h


# -- what generate and eval print ------------------------------------------------------------------
