"""`engram study-nine`: what a collision-free hot tier does to training (arXiv 2601.16531, scaled down).

Five configurations on the package corpus, the same tokens and seeds for each, one table set shared
by all Engram layers, n = 2, 3 and K = 2 heads as in the paper:

- ``hash-R``: the hashed baseline, R rows per head (the paper's Hash-500K);
- ``nine-H/C`` for each N_hot = H: H hot rows per order (width K * d_head) + C cold rows per head,
  C chosen so the tables hold as many parameters as ``hash-R`` (the paper's Nine-100K/400K);
- ``hash-S`` and ``hash-L``: a smaller and a larger hashed table (the paper's 300K and 800K).

At every evaluation each run logs the validation loss on hot and on cold positions, their difference
``hot_cold_delta = loss_cold - loss_hot``, and each layer's mean gate alpha on hot and on cold
positions. A position is *hot* when one of its n-grams is among the ``ref_hot_rows`` most frequent of
its order in the training stream: the same positions in every configuration, hashed ones included,
so curves compare. At the end, the alpha-bucket table (loss and hot share per alpha bucket).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifacts.checkpoint import CheckpointError
from ..errors import UserError
from ..ranges import AT_LEAST_1, NON_NEGATIVE, Range, check_ranges
from ..retrieval.hot import build_hot_index, ngram_keys
from ..retrieval.primes import prime_table_sizes
from ..training.batches import val_batches
from ..training.corpus import build_corpus
from ..training.hooks import SaveCheckpoints
from ..training.loop import Run, fit, restore
from ..training.train import FileCheckpoints, TrainConfig, build_run
from .common import Job, finished, job, run_jobs
from .compare import budget


@dataclass
class NineStudyConfig:
    out_dir: str = "out/nine"  # nine.json, plots, report.md land here
    seeds: tuple[int, ...] = (0, 1, 2)  # every configuration runs every seed (same batches)
    workers: int = 2  # parallel training processes (one torch thread each)
    steps: int = 200  # 15 runs in 15.4 min on 2 cores (the recorded run); the flip needs far more
    batch_size: int = 16
    seq_len: int = 128
    eval_every: int = 25  # hot/cold losses and gates are logged this often
    eval_batches: int = 12  # validation batches per evaluation, spread over the val stream
    # Rows per head of the hashed baseline (the paper's Hash-500K, scaled to a 2M-token corpus).
    total_rows: int = 10_000
    # N_hot per order of each Nine split (the paper's 100K of 500K = 1/5, and a smaller N_hot).
    hot_rows: tuple[int, ...] = (2_000, 1_000)
    small_rows: int = 6_000  # the smaller hashed table (the paper's Hash-300K)
    large_rows: int = 16_000  # the larger hashed table (the paper's Hash-800K)
    ref_hot_rows: int = 2_000  # per order: n-grams this frequent make a position "hot"
    engram_layers: tuple[int, ...] = (1, 2, 3)  # all read one shared table set
    n_head_per_ngram: int = 2  # K
    n_embed_per_ngram: int = 128  # K * d_head (the paper's 64 dims per head)
    alpha_bins: int = 5  # alpha buckets of the final table (0-0.2, ..., 0.8-1.0)
    only: tuple[str, ...] = ()  # run just these configurations (names as in the report); () = all

    def __post_init__(self) -> None:
        self.seeds, self.hot_rows = tuple(self.seeds), tuple(self.hot_rows)
        check_ranges(self, seeds=NON_NEGATIVE, workers=AT_LEAST_1, steps=AT_LEAST_1,
                     batch_size=AT_LEAST_1, seq_len=AT_LEAST_1, eval_every=AT_LEAST_1,
                     eval_batches=AT_LEAST_1, total_rows=Range(2), hot_rows=AT_LEAST_1,
                     small_rows=Range(2), large_rows=Range(2), ref_hot_rows=AT_LEAST_1,
                     engram_layers=NON_NEGATIVE, n_head_per_ngram=AT_LEAST_1,
                     n_embed_per_ngram=AT_LEAST_1, alpha_bins=AT_LEAST_1)


def table_rows(cfg: TrainConfig) -> int:
    """Cold rows (all heads) of the shared table set."""
    sizes = prime_table_sizes(cfg.engram_config())
    return sum(p for order in sizes[cfg.engram_layers[0]] for p in order)


def table_params(cfg: TrainConfig) -> int:
    head_dim = cfg.n_embed_per_ngram // cfg.n_head_per_ngram
    hot = (cfg.max_ngram_size - 1) * cfg.hot_rows * cfg.n_embed_per_ngram
    return table_rows(cfg) * head_dim + hot


def study_configs(base: TrainConfig, sc: NineStudyConfig) -> dict[str, TrainConfig]:
    """The configurations, named as in the paper; ``nine-*`` match ``hash-<total>``'s table size."""
    base = dataclasses.replace(base, engram=True, shared_tables=True, hot_rows=0,
                               engram_layers=tuple(sc.engram_layers),
                               n_head_per_ngram=sc.n_head_per_ngram,
                               n_embed_per_ngram=sc.n_embed_per_ngram)

    def hashed(rows: int) -> TrainConfig:
        return dataclasses.replace(base, table_size=rows)

    out = {f"hash-{_k(sc.total_rows)}": hashed(sc.total_rows)}
    target = table_params(out[f"hash-{_k(sc.total_rows)}"])
    for h in sc.hot_rows:
        if not 0 < h < sc.total_rows:
            raise UserError(f"hot_rows entries must be in (0, total_rows={sc.total_rows}), got {h}")
        nine = dataclasses.replace(base, hot_rows=h, table_size=sc.total_rows - h)
        # Primes round each head up: walk the cold size until the tables match hash-R's best.
        best = min(range(sc.total_rows - h - 64, sc.total_rows - h + 65),
                   key=lambda s: abs(table_params(dataclasses.replace(nine, table_size=s)) - target))
        out[f"nine-{_k(h)}/{_k(sc.total_rows - h)}"] = dataclasses.replace(nine, table_size=best)
    for rows in (sc.small_rows, sc.large_rows):
        out[f"hash-{_k(rows)}"] = hashed(rows)
    return out


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


