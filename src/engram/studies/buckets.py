"""Where the gain lands (issue 46): per-token loss differences on held-out text, Engram - dense and
Engram - pathway (capacity 1), bucketed by how often the token's n-gram was trained on.

Which n-gram. At input position t of a window, Engram's hash for order n keys on the compressed
suffix n-gram x'[t-n+1..t] ending at the current input token t (retrieval/hashing.py: slot j holds
x'[t-j], and a slot before the window's first position holds pad' = P(pad_id)); the loss at t is the
one for predicting token t+1. That n-gram, pad' slots included (held-out windows start fresh as
training windows do), is the one counted, under the run's own compression
(``hasher.compression``): a count says how often the module was trained at a position keyed by
this very n-gram (rows it shares with other n-grams through hash collisions are not counted).

Which windows. Training batches are a pure function of (seed, step) (training/batches.py), so
``TokenBatches`` rebuilt with the run's seed, batch size, seq_len and sampling gives back the
windows of every micro-batch up to the analysed checkpoint (its step x grad_accum). N-grams are
counted at those windows' input positions only (a window's last token is a target, never read),
with multiplicity: a window drawn twice counts twice, a part of the train stream no window covered
counts nothing. Validation text is never counted: it is not in the train stream.

Buckets: a training count of 0, 1-9, 10-99, 100+, per order 2..N. Per run: each bucket's share of
the held-out tokens (analyze's --batches, spread over the validation split), each model's mean
loss there and Engram's difference to the others; over seeds (``combine``): the per-seed
differences, common.RULE (the spreads: each model's bucket loss over seeds) and the paired 95%
interval (evidence.paired_interval).

Shape legend:
    w windows, t positions, m positions counted (w x t), N max n-gram order, V' compressed
    vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..artifacts.checkpoint import saved_step
from ..artifacts.run import CONFIG
from ..errors import UserError
from ..training.batches import TokenBatches
from .common import largest_spread, resolved, seed_spread
from .evidence import interval_text, paired_interval

BUCKETS = ("0", "1-9", "10-99", "100+")
EDGES = (1, 10, 100)  # a count's bucket: how many edges it reaches
# What decides the training windows: a baseline must share these with the Engram run.
WINDOWS = ("seed", "sources", "max_chars", "val_fraction", "data", "vocab", "steps", "batch_size",
           "seq_len", "grad_accum", "sampling")
# What the capacity-1 control may differ in from its Engram run (beside engram_lookup): where it
# was written and how it was watched, nothing that changes its numbers.
BOOKKEEPING = ("out_dir", "eval_every", "eval_batches", "final_eval_full", "ckpt_every",
               "log_every", "threads", "device", "compile", "table_dir", "table_budget_mb")


# -- counting ---------------------------------------------------------------------------------------
def suffix_slots(xc: np.ndarray, n_max: int, pad: int) -> np.ndarray:
    """[N, w, t]: slot j holds x'[t-j], or pad' where t-j is before the window (as the hasher's
    ``_suffix_tokens`` on a window without dead positions)."""
    w, t = xc.shape
    padded = np.concatenate([np.full((w, n_max - 1), pad, dtype=np.int64), xc], axis=1)
    return np.stack([padded[:, n_max - 1 - j:n_max - 1 - j + t] for j in range(n_max)])


def ngram_ids(slots: np.ndarray, vocab_size: int) -> dict[int, np.ndarray]:
    """Exact ids of the suffix n-grams of ``slots`` [N, m], per order 2..N: equal ids for equal
    n-grams. Built one order at a time, (id of slots 0..n-2) x V' + slot n-1, re-ranked by
    np.unique, so the keys never outgrow int64 whatever N and V' are."""
    m = slots.shape[1]  # an id is below max(m, V') at every order
    if max(m, vocab_size) * vocab_size >= np.iinfo(np.int64).max:
        raise ValueError(f"{m} positions x V'={vocab_size} overflow int64 keys")
    ids, out = slots[0], {}
    for n in range(2, slots.shape[0] + 1):
        _, ids = np.unique(ids * vocab_size + slots[n - 1], return_inverse=True)
        out[n] = ids.reshape(-1)
    return out


def training_windows(cfg: Any, corpus: Any, steps: int) -> np.ndarray:
    """[w, t] raw input ids of every window the run trained on in its first ``steps`` steps."""
    batches = TokenBatches(corpus.streams["train"], cfg.batch_size, cfg.seq_len, corpus,
                           seed=cfg.seed, sampling=cfg.sampling)
    n = steps * cfg.grad_accum  # loop.train_step: micro-batch i of step s is batch(s x accum + i)
    if n == 0:
        return np.zeros((0, cfg.seq_len), dtype=np.int64)
    return np.concatenate([batches.batch(i).raw.numpy() for i in range(n)])


