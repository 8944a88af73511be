"""What people would rather see than read: loss curves, a gate heatmap, a markdown report."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import torch

from ..files import publish_text
from ..retrieval.compress import default_tokenizer
from ..training.batches import val_batches
from .common import RULE, figure, largest_spread, resolved, save, spread_note, subplots
from .evidence import interval_text


def plot_losses(results: list[dict], path: Path) -> None:
    """Train and validation loss against tokens: per variant the mean over seeds, with a band from
    the lowest to the highest seed (one line alone for one seed)."""
    fig, axes = subplots(1, 2, figsize=(11, 4))
    colors = {"dense": "tab:gray", "engram": "tab:red", "moe": "tab:blue", "pathway": "tab:green",
              "unigram": "tab:orange", "frozen": "tab:purple", "frozen-scaled": "tab:brown",
              "bigram-hash": "tab:olive"}
    for name in sorted({r["name"] for r in results}):
        rs = [r for r in results if r["name"] == name]
        for ax, key in zip(axes, ("loss", "val_loss")):
            curves = [[(x["tokens"], x[key]) for x in r["history"] if key in x and "tokens" in x]
                      for r in rs]
            n = min(len(c) for c in curves)
            if n == 0:
                continue
            tokens = [curves[0][i][0] for i in range(n)]
            ys = [[c[i][1] for c in curves] for i in range(n)]  # [point][seed]
            ax.plot(tokens, [sum(y) / len(y) for y in ys], "-o" if key == "val_loss" else "-",
                    color=colors.get(name), markersize=3,
                    label=f"{name} (mean of {len(rs)} seed{'s' * (len(rs) > 1)})")
            if len(rs) > 1:
                ax.fill_between(tokens, [min(y) for y in ys], [max(y) for y in ys],
                                color=colors.get(name), alpha=0.2, linewidth=0)
    for ax, title in zip(axes, ("train loss", "validation loss (band: lowest to highest seed)")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("cross entropy (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


@torch.no_grad()
def render_gates(run, corpus, html_path: Path, png_path: Path | None = None,
                 n_windows: int = 4, seq_len: int = 64) -> dict[str, Any]:
    """Validation text with each token shaded by its Engram gate (paper figure: which tokens open
    the gate). Returns summary statistics of the gates."""
    tok = default_tokenizer()
    model = run.model.eval()
    seq_len = min(seq_len, run.cfg.seq_len)
    # Windows spread over the validation stream, so both languages show up.
    batch = next(val_batches(corpus.streams["val"], 512, seq_len, corpus, run.hasher, max_batches=1))
    # Half the windows from each script (English / Chinese), evenly spread within it.
    is_latin = torch.tensor([_latin(tok.decode(w.tolist())) for w in batch.raw])
    groups = [torch.nonzero(is_latin == flag).squeeze(1) for flag in (True, False)]
    groups = [g for g in groups if len(g)]
    pick = torch.cat([g[torch.linspace(0, len(g) - 1, -(-n_windows // len(groups))).long()]
                      for g in groups])[:n_windows]
    dev = next(model.parameters()).device  # a run trained with --device cuda
    out = model(batch.inputs[pick].to(dev), {k: v[pick].to(dev) for k, v in batch.hash_ids.items()},
                return_gates=True)
    layer = sorted(out.gates)[0]
    gates = out.gates[layer].mean(-1).float().cpu()  # [n, t]: mean over branches
    raw = batch.raw[pick]
    rows, texts = [], []
    for i in range(len(pick)):
        spans = []
        texts.append(["<eos>" if int(r) == corpus.eos_id else tok.decode([int(r)])
                      for r in raw[i]])
        for t, text in enumerate(texts[-1]):
            g = float(gates[i, t])
            spans.append(f'<span title="{g:.3f}" style="background: rgba(220,40,40,{g:.3f})">'
                         f"{html.escape(text).replace(chr(10), '&#8629;<br>')}</span>")
        rows.append(f"<p>{''.join(spans)}</p>")
    publish_text(html_path,
        "<!doctype html><meta charset='utf-8'><title>Engram gates</title>"
        "<style>body{font:15px/1.9 sans-serif;max-width:60em;margin:2em auto}"
        "span{padding:1px 0}</style>"
        f"<h2>Engram gate alpha at layer {layer} (darker = gate open)</h2>{''.join(rows)}")
    if png_path is not None:
        _gates_png(gates, texts, png_path, layer)
    flat = gates.flatten()
    top = torch.topk(flat, 10).indices
    return {"layer": layer, "mean": float(flat.mean()), "std": float(flat.std()),
            "top_tokens": [tok.decode([int(raw.flatten()[j])]) for j in top]}


def _latin(text: str) -> bool:
    return all(ord(c) < 0x250 for c in text)


def _gates_png(gates: torch.Tensor, texts: list[list[str]], path: Path, layer: int) -> None:
    """Top: Latin-script windows as text, each token on its gate's shade (the paper's figure);
    bottom: every window as a heatmap. Matplotlib's stock fonts have no CJK glyphs, so Chinese
    windows appear in the heatmap and in gates.html only."""
    latin = [i for i, ws in enumerate(texts) if _latin("".join(ws))]
    fig = figure(figsize=(11, 2.2 + 1.1 * len(latin) + 0.4 * gates.shape[0]))
    grid = fig.add_gridspec(2, 1, height_ratios=[max(1, 1.1 * len(latin)), 1 + 0.4 * gates.shape[0]])
    ax = fig.add_subplot(grid[0])
    ax.set_axis_off()
    ax.set_title(f"Engram gate alpha at layer {layer}: darker = gate open")
    renderer, box = fig.canvas.get_renderer(), ax.get_window_extent()
    line = 0.3 / max(1, len(latin))  # axes fraction per text line
    y = 0.98
    for i in latin:
        x = 0.0
        for word, g in zip(texts[i], gates[i].tolist()):
            word = word.replace("\n", "\u21b5").replace("$", r"\$")
            t = ax.text(x, y, word, fontsize=9, va="top", transform=ax.transAxes,
                        bbox=dict(boxstyle="square,pad=0.15", ec="none",
                                  fc=(0.86, 0.16, 0.16, 0.85 * g)))  # as gates.html shades
            width = t.get_window_extent(renderer).width / box.width
            if x + width > 1.0 and x > 0:
                x, y = 0.0, y - line
                t.set_position((x, y))
            x += width
        y -= 1.5 * line
    hm = fig.add_subplot(grid[1])
    im = hm.imshow(gates.numpy(), aspect="auto", cmap="Reds", vmin=0, vmax=1)
    hm.set_xlabel("position")
    hm.set_ylabel("validation window")
    fig.colorbar(im, ax=hm)
    save(fig, path, dpi=110)


SOURCE_NAMES = {"kjv": "King James Bible", "peoples-daily": "People's Daily 1998",
                "python-doc": "Python docs", "linux-doc": "Linux kernel docs"}


def corpus_name(corpus: dict[str, Any]) -> str:
    """What the runs actually read, e.g. "King James Bible + People's Daily 1998"."""
    names = [SOURCE_NAMES.get(s, s) for s in corpus.get("sources", [])] or ["unknown sources"]
    if corpus.get("data"):
        return f"the corpus prepared in {corpus['data']} ({', '.join(names)})"
    cap = corpus.get("max_chars")
    return " + ".join(names) + (f", first {cap:,} characters of each" if cap else "")


def _paired(gains: list[float]) -> str:
    """', mean +- sd, positive in k of n seeds' for two or more paired gains."""
    if len(gains) < 2:
        return ""
    mean = sum(gains) / len(gains)
    sd = (sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)) ** 0.5
    return (f" (mean {mean:+.4f} +- {sd:.4f} sd; positive in {sum(g > 0 for g in gains)} of "
            f"{len(gains)} seeds)")


def _timing(t: dict[str, Any] | None) -> str:
    """The wall time's context: the estimate made before the runs, the CPUs' use, the load."""
    if not t:
        return ""
    est = (f"{t['estimate']['total_s']:.0f} s estimated before the runs, "
           f"{t['wall_over_estimate']:.2f}x; " if "estimate" in t else "")
    load = t["load_avg"]
    return (f" ({est}the runs used {t['cpu_utilisation']:.0%} of {min(t['cpus'], t['workers'])} "
            f"CPUs; load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the "
            "end)")


def write_report(summary: dict[str, Any], path: Path) -> None:
    runs = summary["runs"]
    lines = ["# engram compare", "",
             f"Corpus: {summary['corpus']['train_tokens']:,} train / "
             f"{summary['corpus']['val_tokens']:,} validation tokens ({corpus_name(summary['corpus'])}), model "
             f"vocabulary {summary['corpus']['vocab']:,} ids; wall time {summary['wall_s']:.0f} s"
             + _timing(summary.get("time")) + ".", "",
             *([f"Machine: {m['cpu'] or 'unknown CPU'}; matrix products through {m['gemm']} "
                "(engram/compute/gemm.py, ENGRAM_GEMM).", ""] if (m := summary.get("machine")) else []),
             "| run | val loss (mean) | per seed | seed spread | total params | active params | "
             "table params | tokens | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        spread = summary["noise_seed_spread"][name]
        lines.append(
            f"| {name} | {r['val_loss']:.4f} | {', '.join(f'{x:.4f}' for x in r['val_loss_per_seed'])}"
            f" | {spread if spread is None else f'{spread:.4f}'} | {r['total_params']:,} | "
            f"{r['active_params']:,} | {r['table_params']:,} | {r['tokens']:,} | "
            f"{r['tokens_per_s']:,.0f} |")
    gain, vs_moe = summary["engram_gain_vs_dense"], summary["engram_gain_vs_moe"]
    ratio = summary["gain_over_max_noise"]
    # The main comparison's spread: its own arms' (a control's spread judges its own verdicts).
    spread = largest_spread(v for k, v in summary["noise_seed_spread"].items()
                            if k in ("dense", "engram", "moe"))

    def said(difference: float) -> str:
        return "resolved" if resolved(difference, spread) else "not resolved"

    lines += ["", "## What it shows", "",
              RULE + spread_note(spread),
              "",
              f"- Engram vs dense at equal activated parameters: validation loss "
              f"{'lower' if gain > 0 else 'higher'} by {abs(gain):.4f} nats, "
              f"{'' if ratio is None else f'{ratio:.1f}x '}the largest seed spread: "
              f"{said(gain)}.",
              f"- Paired by seed (same batch order): Engram's gain over dense is "
              f"{', '.join(f'{g:+.4f}' for g in summary.get('engram_gain_per_seed', []))} nats"
              f"{_paired(summary.get('engram_gain_per_seed', []))}.",
              *_interval_line("Engram's gain over dense", summary, "engram_vs_dense"),
              *([] if vs_moe is None else [
                  f"- Engram vs MoE at equal total parameters: Engram is "
                  f"{'better' if vs_moe > 0 else 'worse'} by {abs(vs_moe):.4f} nats: "
                  f"{said(vs_moe)}.",
                  *_interval_line("Engram's gain over MoE", summary, "engram_vs_moe")]),
              *_reach_lines(summary),
              "- The tables are the only extra parameters of the Engram model and are updated "
              "sparsely (RowAdam, 5x learning rate, no weight decay).",
              f"- Gates (layer {summary.get('gates', {}).get('layer')}): mean "
              f"{summary.get('gates', {}).get('mean', float('nan')):.3f}; see gates.html / gates.png.",
              *_split_lines(summary), *_control_lines(summary),
              "", "![losses](loss.png)", ""]
    publish_text(path, "\n".join(lines))


def _difference_text(d: dict[str, Any]) -> str:
    """One control difference (compare.difference) as the report says it."""
    over = "" if d["over_spread"] is None else f", {abs(d['over_spread']):.1f}x its arms' spread"
    return (f"{d['mean']:+.4f} nats (per seed {', '.join(f'{x:+.4f}' for x in d['per_seed'])}"
            f"{over}): {'resolved' if d['resolved'] else 'not resolved'} by the rule; paired "
            f"95% interval {interval_text(d['interval'], ' nats')}")


def _power_text(d: dict[str, Any]) -> str:
    """What an unresolved difference would need (compare.difference's seeds_needed)."""
    need = d.get("seeds_needed") or {}
    parts = []
    if not (d["interval"] or {}).get("excludes_zero") and "paired_interval_seeds" in need:
        n = need["paired_interval_seeds"]
        parts.append("the paired interval would exclude zero with "
                     + (f"{n} seeds" if n else "more than 20 seeds"))
    if not d["resolved"] and "rule_run_sd_measured" in need:
        parts.append(f"the rule needs a run-to-run sd below "
                     f"{need['rule_run_sd_needed_at_3_seeds']:.4f} nats at 3 seeds (measured "
                     f"{need['rule_run_sd_measured']:.4f})")
    return "" if not parts else " (at this effect and spread: " + "; ".join(parts) + ")"


def _split_lines(summary: dict[str, Any]) -> list[str]:
    """Is it the memory? Engram's gain split at the capacity-1 control (compare.split_gain)."""
    sp = summary.get("split")
    if sp is None:
        return []
    share = sp["memory_share"]
    share_text = ("undefined (" + share["why"] + ")" if share["low"] is None else
                  f"{share['estimate']:.2f}, Fieller 95% interval [{share['low']:.2f}, "
                  f"{share['high']:.2f}]")
    return ["", "## Is it the memory?", "",
            "`pathway` is Engram's module at capacity 1: one row per head, read at every position, "
            "so no token or n-gram identity reaches it (a gated constant plus the trimmed FFN). "
            "Engram's gain over dense splits into what that pathway gives and what the memory's "
            "rows add; each part is judged by the rule over its own two arms' spreads.", "",
            f"- The pathway (dense - pathway): {_difference_text(sp['pathway'])}"
            f"{_power_text(sp['pathway'])}.",
            f"- The memory (pathway - engram): {_difference_text(sp['memory'])}"
            f"{_power_text(sp['memory'])}.",
            f"- The memory's share of the gain: {share_text}.",
            f"- The memory carries the gain ({sp['criterion']}): "
            f"**{'yes' if sp['memory_carries_gain'] else 'no'}**{_unmet(sp)}."]


def _unmet(sp: dict[str, Any]) -> str:
    """Which parts of the criterion a split missed (empty when it met them all)."""
    mem, share = sp["memory"], sp["memory_share"]["estimate"]
    why = [w for w, missed in (
        ("the memory's part is not a gain: its rows cost loss", mem["mean"] <= 0),
        (f"the memory's part is {abs(mem['over_spread'] or 0):.1f}x its arms' spread, under the "
         "rule's 2x", not mem["resolved"]),
        ("its paired interval includes zero", not (mem["interval"] or {}).get("excludes_zero")),
        ("its share is under 0.5", share is None or share < 0.5)) if missed]
    return "" if not why else ": " + "; ".join(why)


def _control_lines(summary: dict[str, Any]) -> list[str]:
    controls = summary.get("controls") or {}
    if not controls:
        return []
    return ["", "## Other controls (each arm - engram; positive: worse than Engram)", "",
            *(f"- {arm}: {_difference_text(d)}{_power_text(d)}." for arm, d in controls.items())]


def _interval_line(what: str, summary: dict[str, Any], key: str) -> list[str]:
    """The paired 95% interval's verdict, beside the rule's."""
    i = (summary.get("paired_interval") or {}).get(key)
    if i is None:
        return []
    return [f"- {what}, paired 95% interval over {i['seeds']} seeds: {i['mean']:+.4f} "
            f"{interval_text(i, ' nats')}."]


def _reach_lines(summary: dict[str, Any]) -> list[str]:
    """Tokens to target, and what the verdicts would need at the measured effect and spread."""
    out = []
    for name, f in (summary.get("tokens_to_target") or {}).items():
        out.append(f"- Tokens to target: {name} reached dense's final validation loss "
                   + ("within its budget: never." if f is None else
                      f"at {f:.0%} of dense's tokens ({1 / f:.2f}x fewer)." if f > 0 else
                      "at its first evaluation."))
    need = summary.get("seeds_needed") or {}
    if "paired_interval_seeds" in need:
        n = need["paired_interval_seeds"]
        out.append("- At this effect and spread the paired interval would exclude zero with "
                   + (f"{n} seeds." if n else "more than 20 seeds."))
    if "rule_run_sd_measured" in need:
        out.append(f"- The rule's spread grows with the number of seeds, so seeds alone cannot "
                   f"resolve it: it needs a run-to-run sd below "
                   f"{need['rule_run_sd_needed_at_3_seeds']:.4f} nats at 3 seeds (measured "
                   f"{need['rule_run_sd_measured']:.4f}).")
    return out