# -- one run -----------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_tiers(run, batches: list, hot: list[torch.Tensor], bins: int = 0) -> dict[str, Any]:
    """Loss on hot and cold positions, mean alpha per tier and layer (and alpha buckets)."""
    model = run.model
    model.eval()
    s = {"hot": [0.0, 0], "cold": [0.0, 0]}
    alpha: dict[int, dict[str, float]] = {}
    buckets: dict[int, torch.Tensor] = {}  # layer -> [bins, 3]: count, summed loss, hot count
    served = [0, 0]
    dev = next(model.parameters()).device  # a run trained with --device cuda
    for b, h in zip(batches, hot):
        b, h = b.to(dev), h.to(dev)
        out = model(b.inputs, b.hash_ids, return_gates=True)
        nll = model.token_nll(out, b.targets)  # [b, t]
        for tier, m in (("hot", h), ("cold", ~h)):
            s[tier][0] += float(nll[m].sum())
            s[tier][1] += int(m.sum())
        slots = next(iter(b.hash_ids.values()))[..., run.hasher.num_heads:]  # [b, t, G]
        served[0] += int((slots >= 0).any(-1).sum())
        served[1] += slots.shape[0] * slots.shape[1]
        for lid, g in out.gates.items():
            a = g[..., 0].float()  # [b, t] (one residual branch)
            d = alpha.setdefault(lid, {"hot": 0.0, "cold": 0.0})
            d["hot"] += float(a[h].sum())
            d["cold"] += float(a[~h].sum())
            if bins:
                idx = (a * bins).long().clamp(0, bins - 1).flatten()
                acc = buckets.setdefault(lid, torch.zeros(bins, 3, dtype=torch.float64,
                                                          device=dev))
                acc[:, 0] += torch.bincount(idx, minlength=bins)
                acc[:, 1] += torch.bincount(idx, weights=nll.flatten().double(), minlength=bins)
                acc[:, 2] += torch.bincount(idx, weights=h.flatten().double(), minlength=bins)
    model.train()
    lh, lc = s["hot"][0] / max(1, s["hot"][1]), s["cold"][0] / max(1, s["cold"][1])
    n_hot, n_cold = max(1, s["hot"][1]), max(1, s["cold"][1])
    rec = {"val_loss": (s["hot"][0] + s["cold"][0]) / (n_hot + n_cold), "loss_hot": lh,
           "loss_cold": lc, "hot_cold_delta": lc - lh, "hot_share": n_hot / (n_hot + n_cold),
           "served_hot_share": served[0] / max(1, served[1]),
           "alpha_hot": {str(k): v["hot"] / n_hot for k, v in alpha.items()},
           "alpha_cold": {str(k): v["cold"] / n_cold for k, v in alpha.items()}}
    if bins:
        rec["alpha_buckets"] = {str(k): [{"lo": i / bins, "hi": (i + 1) / bins,
                                          "count": int(v[i, 0]),
                                          "loss": float(v[i, 1] / v[i, 0]) if v[i, 0] else None,
                                          "hot_share": float(v[i, 2] / v[i, 0]) if v[i, 0] else None}
                                         for i in range(bins)] for k, v in buckets.items()}
    return rec


def _eval_set(run, cfg: TrainConfig, ref_rows: int, max_batches: int | None):
    """Fixed validation batches and their reference hot masks [b, t]."""
    plain = run.hasher.hasher
    ref = build_hot_index(plain, run.corpus.train, ref_rows, kind="exact")
    batches = list(val_batches(run.corpus.streams["val"], cfg.batch_size, cfg.seq_len, run.corpus,
                               run.hasher, max_batches=max_batches))
    hot = [(ref.lookup(ngram_keys(plain, plain.compression(b.raw))) >= 0).any(-1) for b in batches]
    return batches, hot