def training_counts(train_raw: np.ndarray, val_raw: np.ndarray, hasher: Any
                    ) -> dict[int, np.ndarray]:
    """Per order 2..N, for each held-out input position (``val_raw`` [w_v, t] flattened): how
    often its compressed suffix n-gram occurs at the input positions of ``train_raw`` [w, t]."""
    comp = hasher.compression
    n_max = hasher.config.max_ngram_size
    pad = int(comp.lookup[hasher.config.pad_id])
    slots = np.concatenate([suffix_slots(comp.lookup[r], n_max, pad).reshape(n_max, -1)
                            for r in (train_raw, val_raw)], axis=1)  # [N, m_train + m_val]
    m = train_raw.size
    out = {}
    for n, ids in ngram_ids(slots, len(comp)).items():
        counts = np.bincount(ids[:m], minlength=int(ids.max()) + 1 if ids.size else 0)
        out[n] = counts[ids[m:]]
    return out


def bucket_of(counts: np.ndarray) -> np.ndarray:
    """Index into BUCKETS of each count."""
    return np.searchsorted(np.asarray(EDGES), counts, side="right")


# -- one run ----------------------------------------------------------------------------------------
def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if x.size else None


def summarise(counts: dict[int, np.ndarray], nll: dict[str, np.ndarray]) -> dict[str, Any]:
    """One run's buckets: {"orders": {n: {bucket: {n, share, nll: {model: mean}, diff: {other:
    engram - other}, part: {other: share x diff}}}}, "all": the same over every token}.
    ``nll``: per-token losses [m] of "engram" and the models it is compared with."""
    others = [k for k in nll if k != "engram"]
    total = len(nll["engram"])

    def row(mask: np.ndarray) -> dict[str, Any]:
        k = int(mask.sum())
        share = k / total if total else 0.0
        means = {name: _mean(v[mask]) for name, v in nll.items()}
        diff = {o: _mean(nll["engram"][mask] - nll[o][mask]) for o in others}
        # an empty bucket's part of the total is 0: the parts of an order add up to the total
        return {"n": k, "share": share, "nll": means, "diff": diff,
                "part": {o: 0.0 if d is None else share * d for o, d in diff.items()}}

    return {"tokens": total, "models": list(nll), "all": row(np.ones(total, dtype=bool)),
            "orders": {str(n): {b: row(bucket_of(c) == i) for i, b in enumerate(BUCKETS)}
                       for n, c in counts.items()}}


def read_config(run_dir: str, flag: str) -> dict[str, Any]:
    path = Path(run_dir) / CONFIG
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {run_dir}: not a run folder of `engram train` ({path}: "
                        f"{type(e).__name__})") from None


def check_pair(run_dir: str, cfg: dict[str, Any], other: str, flag: str) -> None:
    """One clear line when ``other`` (``--baseline`` or ``--pathway``) cannot be compared token by
    token with the Engram run: other data, seed or training windows; for the pathway, anything
    but the lookup (it must be the capacity-1 control of this very run)."""
    theirs = read_config(other, flag)
    keys = WINDOWS if flag == "--baseline" else sorted(
        k for k in {*cfg, *theirs} if k not in BOOKKEEPING and k != "engram_lookup")
    diff = [f"{k}: {theirs.get(k)!r} vs {cfg.get(k)!r}" for k in keys
            if theirs.get(k) != cfg.get(k)]
    if flag == "--pathway" and theirs.get("engram_lookup") != "constant":
        diff.insert(0, f"engram_lookup: {theirs.get('engram_lookup')!r}, not 'constant'")
    if saved_step(other) != saved_step(run_dir):
        diff.append(f"checkpoint step: {saved_step(other)} vs {saved_step(run_dir)}")
    if diff:
        what = ("the capacity-1 control (compare's pathway arm)" if flag == "--pathway"
                else "a run on the same data, seed and training windows")
        raise UserError(f"{flag} {other} is not {what} of {run_dir}: differs in "
                        + "; ".join(diff))


def run_buckets(cfg: Any, corpus: Any, hasher: Any, run_dir: str, batches: list,
                nll: dict[str, np.ndarray]) -> dict[str, Any]:
    """The buckets of the Engram run ``run_dir`` (config ``cfg``) on held-out ``batches``."""
    steps = saved_step(run_dir) or 0
    train_raw = training_windows(cfg, corpus, steps)
    val_raw = np.concatenate([b.raw.numpy() for b in batches])
    counts = training_counts(train_raw, val_raw, hasher)
    return {"steps": steps, "training_windows": len(train_raw),
            "training_positions": int(train_raw.size), **summarise(counts, nll)}


