"""`engram sweep-allocation` and `engram sweep-slots` (paper section 3, the sparsity allocation).

Allocation: fix total and activated parameters; the sparse budget (total - active) is split between
inactive routed experts (a share rho) and Engram table rows (1 - rho). The paper finds a U-curve in
validation loss with the best rho near 0.75-0.8. Slots: fix the backbone and grow the tables; loss
against table slots on a log axis (the paper's scaling of memory alone). Its first point is
capacity 1 (``table_sizes`` 1: compare's ``pathway`` control, one row per head at every position),
so the figure runs from no memory to the largest table; every point keeps compare's Engram
backbone with its FFN trimmed to dense's activated parameters, so the points differ in the
tables alone.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import publish_text
from ..ranges import AT_LEAST_1, UNIT, check_ranges
from ..training.corpus import build_corpus
from ..training.train import TrainConfig
from .common import (RULE, job, largest_spread, resolved, run_jobs, save, seed_spread, spread_note,
                     subplots, train_run)
from .compare import StudyBudget, budget, counts, solve_linear, variant_configs
from .evidence import interval_text, paired_interval


@dataclass
class SweepConfig(StudyBudget):
    out_dir: str = "out/sweep"  # allocation.json / slots.json, .png, .md and runs/ land here
    seeds: tuple[int, ...] = (0,)
    rhos: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # allocation: share of budget to MoE
    # rows per head; 1: capacity 1 (no memory: compare's pathway control)
    table_sizes: tuple[int, ...] = (1, 1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000)
    n_routed_max: int = 24  # allocation: routed experts at rho = 1 (sets the sparse budget)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, rhos=UNIT, table_sizes=AT_LEAST_1, n_routed_max=AT_LEAST_1)


def allocation_configs(base: TrainConfig, vocab: int, sc: SweepConfig) -> dict[str, TrainConfig]:
    """One config per rho at (nearly) equal total and activated parameters."""
    d_ff0 = dataclasses.replace(base, engram=False, moe=False).model_config(vocab).d_ff
    moe = dataclasses.replace(base, engram=False, moe=True, n_shared_experts=1, top_k=1,
                              d_expert=d_ff0 // 2)
    full = dataclasses.replace(moe, n_routed_experts=sc.n_routed_max)
    total, active = counts(full, vocab)["total"], counts(full, vocab)["active"]
    rows_per_table_row = base.n_embed_per_ngram // base.n_head_per_ngram
    heads = (base.max_ngram_size - 1) * base.n_head_per_ngram * len(base.engram_layers)
    out = {}
    for rho in sc.rhos:
        n_routed = max(1, 1 + round(rho * (sc.n_routed_max - 1)))
        cfg = dataclasses.replace(moe, n_routed_experts=n_routed)
        table_params = total - counts(cfg, vocab)["total"]
        if table_params > heads * rows_per_table_row * 10:  # leave Engram out when nothing is left
            cfg = dataclasses.replace(cfg, engram=True)
            for _ in range(2):  # the two adjustments interact a little: settle them twice
                # Engram's projections are activated compute: trim the experts to pay for them.
                d_exp = solve_linear(lambda x: counts(dataclasses.replace(cfg, d_expert=x), vocab)
                                     ["active"], cfg.d_expert, cfg.d_expert - 16, active)
                cfg = dataclasses.replace(cfg, d_expert=d_exp)
                # The tables take whatever is left of the total.
                rest = total - (counts(cfg, vocab)["total"] - counts(cfg, vocab)["table"])
                size = max(2, int(rest / (heads * rows_per_table_row)))
                cfg = dataclasses.replace(cfg, table_size=size)
        out[f"rho={rho:g}"] = cfg
    return out


def slots_configs(base: TrainConfig, vocab: int, sc: SweepConfig) -> dict[str, TrainConfig]:
    """One config per table size, at compare's Engram backbone (trimmed FFN); size 1 is the
    capacity-1 control (its table_size field then matters to nothing)."""
    eng = variant_configs(base, vocab, ("engram",))["engram"]
    return {f"slots={s}": dataclasses.replace(eng, table_size=s) if s > 1 else
            dataclasses.replace(eng, engram_lookup="constant") for s in sc.table_sizes}


def run_sweep(kind: str, sc: SweepConfig, base: TrainConfig | None = None) -> dict[str, Any]:
    if kind not in ("allocation", "slots"):
        raise ValueError(f"sweep kind must be 'allocation' or 'slots', got {kind!r}")
    out = Path(sc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = budget(base or TrainConfig(), sc)
    corpus = build_corpus(base.data_config())
    configs = (allocation_configs(base, corpus.vocab_size, sc) if kind == "allocation"
               else slots_configs(base, corpus.vocab_size, sc))
    jobs = [job(name, cfg, s, out / "runs") for s in sc.seeds for name, cfg in configs.items()]
    results = run_jobs(jobs, train_run, sc.workers, f"sweep-{kind}")
    points = []
    for name, cfg in configs.items():
        rs = sorted((r for r in results if r["name"] == name), key=lambda r: r["seed"])
        x = float(name.split("=")[1])
        points.append({"name": name, "x": x, "val_loss": sum(r["val_loss"] for r in rs) / len(rs),
                       "val_loss_per_seed": {r["seed"]: r["val_loss"] for r in rs},
                       "seed_spread": seed_spread(r["val_loss"] for r in rs),
                       "total_params": rs[0]["total_params"], "active_params": rs[0]["active_params"],
                       "table_params": rs[0]["table_params"],
                       "slots": rs[0]["table_params"] // max(1, cfg.n_embed_per_ngram //
                                                             cfg.n_head_per_ngram)})
    points.sort(key=lambda p: p["x"])
    best = min(points, key=lambda p: p["val_loss"])
    spread = largest_spread(p["seed_spread"] for p in points)
    for p in points:  # is the best point resolved from this one?
        p["vs_best"] = p["val_loss"] - best["val_loss"]
        p["resolved_vs_best"] = resolved(p["vs_best"], spread)
    summary = {"kind": kind, "points": points, "best": best, "max_seed_spread": spread,
               "rule": RULE}
    publish_text(out / f"{kind}.json", json.dumps(summary, indent=2))
    _plot(summary, out / f"{kind}.png")
    publish_text(out / f"{kind}.md", _report(summary))
    return summary


def _report(summary: dict[str, Any]) -> str:
    spread = summary["max_seed_spread"]
    lines = [f"# engram sweep-{summary['kind']}", "",
             RULE + spread_note(spread) + " Beside the rule, the paired 95% interval of the point "
             "minus the best, seed by seed (the seed is the same batch order at every point); the "
             "best is picked from these same runs, which leans the intervals away from zero.",
             "", "| point | val loss (mean) | per seed | seed spread | - best | best resolved? | "
             "paired 95% interval (- best) |", "|---|---|---|---|---|---|---|"]
    best_seeds = summary["best"]["val_loss_per_seed"]
    for p in summary["points"]:
        s, best = p["seed_spread"], p["name"] == summary["best"]["name"]
        gains = [v - best_seeds[k] for k, v in p["val_loss_per_seed"].items() if k in best_seeds]
        lines.append(f"| {p['name']} | {p['val_loss']:.4f} | "
                     f"{', '.join(f'{x:.4f}' for x in p['val_loss_per_seed'].values())} | "
                     f"{'-' if s is None else f'{s:.4f}'} | {p['vs_best']:+.4f} | "
                     f"{'best' if best else 'yes' if p['resolved_vs_best'] else 'no'} | "
                     f"{'-' if best else interval_text(paired_interval(gains))} |")
    return "\n".join(lines + ["", f"![{summary['kind']}]({summary['kind']}.png)", ""])


def _plot(summary: dict[str, Any], path: Path) -> None:
    pts = summary["points"]
    fig, ax = subplots(figsize=(6, 4))
    key = "x" if summary["kind"] == "allocation" else "slots"
    xs = [p[key] for p in pts]
    n_seeds = max(len(p.get("val_loss_per_seed", {})) for p in pts)
    ax.plot(xs, [p["val_loss"] for p in pts], "o-", color="tab:red",
            label=f"mean of {n_seeds} seeds" if n_seeds > 1 else None)
    if n_seeds > 1:  # each seed's run, so the spread is visible next to the trend
        for p, x in zip(pts, xs):
            seeds = list(p["val_loss_per_seed"].values())
            ax.scatter([x] * len(seeds), seeds, s=12, color="0.45", zorder=3)
        ax.scatter([], [], s=12, color="0.45", label="single runs")
        ax.legend(fontsize=8)
    if summary["kind"] == "allocation":
        ax.set_xlabel("rho: share of the sparse budget given to routed experts")
        ax.set_title("validation loss vs allocation (equal total and active params)")
    else:
        ax.set_xscale("log")
        ax.set_xlabel("Engram table slots (rows)")
        ax.set_title("validation loss vs table slots (fixed backbone)")
    ax.set_ylabel("validation loss (nats)")
    ax.grid(alpha=0.3)
    save(fig, path)
