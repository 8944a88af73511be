"""What people would rather see than read: loss curves, a gate heatmap, a markdown report."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import torch

from .compress import default_tokenizer
from .data import val_batches


def plot_losses(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"dense": "tab:gray", "engram": "tab:red", "moe": "tab:blue"}
    for r in sorted(results, key=lambda r: (r["name"], r["seed"])):
        h = r["history"]
        style = "-" if r["seed"] == min(x["seed"] for x in results) else "--"
        label = f"{r['name']} s{r['seed']}"
        axes[0].plot([x["tokens"] for x in h], [x["loss"] for x in h], style,
                     color=colors.get(r["name"]), label=label, alpha=0.8)
        v = [x for x in h if "val_loss" in x]
        axes[1].plot([x["tokens"] for x in v], [x["val_loss"] for x in v], style + "o",
                     color=colors.get(r["name"]), label=label, markersize=3)
    for ax, title in zip(axes, ("train loss", "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("cross entropy (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def render_gates(run, corpus, html_path: Path, png_path: Path | None = None,
                 n_windows: int = 4, seq_len: int = 64) -> dict[str, Any]:
    """Validation text with each token shaded by its Engram gate (paper figure: which tokens open
    the gate). Returns summary statistics of the gates."""
    tok = default_tokenizer()
    model = run.model.eval()
    seq_len = min(seq_len, run.cfg.seq_len)
    # Windows spread over the validation stream, so both languages show up.
    batch = next(val_batches(corpus.val, 512, seq_len, corpus, run.hasher, max_batches=1))
    pick = torch.linspace(0, batch.inputs.shape[0] - 1, n_windows).long()
    out = model(batch.inputs[pick], {k: v[pick] for k, v in batch.hash_ids.items()},
                return_gates=True)
    layer = sorted(out.gates)[0]
    gates = out.gates[layer].mean(-1)  # [n, t]: mean over branches
    raw = batch.raw[pick]
    rows = []
    for i in range(len(pick)):
        spans = []
        for t in range(raw.shape[1]):
            text = tok.decode([int(raw[i, t])], skip_special_tokens=False)
            g = float(gates[i, t])
            spans.append(f'<span title="{g:.3f}" style="background: rgba(220,40,40,{g:.3f})">'
                         f"{html.escape(text).replace(chr(10), '&#8629;<br>')}</span>")
        rows.append(f"<p>{''.join(spans)}</p>")
    html_path.write_text(
        "<!doctype html><meta charset='utf-8'><title>Engram gates</title>"
        "<style>body{font:15px/1.9 sans-serif;max-width:60em;margin:2em auto}"
        "span{padding:1px 0}</style>"
        f"<h2>Engram gate alpha at layer {layer} (darker = gate open)</h2>{''.join(rows)}")
    if png_path is not None:
        _gates_png(gates, png_path, layer)
    flat = gates.flatten()
    top = torch.topk(flat, 10).indices
    return {"layer": layer, "mean": float(flat.mean()), "std": float(flat.std()),
            "top_tokens": [tok.decode([int(raw.flatten()[j])]) for j in top]}


def _gates_png(gates: torch.Tensor, path: Path, layer: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2 + 0.4 * gates.shape[0]))
    im = ax.imshow(gates.numpy(), aspect="auto", cmap="Reds", vmin=0, vmax=1)
    ax.set_xlabel("position")
    ax.set_ylabel("validation window")
    ax.set_title(f"Engram gate alpha, layer {layer} (tokens in gates.html)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(summary: dict[str, Any], path: Path) -> None:
    runs = summary["runs"]
    lines = ["# engram compare", "",
             f"Corpus: {summary['corpus']['train_tokens']:,} train / "
             f"{summary['corpus']['val_tokens']:,} validation tokens (KJV + People's Daily), model "
             f"vocabulary {summary['corpus']['vocab']:,} ids; wall time {summary['wall_s']:.0f} s.", "",
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
    verdict = ("well outside" if ratio is not None and ratio > 3 else "not clearly outside")
    lines += ["", "## What it shows", "",
              f"- Engram vs dense at equal activated parameters: validation loss "
              f"{'lower' if gain > 0 else 'higher'} by {abs(gain):.4f} nats, "
              f"{'' if ratio is None else f'{ratio:.1f}x '}the largest seed-to-seed spread "
              f"({verdict} run-to-run noise).",
              f"- Paired by seed (same batch order): Engram's gain over dense is "
              f"{', '.join(f'{g:+.4f}' for g in summary.get('engram_gain_per_seed', []))} nats.",
              f"- Engram vs MoE at equal total parameters: Engram is "
              f"{'better' if vs_moe > 0 else 'worse'} by {abs(vs_moe):.4f} nats.",
              "- The tables are the only extra parameters of the Engram model and are updated "
              "sparsely (RowAdam, 5x learning rate, no weight decay).",
              f"- Gates (layer {summary.get('gates', {}).get('layer')}): mean "
              f"{summary.get('gates', {}).get('mean', float('nan')):.3f}; see gates.html / gates.png.",
              "", "![losses](loss.png)", ""]
    path.write_text("\n".join(lines))
