"""`engram study-nine`'s summary, plots and report: each of the paper's four findings, checked.

Verdicts are computed from the numbers with fixed rules (never tuned to the paper): finding 1
reproduces when no Nine split is lower than the hashed baseline by a resolved difference
(common.RULE); a flip is the first evaluation after which the seed-mean ``hot_cold_delta`` is <= 0
where it was > 0 before.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..files import publish_text
from .common import RULE, largest_spread, resolved, save, seed_spread, spread_note, subplots
from .report import corpus_name


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def flip_step(steps: list[int], delta: list[float]) -> int | None:
    """First step where delta <= 0 after having been > 0 (None: no flip in the budget)."""
    was_pos = False
    for s, d in zip(steps, delta):
        if d > 0:
            was_pos = True
        elif was_pos:
            return s
    return None


def summarise(results: list[dict], configs: dict, sc, corpus, wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {"configs": {}, "wall_s": wall, "study": _plain(sc.__dict__),
                           "corpus": {"vocab": corpus.vocab_size,
                                      "train_tokens": len(corpus.streams["train"]),
                                      "val_tokens": len(corpus.streams["val"]),
                                      "sources": corpus.sources,
                                      "max_chars": configs[next(iter(configs))].max_chars,
                                      "data": configs[next(iter(configs))].data}}
    for name, cfg in configs.items():
        rs = sorted((r for r in results if r["name"] == name), key=lambda r: r["seed"])
        if not rs:  # an interrupted study: report what finished
            continue
        steps = [h["step"] for h in rs[0]["history"]]
        per_seed_delta = [[h["hot_cold_delta"] for h in r["history"]] for r in rs]
        mean_delta = [statistics.fmean(col) for col in zip(*per_seed_delta)]
        layers = sorted(rs[0]["history"][0]["alpha_hot"], key=int)
        dalpha = {lid: [statistics.fmean(h["alpha_hot"][lid] - h["alpha_cold"][lid]
                                         for h in hs) for hs in zip(*(r["history"] for r in rs))]
                  for lid in layers}
        final = [r["final"]["val_loss"] for r in rs]
        out["configs"][name] = {
            "hot_rows": cfg.hot_rows, "table_size": cfg.table_size,
            "params": rs[0]["params"], "seeds": [r["seed"] for r in rs],
            "val_loss_per_seed": final, "val_loss_mean_sd": _mean_sd(final),
            "seed_spread": seed_spread(final),
            "final_loss_hot": _mean_sd([r["final"]["loss_hot"] for r in rs]),
            "final_loss_cold": _mean_sd([r["final"]["loss_cold"] for r in rs]),
            "final_delta": _mean_sd([r["final"]["hot_cold_delta"] for r in rs]),
            "served_hot_share": rs[0]["final"]["served_hot_share"],
            "ref_hot_share": rs[0]["final"]["hot_share"],
            "steps": steps, "hot_cold_delta_mean": mean_delta,
            "hot_cold_delta_per_seed": per_seed_delta,
            "flip_step_mean_curve": flip_step(steps, mean_delta),
            "flip_step_per_seed": [flip_step(steps, d) for d in per_seed_delta],
            "delta_alpha_mean": dalpha,
            "alpha_buckets": _pool_buckets([r["final"]["alpha_buckets"] for r in rs]),
            "train_s_mean": statistics.fmean(r["train_s"] for r in rs),
            "hot_index": rs[0]["hot_index_bytes"], "history": {str(r["seed"]): r["history"]
                                                               for r in rs}}
    out["findings"] = findings(out["configs"], sc)
    out["max_seed_spread"] = max_spread(out["configs"])
    return out


def max_spread(cfgs: dict[str, dict]) -> float | None:
    """The largest seed spread of final validation loss over the configurations (common.RULE)."""
    return largest_spread(seed_spread(c["val_loss_per_seed"]) for c in cfgs.values())


def _plain(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _pool_buckets(per_seed: list[dict]) -> dict[str, list[dict]]:
    """Alpha buckets summed over seeds: count-weighted loss and hot share."""
    pooled = {}
    for lid in per_seed[0]:
        rows = []
        for i, b0 in enumerate(per_seed[0][lid]):
            n = sum(s[lid][i]["count"] for s in per_seed)
            loss = sum((s[lid][i]["loss"] or 0) * s[lid][i]["count"] for s in per_seed)
            hot = sum((s[lid][i]["hot_share"] or 0) * s[lid][i]["count"] for s in per_seed)
            rows.append({"lo": b0["lo"], "hi": b0["hi"], "count": n,
                         "loss": loss / n if n else None, "hot_share": hot / n if n else None})
        pooled[lid] = rows
    return pooled


def occupied(buckets: list[dict], share: float = 0.01) -> list[dict]:
    """Buckets holding at least ``share`` of the positions (a handful of tokens is noise)."""
    total = sum(b["count"] for b in buckets) or 1
    return [b for b in buckets if b["count"] >= share * total]


def findings(cfgs: dict[str, dict], sc) -> dict[str, Any]:
    names = list(cfgs)
    base, nines = names[0], [n for n in names if n.startswith("nine-")]
    hashes = [n for n in names if n.startswith("hash-")]
    mean = {n: cfgs[n]["val_loss_mean_sd"][0] for n in names}
    spread = max_spread(cfgs)
    f1 = {n: {"diff_vs_" + base: mean[n] - mean[base],
              "resolved": resolved(mean[n] - mean[base], spread),
              "resolved_lower": resolved(mean[n] - mean[base], spread) and mean[n] < mean[base]}
          for n in nines}
    flips = {n: cfgs[n]["flip_step_mean_curve"] for n in names}
    f2 = {"all_start_positive": all(cfgs[n]["hot_cold_delta_mean"][1] > 0 for n in names),
          "flip_steps": flips, "all_flip": all(v is not None for v in flips.values()),
          "delta_first_eval": {n: cfgs[n]["hot_cold_delta_mean"][1] for n in names},
          "delta_min": {n: min(cfgs[n]["hot_cold_delta_mean"][1:]) for n in names},
          "delta_final": {n: cfgs[n]["hot_cold_delta_mean"][-1] for n in names}}
    nine_flips = [flips[n] for n in nines if flips[n] is not None]
    hash_flips = [flips[n] for n in hashes if flips[n] is not None]
    f3 = {"nine_flips": {n: flips[n] for n in nines}, "hash_flips": {n: flips[n] for n in hashes},
          "nine_earlier": (bool(nine_flips) and bool(hash_flips)
                           and max(nine_flips) < min(hash_flips))}
    f4 = {}
    for n in nines[:1] + [base]:
        layers = sorted(cfgs[n]["delta_alpha_mean"], key=int)
        early = {lid: cfgs[n]["delta_alpha_mean"][lid][1] for lid in layers}
        last = {lid: cfgs[n]["delta_alpha_mean"][lid][-1] for lid in layers}
        bk = {lid: occupied(cfgs[n]["alpha_buckets"][lid]) for lid in layers}
        f4[n] = {"delta_alpha_first_eval": early, "delta_alpha_final": last,
                 "high_alpha_bucket": {lid: bk[lid][-1] for lid in layers},
                 "low_alpha_bucket": {lid: bk[lid][0] for lid in layers},
                 # The paper's mismatch: hot favoured by the gate, yet high alpha = higher loss.
                 "gate_favours_hot": {lid: last[lid] > 0 for lid in layers},
                 "high_alpha_higher_loss": {lid: bk[lid][-1]["loss"] > bk[lid][0]["loss"]
                                            for lid in layers}}
    return {"1_collisions_not_bottleneck": f1, "2_flip": f2, "3_nine_flips_earlier": f3,
            "4_gate_mismatch": f4}


# -- outputs -----------------------------------------------------------------------------------------
def write_outputs(summary: dict[str, Any], out: Path) -> None:
    publish_text(out / "nine.json", json.dumps(summary, indent=1))
    plot_all(summary, out)
    publish_text(out / "report.md", report(summary))


def plot_all(summary: dict[str, Any], out: Path) -> None:
    cfgs = summary["configs"]
    names = list(cfgs)
    fig, ax = subplots(figsize=(7, 4))
    for i, n in enumerate(names):
        ys = cfgs[n]["val_loss_per_seed"]
        ax.scatter([i] * len(ys), ys, s=14, alpha=0.6)
        m, s = cfgs[n]["val_loss_mean_sd"]
        ax.errorbar([i], [m], yerr=[s], fmt="o", color="k", capsize=4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("final val loss (nats): seeds, mean +- sd")
    ax.set_title("Finding 1: final loss per configuration")
    save(fig, out / "final_loss.png")

    fig, ax = subplots(figsize=(7, 4))
    for n in names:
        c = cfgs[n]
        line, = ax.plot(c["steps"], c["hot_cold_delta_mean"], label=n)
        if c["flip_step_mean_curve"] is not None:
            ax.axvline(c["flip_step_mean_curve"], color=line.get_color(), ls=":", lw=1)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("hot_cold_delta = loss_cold - loss_hot")
    ax.set_title("Finding 2/3: hot-to-cold flip (dotted: flip step)")
    ax.legend(fontsize=8)
    save(fig, out / "hot_cold_delta.png")

    layers = sorted(cfgs[names[0]]["delta_alpha_mean"], key=int)
    fig, axes = subplots(1, len(layers), figsize=(4 * len(layers), 3.5), squeeze=False)
    for ax, lid in zip(axes[0], layers):
        for n in names:
            ax.plot(cfgs[n]["steps"], cfgs[n]["delta_alpha_mean"][lid], label=n)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_title(f"layer {lid}: alpha_hot - alpha_cold")
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    save(fig, out / "delta_alpha.png")

    fig, axes = subplots(1, len(layers), figsize=(4 * len(layers), 3.5), squeeze=False)
    for ax, lid in zip(axes[0], layers):
        for n in names:
            bk = occupied(cfgs[n]["alpha_buckets"][lid])
            ax.plot([(b["lo"] + b["hi"]) / 2 for b in bk], [b["loss"] for b in bk], "o-", label=n)
        ax.set_title(f"layer {lid}: loss per alpha bucket (>= 1% of tokens)")
        ax.set_xlabel("gate alpha")
    axes[0][0].set_ylabel("mean val loss")
    axes[0][0].legend(fontsize=7)
    save(fig, out / "alpha_buckets.png")


def _pm(ms: tuple[float, float] | list[float]) -> str:
    return f"{ms[0]:.4f} +- {ms[1]:.4f}"


def report(s: dict[str, Any]) -> str:
    cfgs, f = s["configs"], s["findings"]
    names = list(cfgs)
    st = s["study"]
    lines = [
        "# engram study-nine: a collision-free hot tier (arXiv 2601.16531), scaled down", "",
        f"Corpus: {corpus_name(s['corpus'])}; {s['corpus']['train_tokens']:,} training tokens, "
        f"{s['corpus']['val_tokens']:,} validation tokens. Each run: {st['steps']} steps x "
        f"{st['batch_size']} x {st['seq_len']} tokens, seeds {st['seeds']}, Engram layers "
        f"{st['engram_layers']} sharing one table set, n = 2, 3, K = {st['n_head_per_ngram']}. "
        f"A position is hot when one of its n-grams is among the {st['ref_hot_rows']:,} most "
        f"frequent of its order ({cfgs[names[0]]['ref_hot_share']:.1%} of validation positions). "
        f"Wall clock {s['wall_s'] / 60:.1f} min"
        + (f" (this invocation; {s['reused_runs']} finished runs were read back from their "
           "result.json; "
           f"training alone took {sum(c['train_s_mean'] * len(c['seeds']) for c in cfgs.values()) / 60:.1f} "
           "core-minutes)" if s.get("reused_runs") else "") + ".", "",
        "| config | table params | total params | hot slots served | final val loss "
        "(mean +- sd) | loss hot | loss cold | delta | flip step (mean curve; per seed) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        c = cfgs[n]
        lines.append(f"| {n} | {c['params']['table']:,} | {c['params']['total']:,} | "
                     f"{c['served_hot_share']:.1%} | {_pm(c['val_loss_mean_sd'])} | "
                     f"{_pm(c['final_loss_hot'])} | {_pm(c['final_loss_cold'])} | "
                     f"{_pm(c['final_delta'])} | {c['flip_step_mean_curve']}; "
                     f"{c['flip_step_per_seed']} |")
    f1, f2, f3, f4 = (f[k] for k in ("1_collisions_not_bottleneck", "2_flip",
                                     "3_nine_flips_earlier", "4_gate_mismatch"))
    spread = max_spread(cfgs)
    lines += ["", "## The paper's four findings, here", "",
              "**1. Removing collisions does not reliably lower validation loss.** "
              + RULE + spread_note(spread) + " "
              + "; ".join(f"{n}: {v['diff_vs_' + names[0]]:+.4f} nats vs {names[0]} "
                          f"({'resolved' if v['resolved'] else 'not resolved'})"
                          for n, v in f1.items())
              + (". Not judged: one seed resolves nothing." if not spread else
                 ". Reproduces: no Nine split is lower by a resolved difference."
                 if not any(v["resolved_lower"] for v in f1.values()) else
                 ". Does not reproduce: a Nine split is lower by a resolved difference."), "",
              f"**2. Hot-to-cold flip.** delta starts positive in every configuration: "
              f"{f2['all_start_positive']}; seed-mean delta at the first evaluation -> its "
              "minimum -> the last: "
              + ", ".join(f"{n} {f2['delta_first_eval'][n]:+.3f} -> {f2['delta_min'][n]:+.3f} -> "
                          f"{f2['delta_final'][n]:+.3f}" for n in names)
              + f"; flip step within {st['steps']} steps: "
              + ", ".join(f"{n} {v}" for n, v in f2["flip_steps"].items())
              + (". Reproduces." if f2["all_start_positive"] and f2["all_flip"] else
                 ". Does not reproduce in this budget."), "",
              f"**3. Collision-free configurations flip earlier.** Nine: {f3['nine_flips']}; "
              f"hashed: {f3['hash_flips']}. "
              + ("Reproduces." if f3["nine_earlier"] else
                 "Not shown here (needs a flip in every configuration, Nine first)."), ""]
    lines.append("**4. Gate mismatch.** alpha_hot - alpha_cold per layer (first evaluation -> "
                 "last), and the highest vs lowest alpha bucket holding >= 1% of the tokens "
                 "(loss, hot share):")
    lines.append("")
    for n, v in f4.items():
        for lid in sorted(v["delta_alpha_final"], key=int):
            hi, lo = v["high_alpha_bucket"][lid], v["low_alpha_bucket"][lid]
            lines.append(f"- {n}, layer {lid}: {v['delta_alpha_first_eval'][lid]:+.4f} -> "
                         f"{v['delta_alpha_final'][lid]:+.4f}; alpha {hi['lo']:.1f}-{hi['hi']:.1f}: "
                         f"loss {hi['loss']:.3f}, {hi['hot_share']:.0%} hot; alpha "
                         f"{lo['lo']:.1f}-{lo['hi']:.1f}: loss {lo['loss']:.3f}, "
                         f"{lo['hot_share']:.0%} hot")
    fav = all(all(v["gate_favours_hot"].values()) for v in f4.values())
    worse = [f"{n} layer {lid}" for n, v in f4.items()
             for lid, w in v["high_alpha_higher_loss"].items() if w]
    lines += ["", ("The gate favours hot positions in every layer at the end. " if fav else
                   "The gate does not favour hot positions in every layer. ")
              + ("Higher-alpha buckets have the higher loss in: " + ", ".join(worse)
                 + "." if worse else "The high-alpha bucket has the lower loss in every layer, "
                 "so gate and loss agree here:")
              + (" the mismatch reproduces where both hold after a flip." if worse and fav and
                 f2["all_flip"] else " the paper's mismatch (high alpha, higher loss, after the "
                 "flip) does not reproduce in this budget.")]
    for n in list(f4):
        bks = cfgs[n]["alpha_buckets"]
        layers = sorted(bks, key=int)
        lines += ["", f"Alpha buckets of {n} (seeds pooled, final evaluation): loss / hot share / "
                  "share of tokens", "", "| alpha | " + " | ".join(f"layer {lid}" for lid in layers)
                  + " |", "|---|" + "---|" * len(layers)]
        for i, b in enumerate(bks[layers[0]]):
            cells = []
            for lid in layers:
                c = bks[lid][i]
                tot = sum(x["count"] for x in bks[lid]) or 1
                cells.append("-" if not c["count"] else f"{c['loss']:.3f} / {c['hot_share']:.0%} / "
                             f"{c['count'] / tot:.1%}")
            lines.append(f"| {b['lo']:.1f}-{b['hi']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "Plots: `final_loss.png`, `hot_cold_delta.png`, `delta_alpha.png`, "
              "`alpha_buckets.png`; every number above is in `nine.json`.", ""]
    return "\n".join(lines)
