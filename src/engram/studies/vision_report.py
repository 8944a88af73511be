"""Sample grids (PNG) and report.md for `engram study-vision`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import publish_text
from .common import save, subplots

COLUMNS = 8  # images per prompt group in a grid row


def save_grid(grids: dict[str, dict[str, torch.Tensor]], path: Path, cfg: Any, concept: int) -> str:
    """Rows: base then each method (first seed); columns: trigger, bold trigger, control prompts,
    same seeds in every row, so a column compares methods on one starting noise."""
    groups = ["trigger", "bold", "control"]
    rows = []
    for name, imgs in grids.items():
        tiles = []
        for g in groups:
            x = imgs[g]
            pick = x[:: max(1, len(x) // COLUMNS)][:COLUMNS] if g == "control" else x[:COLUMNS]
            pad = torch.zeros(1, x.shape[-2], x.shape[-1])
            tiles += [torch.cat([t, pad[:, :, :1]], dim=-1) for t in pick] + [pad]
        rows.append(torch.cat(tiles, dim=-1)[0])
    img = torch.stack(rows).numpy()  # [rows, s, W]
    fig, axes = subplots(len(rows), 1, figsize=(img.shape[-1] / 9, 1.05 * len(rows) + 0.6))
    axes = np.atleast_1d(axes)
    for ax, name, row in zip(axes, grids, img):
        ax.imshow(row, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    axes[0].set_title(f'"a handwritten {cfg.trigger}" | "a bold handwritten {cfg.trigger}" | '
                      f"control prompts (digits, plain/bold) -- concept: digit {concept}",
                      fontsize=8)
    save(fig, path, dpi=110)
    return path.name


def _fmt(s: dict[str, float], key: str) -> str:
    v = s[key]
    return f"{v['mean']:.2f}" if v["min"] == v["max"] else \
        f"{v['mean']:.2f} ({v['min']:.2f}-{v['max']:.2f})"


def write_report(result: dict[str, Any], path: Path) -> None:
    cfg = result["config"]
    lines = [
        "# Vision study: trigger tables vs LoRA vs textual inversion (issue 11)", "",
        f"Base model: diffusers UNet2DConditionModel ({result['base']['params']:,} parameters, "
        f"pixel space, {cfg['width']}/{2 * cfg['width']} channels) trained {cfg['base_steps']} "
        f"steps (batch {cfg['base_batch']}, {result['base']['train_s']:.0f} s) on scikit-learn "
        f"digits without digit {cfg['unseen']}, conditioned on frozen all-MiniLM-L6-v2; "
        f"{cfg['ddim_steps']} DDIM steps, guidance {cfg['guidance']}. Judge (trained on the held-out "
        "40%; accuracy on the other 60%, real digits it never saw): " + ", ".join(f"{k} {v:.3f}" for k, v in result["judge_accuracy"].items()) + ".",
        "",
        f"Binding runs: {cfg['shots']} images of the concept with the prompt \"a handwritten "
        f"{cfg['trigger']}\", {cfg['bind_steps']} steps x {cfg['bind_batch']} images, AdamW lr "
        f"{cfg['lr']} for every method, {cfg['seeds']} seed(s) (different shots and noise); "
        "values are means over seeds (min-max). Binding = share of "
        f"{cfg['samples']} samples of \"a handwritten {cfg['trigger']}\" the judge assigns to the "
        f"concept; compositional = share of \"a bold handwritten {cfg['trigger']}\" samples that are "
        "the concept and judged bold; control = prompts without the trigger (every known digit, "
        f"plain and bold, {cfg['control_seeds']} seeds each) at the same seeds as the base model.",
        "", f"Total time: {result['total_s']:.0f} s.", ""]
    for name, c in result["concepts"].items():
        b, w = c["base_with_trigger"], c["base_with_word"]
        lines += [f"## Concept: digit {c['digit']} ({name} by the base model)", "",
                  f"Base model, trigger untrained: binding {b['binding']:.2f}, compositional "
                  f"{b['compositional']:.2f}, control digit accuracy {b['control_digit_acc']:.2f}, "
                  f"control style accuracy {b['control_style_acc']:.2f}. Base model with the "
                  f"digit's own word instead of the trigger: binding {w['binding']:.2f}, "
                  f"compositional {w['compositional']:.2f}.", "",
                  "| method | trainable params | binding | bold: is concept | bold: is bold | "
                  "compositional | control digit acc | control style acc | control pixel change "
                  "mean / max | control images changed | train s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m, v in c["methods"].items():
            s = v["summary"]
            lines.append(
                f"| {m} | {s['params']:,} | {_fmt(s, 'binding')} | {_fmt(s, 'bold_is_concept')} | "
                f"{_fmt(s, 'bold_is_bold')} | {_fmt(s, 'compositional')} | "
                f"{_fmt(s, 'control_digit_acc')} | {_fmt(s, 'control_style_acc')} | "
                f"{s['control_pixel_change_mean']['mean']:.4f} / "
                f"{s['control_pixel_change_max']['max']:.4f} | "
                f"{_fmt(s, 'control_images_changed')} | {s['train_s']['mean']:.0f} |")
        lines += ["", f"![grid]({c['grid']})", ""]
    publish_text(path, "\n".join(lines) + "\n")


__all__ = ["save_grid", "write_report"]
