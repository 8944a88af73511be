"""`engram ablate`: which parts of Engram matter (paper section 6.1, table 5), at the compare budget.

Every variant starts from compare's Engram model (FFN trimmed to dense's activated parameters,
tables at layer 1) and changes one thing:

- placement: one module at each layer, and the same table budget split over layers 1 and 2
  (paper: one module is best early, at layer 2; split over layers 2 and 6 is better still);
- no tokenizer compression (raw ids are hashed), gate fixed at 1 (no context-aware gating), no short
  conv (paper: the conv costs little);
- hyper-connections (2 branches) with per-branch keys, and the same with one shared key (paper:
  branch-specific fusion matters);
- orders {2,3,4} at equal table rows (paper: 4-grams slightly worse at a fixed budget);
- the controls of "is it the memory?" (studies/compare.py ``ARMS``): capacity 1 (``pathway``),
  keyed on the current token alone, frozen tables (with and without a learned gain per head), and
  the community's hashed bigram table at the input.

Each variant runs for every seed; same seed = same batch order, so differences are paired by seed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import publish_text
from ..training.corpus import build_corpus
from ..training.train import TrainConfig
from .common import job, largest_spread, run_jobs, seed_spread, train_run
from .compare import ARMS, StudyBudget, budget, counts, variant_configs

# name -> (what it changes, the paper's expectation relative to the reference)
VARIANTS: dict[str, tuple[str, str]] = {
    "reference": ("compare's Engram model: one module at layer 1, {2,3}-grams, per-layer gate, "
                  "short conv, compression", ""),
    "layer0": ("the module at layer 0 instead of 1", "an early layer is best for one module"),
    "layer2": ("the module at layer 2", "an early layer is best for one module"),
    "layer3": ("the module at layer 3 (the last)", "an early layer is best for one module"),
    "split12": ("half the rows at layer 1, half at layer 2", "splitting over two layers is better"),
    "no-compress": ("raw token ids hashed (no tokenizer compression)", "compression matters"),
    "gate1": ("gate fixed at 1: no keys, no context-aware gating", "the gate matters"),
    "no-conv": ("no short convolution", "removing the conv costs little"),
    "hc2": ("2 hyper-connection branches, per-branch keys (the reference for hc2-shared-key)",
            ""),
    "hc2-shared-key": ("2 hyper-connection branches, one shared key", "branch-specific keys "
                       "matter (vs hc2)"),
    "orders234": ("{2,3,4}-grams, table rows per order cut to 2/3 (equal total rows)",
                  "4-grams slightly worse at a fixed budget"),
    # the controls: what the memory's rows are worth beside the pathway that comes with them
    "pathway": (ARMS["pathway"], "no identity: worse, if the memory carries the gain"),
    "unigram": (ARMS["unigram"], "no n-gram context: worse, if n-grams matter"),
    "frozen": (ARMS["frozen"], "untrained rows: worse (arXiv 2605.13179: barely, in vision)"),
    "frozen-scaled": (ARMS["frozen-scaled"], "fixed random features at a learned scale"),
    "bigram-hash": (ARMS["bigram-hash"], "parameter-golf #1369: a hashed bigram beat Engram"),
}
CONTROLS = ("pathway", "unigram", "frozen", "frozen-scaled", "bigram-hash")


@dataclass
class AblateConfig(StudyBudget):
    out_dir: str = "out/ablate"  # ablate.json, ablate.png, report.md
    # which variants to train (reference always runs)
    variants: tuple[str, ...] = field(default=tuple(VARIANTS),
                                      metadata={"choices": "engram.studies.ablate:VARIANTS"})


def ablation_configs(base: TrainConfig, vocab: int) -> dict[str, TrainConfig]:
    """One config per variant name (see VARIANTS); only the named thing differs."""
    arms = variant_configs(base, vocab, ("engram", *CONTROLS))
    ref = arms["engram"]

    def r(**changes: Any) -> TrainConfig:
        return dataclasses.replace(ref, **changes)

    return {
        "reference": ref,
        "layer0": r(engram_layers=(0,)), "layer2": r(engram_layers=(2,)),
        "layer3": r(engram_layers=(min(3, ref.n_layer - 1),)),
        "split12": r(engram_layers=(1, 2), table_size=max(2, ref.table_size // 2)),
        "no-compress": r(compress=False),
        "gate1": r(engram_fixed_gate=True),
        "no-conv": r(engram_conv=False),
        "hc2": r(hc_mult=2),
        "hc2-shared-key": r(hc_mult=2, engram_shared_key=True),
        "orders234": r(max_ngram_size=4, table_size=max(2, round(ref.table_size * 2 / 3))),
        **{name: arms[name] for name in CONTROLS},
    }


def run_ablate(ac: AblateConfig, base: TrainConfig | None = None) -> dict[str, Any]:
    unknown = sorted(set(ac.variants) - set(VARIANTS))
    if unknown:
        raise UserError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    out = Path(ac.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = budget(base or TrainConfig(), ac)
    t0 = time.perf_counter()
    corpus = build_corpus(base.data_config())
    configs = ablation_configs(base, corpus.vocab_size)
    names = ["reference"] + [n for n in ac.variants if n != "reference"]
    if "hc2-shared-key" in names and "hc2" not in names:
        names.append("hc2")  # its reference
    # hyper-connection runs are slowest: first, so the workers finish together
    order = sorted(names, key=lambda n: not n.startswith("hc2"))
    jobs = [job(n, configs[n], s, out / "runs") for n in order for s in ac.seeds]
    results = run_jobs(jobs, train_run, ac.workers, "ablation runs")
    summary = summarise(results, {n: configs[n] for n in names}, corpus.vocab_size,
                        time.perf_counter() - t0, ac)
    publish_text(out / "ablate.json", json.dumps(summary, indent=2))
    from .ablate_report import plot_ablation, write_ablation_report

    plot_ablation(summary, out / "ablate.png")
    write_ablation_report(summary, out / "report.md")
    return summary


def summarise(results: list[dict], configs: dict[str, TrainConfig], vocab: int, wall: float,
              ac: AblateConfig) -> dict[str, Any]:
    by = {n: sorted((r for r in results if r["name"] == n), key=lambda r: r["seed"])
          for n in configs}
    ref = {r["seed"]: r["val_loss"] for r in by["reference"]}
    hc = {r["seed"]: r["val_loss"] for r in by.get("hc2", [])}
    spreads = {n: seed_spread(r["val_loss"] for r in rs) for n, rs in by.items()}
    variants = {}
    for n, rs in by.items():
        base = hc if n == "hc2-shared-key" else ref
        losses = [r["val_loss"] for r in rs]
        paired = [r["val_loss"] - base[r["seed"]] for r in rs if r["seed"] in base]
        variants[n] = {
            "what": VARIANTS[n][0], "paper": VARIANTS[n][1],
            "compared_with": "hc2" if n == "hc2-shared-key" else "reference",
            "val_loss": sum(losses) / len(losses), "val_loss_per_seed": losses,
            "seed_spread": spreads[n], "delta_per_seed": paired,
            "delta": sum(paired) / len(paired) if paired else None,
            "params": counts(configs[n], vocab), "wall_s": sum(r["wall_s"] for r in rs),
            "config": {k: v for k, v in configs[n].to_dict().items()
                       if k in ("engram_layers", "table_size", "max_ngram_size", "compress",
                                "engram_fixed_gate", "engram_conv", "hc_mult",
                                "engram_shared_key", "d_ff", "engram_lookup", "freeze_tables",
                                "engram_head_gain", "n_head_per_ngram", "table_lr_mult")}}
    return {"variants": variants, "max_seed_spread": largest_spread(spreads.values()),
            "seeds": list(ac.seeds), "steps": ac.steps,
            "tokens_per_run": ac.steps * ac.batch_size * ac.seq_len, "wall_s": wall}
