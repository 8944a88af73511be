"""`engram ablate`'s outputs: a bar chart of validation loss per variant and a report with verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files import publish_text
from .common import RESOLVE, RULE, largest_spread, resolved, save, spread_note, subplots
from .evidence import interval_text, paired_interval


def plot_ablation(summary: dict[str, Any], path: Path) -> None:
    vs = summary["variants"]
    names = list(vs)
    means = [vs[n]["val_loss"] for n in names]
    lo = [m - min(vs[n]["val_loss_per_seed"]) for n, m in zip(names, means)]
    hi = [max(vs[n]["val_loss_per_seed"]) - m for n, m in zip(names, means)]
    fig, ax = subplots(figsize=(10, 4.2))
    colors = ["tab:red" if n == "reference" else "tab:purple" if n.startswith("hc2")
              else "tab:gray" for n in names]
    ax.bar(range(len(names)), means, yerr=[lo, hi], color=colors, capsize=4, alpha=0.85)
    for i, n in enumerate(names):
        ax.plot([i] * len(vs[n]["val_loss_per_seed"]), vs[n]["val_loss_per_seed"], "k.", ms=4)
    ax.axhline(vs["reference"]["val_loss"], color="tab:red", lw=1, ls="--", label="reference")
    span = max(max(means) - min(means), 1e-3)
    ax.set_ylim(min(means) - 1.5 * span, max(means) + 0.8 * span)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(f"Engram ablations: mean of seeds {summary['seeds']} (dots), bars span the seeds; "
                 f"{summary['steps']} steps")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save(fig, path)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.4f}"


def verdict(delta: float | None, noise: float | None, expect_worse: bool | None,
            whose: str = "the largest seed spread") -> str:
    """A plain word on one claim: ``delta`` = variant - its reference (positive = worse)."""
    if delta is None:
        return "not run"
    if noise is None or noise == 0:
        return "no seed spread to judge by (one seed)"
    if not resolved(delta, noise):
        return f"not resolved: |{delta:+.4f}| <= {RESOLVE:g}x {whose} {noise:.4f}"
    worse = delta > 0
    if expect_worse is None:
        return "worse" if worse else "better"
    return "holds" if worse == expect_worse else "does not hold (opposite sign)"


def claims(summary: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(paper's claim, what we measured, verdict, paired interval) for each claim the variants
    test. The interval is of the per-seed deltas against the reference (the seed is shared, so
    the pairs cancel what a seed does to both): compare's second verdict, beside the rule's,
    never instead of it."""
    vs, noise = summary["variants"], summary["max_seed_spread"]
    d = {n: v["delta"] for n, v in vs.items()}
    out = []
    layers = {n: vs[n]["val_loss"] for n in ("layer0", "reference", "layer2", "layer3") if n in vs}
    if len(layers) > 1:
        best = min(layers, key=layers.get)
        best_name = "layer1 (reference)" if best == "reference" else best
        later = [n for n in ("layer2", "layer3") if n in d]
        judged = min(later, key=d.get) if later else None  # the later layer nearest to winning
        v = verdict(d[judged], noise, True) if judged else "not run"
        out.append(("One module is best at an early layer (paper: layer 2 of the backbone)",
                    "mean val loss by layer: " + ", ".join(f"{k} {x:.4f}" for k, x in
                                                           layers.items()) + f"; best {best_name}",
                    f"later layers worse than layer 1: {v}",
                    f"{judged}: {interval_text(paired_interval(vs[judged]['delta_per_seed']))}"
                    if judged else "-"))
    for name, claim, expect in (
            ("split12", "The same budget split over two layers beats one module", False),
            ("no-compress", "Tokenizer compression matters (removing it hurts)", True),
            ("gate1", "The context-aware gate matters (fixing it at 1 hurts)", True),
            ("no-conv", "Removing the short conv costs little", None),
            ("hc2-shared-key", "Branch-specific keys matter (one shared key hurts)", True),
            ("orders234", "{2,3,4}-grams are slightly worse than {2,3} at equal rows", True)):
        if name not in vs:
            continue
        measured = (f"{name} - {vs[name]['compared_with']}: {_fmt(d[name])} nats "
                    f"(per seed {', '.join(_fmt(x) for x in vs[name]['delta_per_seed'])})")
        v = verdict(d[name], noise, expect)
        if name == "no-conv" and d[name] is not None and noise:
            v = ("holds: the cost is not resolved" if not resolved(d[name], noise)
                 else f"does not hold: a resolved cost of {d[name]:+.4f}" if d[name] > 0
                 else "holds: no cost (resolved, better without)")
        out.append((claim, measured, v, interval_text(paired_interval(vs[name]["delta_per_seed"]))))
    # The controls of "is it the memory?", each judged by its own two arms' spreads (as compare
    # judges its controls), not by the largest over every variant: a control's verdict does not
    # move with which other ablations ran beside it.
    for name, claim in (
            ("pathway", "The memory's rows carry a gain (capacity 1, no identity, is worse)"),
            ("unigram", "N-gram context matters (keyed on the current token alone is worse)"),
            ("frozen", "Trained rows matter (frozen at their random init is worse; arXiv "
                       "2605.13179: barely, in vision)"),
            ("frozen-scaled", "Trained rows matter beyond their scale (frozen, with a learned "
                              "gain per head, is worse)"),
            ("bigram-hash", "Engram beats one hashed bigram table at the input "
                            "(openai/parameter-golf #1369: it did not)")):
        if name not in vs:
            continue
        own = largest_spread([vs[name]["seed_spread"], vs["reference"]["seed_spread"]])
        measured = (f"{name} - reference: {_fmt(d[name])} nats "
                    f"(per seed {', '.join(_fmt(x) for x in vs[name]['delta_per_seed'])})")
        out.append((claim, measured, verdict(d[name], own, True, "its arms' spread"),
                    interval_text(paired_interval(vs[name]["delta_per_seed"]))))
    return out


def write_ablation_report(summary: dict[str, Any], path: Path) -> None:
    vs = summary["variants"]
    lines = ["# engram ablate", "",
             f"{len(vs)} variants x seeds {summary['seeds']}, {summary['steps']} steps "
             f"({summary['tokens_per_run']:,} tokens) per run; wall time {summary['wall_s']:.0f} s. "
             + RULE + spread_note(summary["max_seed_spread"]), "",
             "| variant | what changes | val loss (mean) | per seed | delta vs its reference | "
             "total params | table params | active params |",
             "|---|---|---|---|---|---|---|---|"]
    for n, v in vs.items():
        p = v["params"]
        lines.append(f"| {n} | {v['what']} | {v['val_loss']:.4f} | "
                     f"{', '.join(f'{x:.4f}' for x in v['val_loss_per_seed'])} | "
                     f"{_fmt(v['delta']) if n != 'reference' else '-'} | {p['total']:,} | "
                     f"{p['table']:,} | {p['active']:,} |")
    lines += ["", "## The paper's claims here", "",
              "The verdict is the rule's; the paired 95% interval of the per-seed deltas (the "
              "variant minus its reference, seed by seed; as compare reports) says whether the "
              "sign is supported.", "",
              "| claim | measured | verdict | paired 95% interval |", "|---|---|---|---|"]
    lines += [f"| {c} | {m} | {v} | {i} |" for c, m, v, i in claims(summary)]
    lines += ["", "![ablations](ablate.png)", ""]
    publish_text(path, "\n".join(lines))