class WatchTiers:
    """loop.Hook: the tier evaluation at step 0, every cfg.eval_every steps and at the last, as
    run.history (with the mean training loss since the previous one); seconds spent training."""

    def __init__(self, batches: list, hot: list[torch.Tensor], settings: dict[str, Any]):
        self.batches, self.hot, self.settings = batches, hot, settings

    def start(self, run: Run) -> None:
        if run.step == 0:
            run.history = [{"step": 0, **evaluate_tiers(run, self.batches, self.hot)}]
            run.hook_state["watch"] = {"settings": self.settings, "train_s": 0.0}
        saved = run.hook_state.get("watch", {}).get("settings")
        if saved != self.settings:  # records measured otherwise cannot continue this history
            what = f"was watched with {saved}" if saved else "is not a study-nine run's"
            raise CheckpointError(f"the checkpoint in {run.cfg.out_dir} {what}, not "
                                  f"{self.settings}; use another --out_dir")
        self.t0, self.before = time.perf_counter(), run.hook_state["watch"]["train_s"]

    def after_step(self, run: Run, lr: float, loss: float) -> None:
        cfg = run.cfg
        if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
            steps, summed = run.window
            run.history.append({"step": run.step, "train_loss": summed / steps,
                                **evaluate_tiers(run, self.batches, self.hot)})
            run.window = (0, 0.0)
        run.hook_state["watch"]["train_s"] = self.before + time.perf_counter() - self.t0

    def end(self, run: Run) -> None:
        pass


def train_and_watch(cfg: TrainConfig, ref_rows: int, bins: int, corpus=None) -> dict[str, Any]:
    """Train one configuration; evaluate tiers every ``cfg.eval_every`` steps and at the end.

    Checkpoints in cfg.out_dir at every evaluation (only the newest kept): a killed run, run
    again, resumes from its last one to the same numbers.
    """
    run = build_run(cfg, corpus if corpus is not None else build_corpus(cfg.data_config()))
    checkpoints = FileCheckpoints(cfg.out_dir, keep=1)
    restore(run, checkpoints)
    batches, hot = _eval_set(run, cfg, ref_rows, cfg.eval_batches)  # the restored hot tier's
    watch = WatchTiers(batches, hot, {"ref_hot_rows": ref_rows, "eval_batches": cfg.eval_batches,
                                      "steps": cfg.steps, "eval_every": cfg.eval_every})
    fit(run, [watch, SaveCheckpoints(checkpoints, min(cfg.ckpt_every, cfg.eval_every))])
    full_b, full_h = _eval_set(run, cfg, ref_rows, None if cfg.final_eval_full else cfg.eval_batches)
    final = evaluate_tiers(run, full_b, full_h, bins)
    from ..models.nine_model import nine_param_counts

    return {"history": run.history, "final": final, "params": nine_param_counts(run.model),
            "train_s": run.hook_state["watch"]["train_s"],
            "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
            "hot_index_bytes": run.hasher.index.nbytes()}


def watch_run(j: Job) -> dict[str, Any]:
    """The work of one study-nine run (common.run_jobs): train and watch the tiers."""
    return train_and_watch(j.cfg, j.args["ref_hot_rows"], j.args["alpha_bins"])


def _line(r: dict[str, Any]) -> str:
    return (f"{r['name']} seed {r['seed']}: val {r['final']['val_loss']:.4f}, "
            f"delta {r['final']['hot_cold_delta']:+.3f} ({r['train_s']:.0f}s)")


def run_nine_study(sc: NineStudyConfig, base: TrainConfig | None = None) -> dict[str, Any]:
    if len(sc.seeds) < 1 or sc.ref_hot_rows < 1:
        raise UserError("need at least one seed and ref_hot_rows >= 1")
    out = Path(sc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = budget(base or TrainConfig(), sc)
    t0 = time.perf_counter()
    corpus = build_corpus(base.data_config())  # once here; workers read the disk cache
    configs = study_configs(base, sc)
    if sc.only:
        unknown = sorted(set(sc.only) - set(configs))
        if unknown:
            raise UserError(f"unknown configurations {unknown}; these exist: {list(configs)}")
        configs = {k: v for k, v in configs.items() if k in sc.only}
    # Seed-major: an interrupted study still has every configuration at its first seeds.
    jobs = [job(name, cfg, s, out / "runs", ref_hot_rows=sc.ref_hot_rows, alpha_bins=sc.alpha_bins)
            for s in sc.seeds for name, cfg in configs.items()]
    reused = sum(finished(j) is not None for j in jobs)  # read back, not trained again
    results = run_jobs(jobs, watch_run, sc.workers, "study-nine runs", _line)
    from .nine_report import summarise, write_outputs

    summary = summarise(results, configs, sc, corpus, time.perf_counter() - t0)
    summary["reused_runs"] = reused
    write_outputs(summary, out)
    return summary
