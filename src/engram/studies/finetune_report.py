"""What ``engram finetune-study`` reports over seeds: per method the gain, the forgetting and the
speed with their seed spreads, the verdicts of Engram vs LoRA by the project's rule (common.RULE),
and the figures and text of a study and of one seed's run (studies/finetune.py runs them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .common import RESOLVE, RULE, largest_spread, resolved, seed_spread


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"mean": float(np.mean(xs)), "per_seed": [float(x) for x in xs],
            "spread": seed_spread(xs)}


def verdict(diff: float, spread: float | None) -> str:
    """Engram - LoRA judged by the project's rule (common.RULE)."""
    if spread is None:
        return "a method with one seed: not judged"
    who = "Engram lower" if diff < 0 else "LoRA lower"
    if resolved(diff, spread):
        return f"resolved: {who} by {abs(diff):.4f} > {RESOLVE:g}x the largest seed spread {spread:.4f}"
    return f"not resolved: |{diff:+.4f}| <= {RESOLVE:g}x the largest seed spread {spread:.4f}"


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method the mean, per-seed values and seed spread of the gain (held-out loss change on
    the fine-tuning text), the forgetting (loss change on each other source) and tokens/s; the
    verdicts of Engram vs LoRA on each."""
    sets = list(runs[0]["before"])
    ft, forget = sets[0], sets[1:]
    out: dict[str, Any] = {}
    # A run stopped after its first method still counts for that method (its seeds are listed).
    for m in dict.fromkeys(m for r in runs for m in r["methods"]):
        have = [r for r in runs if m in r["methods"]]
        ms = [r["methods"][m] for r in have]
        out[m] = {"seeds": [r["seed"] for r in have],
                  "gain": _stats([x["delta"][ft] for x in ms]),
                  "forgetting": {s: _stats([x["delta"][s] for x in ms]) for s in forget},
                  "tokens_per_second": _stats([x["tokens_per_second"] for x in ms]),
                  "tokens_per_cpu_second": _stats([_tokens_per_cpu_second(x, r)
                                                   for x, r in zip(ms, have)]),
                  "trainable_params": ms[0]["trainable_params"]}
    verdicts = {}
    if {"engram", "lora"} <= set(out):
        e, l = out["engram"], out["lora"]
        pairs = [("gain", e["gain"], l["gain"])] + \
            [(f"forgetting:{s}", e["forgetting"][s], l["forgetting"][s]) for s in forget] + \
            [("tokens_per_cpu_second", e["tokens_per_cpu_second"], l["tokens_per_cpu_second"])]
        for name, a, b in pairs:
            # One seed resolves nothing (common.RULE): both need a spread.
            spread = None if None in (a["spread"], b["spread"]) else \
                largest_spread([a["spread"], b["spread"]])
            diff = a["mean"] - b["mean"]
            verdicts[name] = {"engram_minus_lora": diff, "largest_seed_spread": spread,
                              "resolved": resolved(diff, spread), "verdict": verdict(diff, spread)}
    return {"seeds": [r["seed"] for r in runs], "finetune_set": ft, "forget_sets": forget,
            "methods": out, "verdicts": verdicts, "rule": RULE}


def _tokens_per_cpu_second(stats: dict[str, Any], run: dict[str, Any]) -> float:
    """Tokens per CPU second (all threads): less dependent on the neighbours than wall time."""
    cfg = run["config"]
    return cfg["steps"] * cfg["batch_size"] * cfg["seq_len"] / stats["train_cpu_seconds"]


def plot_study(study: dict[str, Any], path: Path) -> None:
    """Gain and forgetting per method, each seed a dot on its mean's bar; training tokens per CPU
    second beside (wall time on a shared machine says more about the neighbours)."""
    from .common import save, subplots

    colors = {"engram": "tab:red", "lora": "tab:blue"}
    ms = study["methods"]
    panels = [("gain", study["finetune_set"])] + [(f"forgetting:{s}", s)
                                                   for s in study["forget_sets"]]
    fig, axes = subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 4))
    for ax, (key, label) in zip(axes, panels):
        for i, (name, m) in enumerate(ms.items()):
            st = m["gain"] if key == "gain" else m["forgetting"][label]
            ax.bar(i, st["mean"], color=colors.get(name), alpha=0.6, label=name)
            ax.scatter([i] * len(st["per_seed"]), st["per_seed"], color="k", s=12, zorder=3)
        v = study["verdicts"].get(key, {}).get("verdict", "")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xticks(range(len(ms)), list(ms))
        ax.set_title(f"{'gain' if key == 'gain' else 'forgetting'}: {label}\n{v.split(':')[0]}",
                     fontsize=9)
        ax.set_ylabel("held-out loss change (nats)")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for i, (name, m) in enumerate(ms.items()):
        st = m["tokens_per_cpu_second"]
        ax.bar(i, st["mean"], color=colors.get(name), alpha=0.6)
        ax.scatter([i] * len(st["per_seed"]), st["per_seed"], color="k", s=12, zorder=3)
    ax.set_xticks(range(len(ms)), list(ms))
    ax.set_ylabel("training tokens per CPU second")
    ax.set_title(f"{len(study['seeds'])} seeds\n{study['cpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    save(fig, path)


def format_study(study: dict[str, Any]) -> str:
    lines = [f"seeds {study['seeds']}"]
    for name, m in study["methods"].items():
        g = m["gain"]
        parts = [f"gain {g['mean']:+.4f} (spread {g['spread'] or 0:.4f})"]
        parts += [f"forgetting {s} {f['mean']:+.4f} (spread {f['spread'] or 0:.4f})"
                  for s, f in m["forgetting"].items()]
        parts.append(f"{m['tokens_per_cpu_second']['mean']:.0f} tokens per CPU second "
                     f"({m['tokens_per_second']['mean']:.0f} tok/s wall)")
        lines.append(f"{name} ({m['trainable_params']:,} trainable): " + "; ".join(parts))
    for k, v in study["verdicts"].items():
        lines.append(f"{k}: {v['verdict']}")
    return "\n".join(lines)


def plot_finetune(summary: dict[str, Any], path: Path) -> None:
    from .common import save, subplots

    colors = {"engram": "tab:red", "lora": "tab:blue", "base": "tab:gray"}
    fig, (ax0, ax1) = subplots(1, 2, figsize=(11, 4))
    for name, m in summary["methods"].items():
        loss = np.array([c["loss"] for c in m["curve"]])
        ema = np.empty_like(loss)
        for i, x in enumerate(loss):  # smoothed: single batches of a few hundred tokens are noisy
            ema[i] = x if i == 0 else 0.8 * ema[i - 1] + 0.2 * x
        ax0.plot(np.arange(1, len(loss) + 1), ema, color=colors.get(name),
                 label=f"{name} ({m['trainable_params'] / 1e6:.2f}M trainable)")
    ax0.set(xlabel="step", ylabel="train loss (nats, EMA)", title="training on the fine-tuning text")
    sets = list(summary["before"])
    bars = [("base", summary["before"])] + [(n, m["after"]) for n, m in summary["methods"].items()]
    width = 0.8 / len(bars)
    for i, (name, vals) in enumerate(bars):
        xs = np.arange(len(sets)) + (i - (len(bars) - 1) / 2) * width
        ax1.bar(xs, [vals[s] for s in sets], width, color=colors.get(name), label=name)
    ax1.set_xticks(np.arange(len(sets)), sets, fontsize=8)
    lo = min(v for _, vals in bars for v in vals.values())
    ax1.set_ylim(bottom=max(0.0, lo - 0.5))
    ax1.set(ylabel="validation loss (nats)", title="held-out loss: fine-tuning text vs forgetting")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path)


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for name, m in summary["methods"].items():
        parts = [f"{k} {summary['before'][k]:.4f} -> {m['after'][k]:.4f} ({m['delta'][k]:+.4f})"
                 for k in summary["before"]]
        lines.append(f"{name}: {m['trainable_params']:,} trainable, {m['train_seconds']:.0f}s "
                     f"({m['train_cpu_seconds']:.0f} CPU s); "
                     + "; ".join(parts))
    return "\n".join(lines)