# -- over seeds -------------------------------------------------------------------------------------
def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of different seeds (one per run): per order and bucket, the shares, and per compared
    model the per-seed differences, their mean, the rule's verdict (spread: each model's bucket
    loss over seeds, the largest of the two) and the paired 95% interval."""
    orders = {tuple(r["orders"]) for r in runs}
    if len(orders) > 1:
        raise UserError(f"the runs count different n-gram orders {sorted(orders)}: combine seeds "
                        "of one configuration")
    others = [m for m in runs[0]["models"] if m != "engram" and all(m in r["models"] for r in runs)]

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        shares = [r["share"] for r in rows]
        out: dict[str, Any] = {"n": [r["n"] for r in rows], "share": shares,
                               "share_mean": float(np.mean(shares)),
                               "engram_nll": [r["nll"]["engram"] for r in rows], "vs": {}}
        for o in others:
            d = [r["diff"][o] for r in rows]
            got = [x for x in d if x is not None]
            spread = largest_spread([seed_spread(r["nll"]["engram"] for r in rows),
                                     seed_spread(r["nll"][o] for r in rows)])
            mean = float(np.mean(got)) if got else None
            parts = [r["part"][o] for r in rows if r["part"][o] is not None]
            out["vs"][o] = {"per_seed": d, "mean": mean, "spread": spread,
                            "resolved": resolved(mean, spread),
                            "interval": paired_interval(got),
                            "part_mean": float(np.mean(parts)) if parts else None}
        return out

    return {"seeds": len(runs), "compared": others, "tokens": [r["tokens"] for r in runs],
            "training_positions": [r.get("training_positions") for r in runs],
            "all": stats([r["all"] for r in runs]),
            "orders": {n: {b: stats([r["orders"][n][b] for r in runs]) for b in BUCKETS}
                       for n in runs[0]["orders"]}}


def _nats(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.4f}"


def _rule(s: dict[str, Any]) -> str:
    seeds = sum(x is not None for x in s["per_seed"])
    if seeds == 0:
        return "no tokens"
    if s["spread"] is None:
        return f"{'one seed' if len(s['per_seed']) == 1 else 'one seed with tokens'}: not judged"
    return f"{'resolved' if s['resolved'] else 'not resolved'} (spread {s['spread']:.4f})"


def report(c: dict[str, Any]) -> list[str]:
    """The markdown section of a ``combine`` result."""
    lines = ["## Where the gain lands", "",
             "Per-token loss difference on the held-out tokens, Engram minus each model (negative: "
             "Engram's loss is lower), bucketed by how often the token's compressed n-gram "
             "x'[t-n+1..t] (the one Engram's hash at input t keys on; the loss at t predicts token "
             "t+1) occurred in the windows the run trained on. Part: share x difference, the "
             "bucket's part of the total difference. Rule: common.RULE over each model's bucket "
             "loss; interval: paired 95% t-interval of the per-seed differences.", "",
             f"Per seed: {_seeds(c['tokens'], ',')} held-out tokens (the analysis's --batches, "
             "spread over the validation split); n-grams counted at "
             f"{_seeds(c['training_positions'], ',')} trained input positions.", ""]
    if not c["compared"]:
        lines += ["No --baseline or --pathway: only the shares and Engram's own loss.", "",
                  "| order | training count | share per seed | Engram loss per seed |",
                  "|---|---|---|---|"]
        for n, rows in c["orders"].items():
            lines += [f"| {n} | {b} | {_seeds(s['share'], '.1%')} | "
                      f"{_seeds(s['engram_nll'], '.3f')} |" for b, s in rows.items()]
        return lines + [""]
    for o in c["compared"]:
        a = c["all"]["vs"][o]
        lines += [f"### Engram - {o}", "",
                  f"All tokens: per seed {_seeds(a['per_seed'], '+.4f')}, mean {_nats(a['mean'])}; "
                  f"{_rule(a)}; interval {interval_text(a['interval'])}.", "",
                  "| order | training count | share per seed | difference per seed | mean | part | "
                  "rule | paired 95% interval |", "|---|---|---|---|---|---|---|---|"]
        for n, rows in c["orders"].items():
            for b, s in rows.items():
                v = s["vs"][o]
                iv = interval_text(v["interval"]) if v["mean"] is not None else "n/a"
                lines.append(f"| {n} | {b} | {_seeds(s['share'], '.1%')} | "
                             f"{_seeds(v['per_seed'], '+.4f')} | {_nats(v['mean'])} | "
                             f"{_nats(v['part_mean'])} | {_rule(v)} | {iv} |")
        lines.append("")
    return lines


def _seeds(xs: list[float | None], spec: str) -> str:
    return ", ".join("n/a" if x is None else format(x, spec) for x in xs)
