"""`engram compare`: dense vs Engram vs MoE on the package corpus at the same token budget.

The paper's claim (section 4): at equal activated parameters and FLOPs, adding Engram tables (sparse
parameters only) lowers validation loss, and an MoE with the same total parameters is the fair
sparse baseline. Here:

- ``dense``: the backbone.
- ``engram``: the same backbone plus Engram at ``engram_layers``; its FFN width is trimmed so the
  activated parameters equal dense's (the Engram projections are dense compute), the tables are the
  only extra and they are sparse.
- ``moe``: the backbone with an MoE FFN (1 shared + top-1 routed, expert width d_ff/2, so activated
  FFN equals dense), with as many routed experts as it takes to match the Engram model's total.

Is it the memory? Engram brings two things: the tables' rows (n-gram identity) and a gated pathway
(projections, gate, conv, the trimmed FFN) that comes with them. Controls at the ``engram`` arm's
backbone, trimmed FFN, seeds and data order take one thing away each (``ARMS``):

- ``pathway`` (run by default): capacity 1, every position reads one row per head, so no token or
  n-gram identity reaches the module: a gated constant plus the trimmed FFN. The gain then splits
  as (dense - pathway) + (pathway - engram): what the pathway gives, and what the memory adds.
- ``unigram``: the module keyed on the current token alone (a second token embedding, no n-grams).
- ``frozen``: the tables never train; ``frozen-scaled``: the same with a learned gain per head, so a
  loss is not a scale handicap (n-gram identity as fixed random features).
- ``bigram-hash``: what the community uses instead (parameter-golf's BigramHash): one hashed bigram
  table of raw ids at the input (layer 0, before the first attention: added to the token
  embedding through its projection), no gate, no conv; table parameters within one row of
  Engram's; the same row optimiser, at its own learning-rate multiplier (``BIGRAM_LR_MULT``).

Each variant runs for every seed; seeds give the run-to-run noise. Runs go to worker processes
(studies/common.py: one thread each, resumable). Before they start, the workers time a few steps
of each variant side by side and the study prints its wall-time estimate (studies/estimate.py);
results.json keeps the estimate beside the time it took, the CPU and the load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compute import gemm, machine
from ..errors import UserError
from ..files import publish_text
from ..models.model import EngramLM
from ..ranges import AT_LEAST_1, NON_NEGATIVE, Range, check_ranges
from ..training.corpus import build_corpus
from ..training.train import TrainConfig, build_run, try_resume
from .common import RULE, Workers, finished, job, largest_spread, resolved, seed_spread, train_run
from .evidence import mean_curve, paired_interval, seeds_needed, t975, tokens_to_target
from .estimate import Estimate, estimate

VARIANTS = ("dense", "engram", "moe")  # the main comparison: its verdicts use these arms' spreads
# Every arm compare can run: what it is (the module docstring says why each exists).
ARMS = {
    "dense": "the backbone",
    "engram": "Engram at layer 1, FFN trimmed to dense's activated parameters",
    "moe": "an MoE FFN (1 shared + top-1 routed) of the Engram model's total parameters",
    "pathway": "Engram's module at capacity 1: one row per head at every position (no identity)",
    "unigram": "Engram's module keyed on the current token alone (no n-gram context)",
    "frozen": "Engram with tables that never train (their initial rows)",
    "frozen-scaled": "frozen tables with a learned gain per head",
    "bigram-hash": "one hashed bigram table of raw ids added at the input, no gate, no conv",
}
ARMS_DEFAULT = ("dense", "engram", "moe", "pathway")
# bigram-hash's table learning-rate multiplier, chosen on seeds no verdict uses (100, 101), as the
# warmup was for dense: the lowest mean validation loss of 1, 5 and 25 (benchmarks/dense_noise.py
# --variant bigram-hash; benchmarks/results/compare/bigram_lr/: 5.8518, 5.8361, 5.7917). 25 is the
# grid's edge: a larger one is untried.
BIGRAM_LR_MULT = 25.0


@dataclass
class StudyBudget:
    """What every study of runs at compare's scale shares: seeds, workers, the token budget."""

    out_dir: str = "out"  # results.json, loss.png, report.md, gates.html land here
    seeds: tuple[int, ...] = (0, 1, 2)  # the noise estimate; rounding alone moves a run ~0.05 nats
    workers: int = 2  # parallel training processes (one torch thread each)
    # Time a few steps of each variant on the workers first and print the wall-time estimate.
    estimate: bool = True
    steps: int = 480
    # Linear warmup over this fraction of the steps, then cosine. 0.3, not the old tenth: chosen for
    # the dense baseline alone on seeds the verdict never uses (benchmarks/dense_noise.py, results
    # in benchmarks/results/compare/noise/ablation.json: dense's final loss 0.23 nats lower).
    warmup_fraction: float = 0.3
    batch_size: int = 16
    seq_len: int = 128
    eval_every: int = 80
    eval_batches: int = 16
    # A checkpoint this often (and at the end): an interrupted run resumes from its last one.
    ckpt_every: int = 160

    def __post_init__(self) -> None:
        self.seeds = tuple(self.seeds)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"seeds must be non-empty and distinct, got {self.seeds}")
        check_ranges(self, seeds=NON_NEGATIVE, workers=AT_LEAST_1, steps=AT_LEAST_1,
                     warmup_fraction=Range(0, 1), batch_size=AT_LEAST_1, seq_len=AT_LEAST_1, eval_every=AT_LEAST_1,
                     eval_batches=AT_LEAST_1, ckpt_every=AT_LEAST_1)


@dataclass
class CompareConfig(StudyBudget):
    # The arms to train (dense and engram always): the three of the main comparison and the
    # capacity-1 control that splits Engram's gain; the other controls on demand (ARMS).
    arms: tuple[str, ...] = field(default=ARMS_DEFAULT,
                                  metadata={"choices": "engram.studies.compare:ARMS"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.arms = tuple(dict.fromkeys(("dense", "engram", *self.arms)))  # in order, once each
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise UserError(f"unknown arms {unknown}; known: {', '.join(ARMS)}")


def budget(base: TrainConfig, cc: StudyBudget) -> TrainConfig:
    """The shared token budget and bookkeeping of every run of a study (study-nine's config has no
    ``ckpt_every``: its runs keep no checkpoints)."""
    return dataclasses.replace(base, steps=cc.steps, batch_size=cc.batch_size, seq_len=cc.seq_len,
                               eval_every=cc.eval_every, eval_batches=cc.eval_batches,
                               ckpt_every=getattr(cc, "ckpt_every", cc.steps), log_every=10,
                               warmup=warmup_steps(cc), final_eval_full=True)


def warmup_steps(cc) -> int:
    """The study's warmup: ``warmup_fraction`` of its steps, at least one (study-nine's config has
    no fraction: a tenth). The epsilon keeps 0.1 x 480 at 48, as ``steps // 10`` was."""
    return max(1, int(cc.steps * getattr(cc, "warmup_fraction", 0.1) + 1e-9))


def counts(cfg: TrainConfig, vocab: int) -> dict[str, int]:
    with torch.device("meta"):
        return EngramLM(cfg.model_config(vocab)).param_counts()


def solve_linear(f, x0: int, x1: int, target: float) -> int:
    """Integer x with f(x) closest to target, for f linear in x (a parameter count)."""
    y0, y1 = f(x0), f(x1)
    x = x0 + (target - y0) * (x1 - x0) / (y1 - y0)
    best = min((max(1, int(x) + d) for d in (-1, 0, 1, 2)), key=lambda v: abs(f(v) - target))
    return best


def variant_configs(base: TrainConfig, vocab: int,
                    arms: tuple[str, ...] = VARIANTS) -> dict[str, TrainConfig]:
    """The matched configs of ``arms`` (the main comparison's three by default), in ARMS' order
    (see the module docstring)."""
    dense = dataclasses.replace(base, engram=False, moe=False)
    d_ff0 = dense.model_config(vocab).d_ff
    target_active = counts(dense, vocab)["active"]

    def trimmed(cfg: TrainConfig) -> TrainConfig:  # FFN width for dense's activated parameters
        return dataclasses.replace(cfg, d_ff=solve_linear(
            lambda x: counts(dataclasses.replace(cfg, d_ff=x), vocab)["active"],
            d_ff0, d_ff0 - 32, target_active))

    engram = trimmed(dataclasses.replace(base, engram=True, moe=False))
    eng_counts = counts(engram, vocab)
    moe0 = dataclasses.replace(base, engram=False, moe=True, n_shared_experts=1, top_k=1,
                               d_expert=d_ff0 // 2)
    n = solve_linear(lambda x: counts(dataclasses.replace(moe0, n_routed_experts=x), vocab)["total"],
                      4, 8, eng_counts["total"])

    def control(**changes: Any) -> TrainConfig:  # engram's backbone and FFN, one thing changed
        return dataclasses.replace(engram, **changes)

    # bigram-hash: one head of width d at layer 0; its exact row count puts its table parameters
    # within one row of Engram's (rows x d, not primes).
    d = base.d_model
    bigram = trimmed(dataclasses.replace(
        base, engram=True, moe=False, engram_layers=(0,), max_ngram_size=2, n_head_per_ngram=1,
        n_embed_per_ngram=d, table_size=max(2, round(eng_counts["table"] / d)),
        engram_prime_sizes=False, engram_fixed_gate=True, engram_conv=False, compress=False,
        table_lr_mult=BIGRAM_LR_MULT))
    every = {"dense": dense, "engram": engram,
             "moe": dataclasses.replace(moe0, n_routed_experts=n),
             "pathway": control(engram_lookup="constant"),
             "unigram": control(engram_lookup="unigram"),
             "frozen": control(freeze_tables=True),
             "frozen-scaled": control(freeze_tables=True, engram_head_gain=True),
             "bigram-hash": bigram}
    return {a: every[a] for a in ARMS if a in arms}


def run_compare(cc: CompareConfig, base: TrainConfig | None = None) -> dict[str, Any]:
    out = Path(cc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = budget(base or TrainConfig(), cc)
    t0, load0 = time.perf_counter(), os.getloadavg()
    corpus = build_corpus(base.data_config())  # built once here; workers hit the disk cache
    configs = variant_configs(base, corpus.vocab_size, cc.arms)
    # Slowest first (MoE routes, Engram looks up); the estimate may pick a better hand-out order.
    slow_first = ("moe", "engram", *(a for a in ARMS if a not in ("moe", "engram", "dense")),
                  "dense")
    jobs = [job(name, configs[name], s, out / "runs")
            for name in slow_first if name in configs for s in cc.seeds]
    est = None
    if any(finished(j) is None for j in jobs):
        with Workers(min(cc.workers, sum(finished(j) is None for j in jobs))) as pool:
            if cc.estimate:
                est = estimate(pool, jobs, [j.name for j in jobs], t0, after=_closing_s)
                print(f"compare: {est.line()}", flush=True)
            results = pool.run(jobs, train_run, "compare runs", order=est and est.order)
    else:
        results = [finished(j) for j in jobs]
    runs_done = time.perf_counter()
    summary = summarise(results, configs, corpus, runs_done - t0)
    publish_text(out / "results.json", json.dumps(summary, indent=2))
    from .report import plot_losses, render_gates, write_report

    plot_losses(results, out / "loss.png")
    eng = next(j for j in jobs if j.name == "engram" and j.seed == cc.seeds[0])
    gate_stats = render_gates(_load(eng.cfg, corpus), corpus, out / "gates.html", out / "gates.png")
    summary["gates"] = gate_stats
    summary["wall_s"] = wall = time.perf_counter() - t0
    summary["time"] = timing(results, est, wall, runs_done - t0, cc.workers, load0)
    publish_text(out / "results.json", json.dumps(summary, indent=2))
    write_report(summary, out / "report.md")
    if est is not None:
        print(f"compare: took {wall / 60:.1f} min, {wall / est.total_s:.2f}x the estimate "
              f"({est.total_s / 60:.1f} min); the runs used "
              f"{summary['time']['cpu_utilisation']:.0%} of {summary['time']['cpus']} CPUs",
              flush=True)
    return summary


def _closing_s(costs) -> float:
    """What follows the runs, in the probe's units: the gate figure rebuilds an Engram run and
    loads its checkpoint (a start-up and about a save); the loss figure and the report ~a
    start-up more."""
    c = costs.get("engram") or next(iter(costs.values()))
    return 2 * c.startup_s + c.save_s


def timing(results: list[dict], est: Estimate | None, wall: float, runs_end: float, workers: int,
           load0: tuple[float, float, float]) -> dict[str, Any]:
    """Where the study's time went, for results.json: the estimate against the wall time, and the
    runs' CPU seconds against what the machine's CPUs could give in that wall time (idle workers
    and waits lower it)."""
    cpus = os.cpu_count() or 1
    cpu = sum(r.get("job_cpu_s", 0.0) for r in results)
    rec = {"wall_s": wall, "runs_end_s": runs_end, "workers": workers, "cpus": cpus,
           "cpu_model": machine.cpu_id(), "runs_cpu_s": cpu,
           "cpu_utilisation": cpu / (wall * min(cpus, workers)),  # the runs' CPU s / (wall x cores)
           "load_avg": {"start": load0, "end": os.getloadavg()}}
    if est is not None:
        rec["estimate"] = dataclasses.asdict(est)
        rec["wall_over_estimate"] = wall / est.total_s
        rec["runs_s_actual_over_estimate"] = (runs_end - est.before_s) / est.runs_s
        rec["per_run"] = [{"name": r["name"], "seed": r["seed"], "predicted_s": p,
                           "wall_s": r.get("job_wall_s"), "cpu_s": r.get("job_cpu_s")}
                          for r, p in zip(results, est.per_job_s)]
    return rec


def _load(cfg: TrainConfig, corpus):
    """A finished run, read back from its checkpoint."""
    run = build_run(cfg, corpus)
    if not try_resume(run):
        raise FileNotFoundError(f"{cfg.out_dir} has no checkpoint to draw its gates from (its "
                                "result.json was kept, its checkpoints are gone)")
    return run


def summarise(results: list[dict], configs: dict[str, TrainConfig], corpus, wall: float) -> dict:
    runs, noise = {}, {}
    for name in configs:
        rs = sorted((r for r in results if r["name"] == name), key=lambda r: r["seed"])
        losses = [r["val_loss"] for r in rs]
        runs[name] = {"val_loss": sum(losses) / len(losses), "val_loss_per_seed": losses,
                      "total_params": rs[0]["total_params"], "active_params": rs[0]["active_params"],
                      "table_params": rs[0]["table_params"], "tokens": rs[0]["tokens"],
                      "tokens_per_s": sum(r["tokens_per_s"] for r in rs) / len(rs),
                      "config": {k: v for k, v in configs[name].to_dict().items()
                                 if k in ("d_ff", "moe", "n_routed_experts", "engram", "table_size",
                                          "engram_layers", "d_model", "n_layer", "engram_lookup",
                                          "freeze_tables", "engram_head_gain", "table_lr_mult")}}
        noise[name] = seed_spread(losses)
    # The main comparison's verdicts by its own arms' spreads, as before the controls came.
    spread = largest_spread(noise[n] for n in VARIANTS if n in noise)

    gap = runs["dense"]["val_loss"] - runs["engram"]["val_loss"]
    paired = per_seed(runs, "dense", "engram")
    intervals = {"engram_vs_dense": paired_interval(paired)}
    vs_moe = paired_moe = None
    if "moe" in runs:
        vs_moe = runs["moe"]["val_loss"] - runs["engram"]["val_loss"]
        paired_moe = per_seed(runs, "moe", "engram")
        intervals["engram_vs_moe"] = paired_interval(paired_moe)
    # tokens to target: where each mean validation curve first reaches dense's final loss
    curves = {name: mean_curve([r["history"] for r in results if r["name"] == name])
              for name in runs}
    reach = {name: tokens_to_target(curves[name], runs["dense"]["val_loss"])
             for name in runs if name != "dense"}
    out = {"runs": runs, "noise_seed_spread": noise, "max_seed_spread": spread,
           "engram_gain_per_seed": paired, "engram_gain_vs_dense": gap,
           "engram_gain_vs_moe": vs_moe, "engram_gain_vs_moe_per_seed": paired_moe,
           "gain_over_max_noise": gap / spread if spread else None,
           "paired_interval": intervals,
           "tokens_to_target": {name: None if t is None else t / runs["dense"]["tokens"]
                                for name, t in reach.items()},
           "seeds_needed": seeds_needed(paired, [noise[n] for n in VARIANTS
                                                 if noise.get(n) is not None]),
           "resolved": {"engram_vs_dense": resolved(gap, spread),
                        **({"engram_vs_moe": resolved(vs_moe, spread)} if "moe" in runs else {}),
                        "rule": RULE,
                        **{f"{k}_interval": bool(i and i["excludes_zero"])
                           for k, i in intervals.items()}},
           "corpus": {"vocab": corpus.vocab_size, "train_tokens": len(corpus.streams["train"]),
                      "val_tokens": len(corpus.streams["val"]),
                      "sources": corpus.sources,
                      "max_chars": configs["dense"].max_chars, "data": configs["dense"].data},
           "machine": {"cpu": machine.cpu_id(), "gemm": gemm.backend()}, "wall_s": wall}
    if "pathway" in runs:
        out["split"] = split_gain(runs, noise)
    controls = [a for a in runs if a not in (*VARIANTS, "pathway")]
    if controls:
        out["controls"] = {a: difference(runs, noise, a, "engram") for a in controls}
    return out


def per_seed(runs: dict, a: str, b: str) -> list[float]:
    """a's loss - b's, seed by seed (the same seed is the same batch order: paired)."""
    return [x - y for x, y in zip(runs[a]["val_loss_per_seed"], runs[b]["val_loss_per_seed"])]


def difference(runs: dict, noise: dict, a: str, b: str) -> dict[str, Any]:
    """a's loss - b's over the seeds: the mean, per seed, the paired interval and the rule judged
    by these two arms' own spreads."""
    per = per_seed(runs, a, b)
    spread = largest_spread((noise[a], noise[b]))
    mean = sum(per) / len(per)
    return {"what": f"{a} - {b}", "mean": mean, "per_seed": per, "spread": spread,
            "over_spread": mean / spread if spread else None, "resolved": resolved(mean, spread),
            "interval": paired_interval(per),
            # the power line: what each verdict would need at this effect and these spreads
            "seeds_needed": seeds_needed(per, [x for x in (noise[a], noise[b]) if x is not None])}


# What "the memory carries the gain" means, fixed before the recorded runs (docs/guides/
# reproduce.md says the same): the memory's part (pathway - engram) is resolved by the rule and its
# paired interval excludes zero, and it is at least half of Engram's gain over dense. A gain, so a
# positive part: the text presumed one, and at 4x compare's tokens (two passes over the default
# corpus) the rows cost loss, resolved, which the three conditions alone would have called
# carrying it (issue 46; the 1x and 2x verdicts are unchanged).
MEMORY_CARRIES = ("pathway - engram positive, resolved by the rule, its paired 95% interval "
                  "excluding zero, and a share of the gain (pathway - engram) / (dense - engram) "
                  "of at least 0.5")


def split_gain(runs: dict, noise: dict) -> dict[str, Any]:
    """Engram's gain over dense as (dense - pathway) + (pathway - engram): what the gated pathway
    gives without any identity, and what the memory's rows add; the memory's share with Fieller's
    95% interval (undefined where the gain itself is not bounded away from zero)."""
    pathway, memory = difference(runs, noise, "dense", "pathway"), \
        difference(runs, noise, "pathway", "engram")
    gain = [p + m for p, m in zip(pathway["per_seed"], memory["per_seed"])]
    share = fieller_ratio(memory["per_seed"], gain)
    carries = (memory["mean"] > 0 and memory["resolved"]
               and bool(memory["interval"] and memory["interval"]["excludes_zero"])
               and share["estimate"] is not None and share["estimate"] >= 0.5)
    return {"pathway": pathway, "memory": memory, "gain_per_seed": gain, "memory_share": share,
            "memory_carries_gain": carries, "criterion": MEMORY_CARRIES}


def fieller_ratio(num: list[float], den: list[float]) -> dict[str, Any]:
    """mean(num) / mean(den) for paired per-seed values, with Fieller's 95% interval: the ratios
    R with (a - R b)^2 <= t^2 var(a - R b) / n. Bounded only where den's mean is itself resolved
    from zero (g = t^2 var(b) / (n b^2) < 1); otherwise the interval is "undefined" (None)."""
    n = len(num)
    if n < 2:
        return {"estimate": None, "low": None, "high": None, "why": "one seed"}
    a, b = sum(num) / n, sum(den) / n
    saa = sum((x - a) ** 2 for x in num) / (n - 1) / n
    sbb = sum((y - b) ** 2 for y in den) / (n - 1) / n
    sab = sum((x - a) * (y - b) for x, y in zip(num, den)) / (n - 1) / n
    t2 = t975(n - 1) ** 2
    est = a / b if b else None
    qa, qb, qc = b * b - t2 * sbb, -2 * (a * b - t2 * sab), a * a - t2 * saa
    disc = qb * qb - 4 * qa * qc
    if qa <= 0 or disc < 0:
        return {"estimate": est, "low": None, "high": None,
                "why": "the gain is not bounded away from zero at 95%: the share is undefined"}
    root = math.sqrt(disc)
    return {"estimate": est, "low": (-qb - root) / (2 * qa), "high": (-qb + root) / (2 * qa),
            "why": None}
