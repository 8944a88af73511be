"""`engram analyze`'s outputs: LogitLens and CKA plots, the retention chart, the gate figure with
suppression, and report.md with a plain verdict on each of the paper's claims and where the gain
lands (``buckets``)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from ..files import publish_text
from . import buckets
from .common import RULE, save, subplots


def plot_lens(res: dict[str, Any], path: Path) -> None:
    fig, ax = subplots(figsize=(6, 4))
    for name, color in (("engram", "tab:red"), ("baseline", "tab:gray")):
        kl = res["lens"].get(name)
        if kl is not None:
            ax.plot(range(len(kl)), kl, "o-", color=color, label=name)
    ax.set_xticks(range(len(res["lens"]["engram"])),
                  ["emb"] + [f"block {i}" for i in range(len(res["lens"]["engram"]) - 1)])
    ax.set_ylabel("KL(output || layer read by the head), nats")
    ax.set_title("LogitLens: distance to the final prediction")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def plot_cka(cka: list[list[float]], path: Path) -> None:
    m = np.asarray(cka)
    fig, ax = subplots(figsize=(5.5, 4.5))
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, origin="lower")
    labels = ["emb"] + [f"b{i}" for i in range(m.shape[0] - 1)]
    ax.set_yticks(range(m.shape[0]), labels)
    ax.set_xticks(range(m.shape[1]), (["emb"] + [f"b{i}" for i in range(m.shape[1] - 1)]))
    ax.set_ylabel("Engram model state")
    ax.set_xlabel("baseline state")
    for i in range(m.shape[0]):
        ax.text(int(m[i].argmax()), i, "x", ha="center", va="center", color="red")
        for j in range(m.shape[1]):
            ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="bottom", fontsize=6, color="w")
    ax.set_title("linear CKA (x = best baseline match)")
    fig.colorbar(im, ax=ax)
    save(fig, path)


def plot_retention(ret: dict[str, dict[str, float | None]], path: Path) -> None:
    names = [n for n in ret if "(all)" in n or n.startswith("probe")]
    fig, ax = subplots(figsize=(9, 4))
    width = 0.27
    for j, (c, color) in enumerate((("zeroed", "tab:red"), ("gate0", "tab:orange"),
                                    ("gate1", "tab:blue"))):
        vals = [ret[n][c] or 0 for n in names]
        ax.bar(np.arange(len(names)) + (j - 1) * width, vals, width, color=color, label=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("retention = suppressed / full score")
    ax.set_title("Engram suppressed: what is left")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save(fig, path)


def gate_examples(batches, ho: dict[str, Any], lang: np.ndarray, tok, vocab, out: Path,
                  per_lang: int = 2, width: int = 48) -> None:
    """The gate figure extended: example windows per language with each token shaded by its gate,
    and beneath it the loss each token gains when the Engram output is zeroed."""
    t = batches[0].inputs.shape[1]
    gates, delta = ho["gates"], ho["zeroed"] - ho["full"]
    windows = len(gates) // t
    picks = []
    for li in (0, 1):
        cand = [w for w in range(windows) if lang[w * t] == li]
        picks += cand[:: max(1, len(cand) // per_lang)][:per_lang]
    raw = np.concatenate([b.raw.numpy() for b in batches])
    rows, texts, g_rows, d_rows = [], [], [], []
    for w in picks:
        words = [tok.decode([int(r)]) for r in raw[w][:width]]
        g, d = gates[w * t:w * t + width], delta[w * t:w * t + width]
        texts.append(words)
        g_rows.append(g)
        d_rows.append(d)
        spans = "".join(
            f'<span title="gate {a:.3f}, +{b:.3f} nats when zeroed" style="background: '
            f'rgba(220,40,40,{a:.3f}); border-bottom: 3px solid rgba(40,40,220,{min(1, b / 3):.3f})">'
            f"{html.escape(x).replace(chr(10), '&#8629;')}</span>"
            for x, a, b in zip(words, g.tolist(), np.clip(d, 0, None).tolist()))
        rows.append(f"<p>{spans}</p>")
    publish_text(out / "gates.html",
        "<!doctype html><meta charset='utf-8'><title>Engram gates</title><style>body{font:15px/2.1 "
        "sans-serif;max-width:60em;margin:2em auto}</style><h2>Engram gate (red) and the loss a "
        "token gains when the Engram output is zeroed (blue underline)</h2>" + "".join(rows))
    fig, axes = subplots(2 * len(picks), 1, figsize=(13, 1.2 * len(picks) * 2))
    for i, (words, g, d) in enumerate(zip(texts, g_rows, d_rows)):
        for ax, vals, cmap, lo, hi, lab in ((axes[2 * i], g, "Reds", 0, 1, "gate"),
                                            (axes[2 * i + 1], d, "RdBu_r", -3, 3, "+nll zeroed")):
            ax.imshow(vals[None], aspect="auto", cmap=cmap, vmin=lo, vmax=hi)
            ax.set_yticks([0], [lab], fontsize=7)
            ax.set_xticks(range(len(words)),
                          [x if all(ord(c) < 0x250 for c in x) else "\u25a1" for x in words],
                          rotation=90, fontsize=6)
    fig.suptitle("Engram gate per token (red) and loss increase when the output is zeroed "
                 "(red = worse without Engram); Chinese tokens as boxes (see gates.html)", fontsize=9)
    save(fig, out / "gates_examples.png", dpi=110)


def write_analysis(res, out: Path, vocab, tok, batches, ho, lang) -> None:
    plot_lens(res, out / "lens.png")
    if "cka" in res:
        plot_cka(res["cka"], out / "cka.png")
    plot_retention(res["retention"], out / "retention.png")
    gate_examples(batches, ho, lang, tok, vocab, out)
    publish_text(out / "report.md", report(res))


def _f(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def verdicts(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    kl = res["lens"]
    # State i+1 is the residual after block i; the memory enters at the first Engram block, so
    # the states before it cannot differ for Engram's sake (the claim is about the ones after).
    first = min(res["engram_layers"]) + 1
    if "baseline" in kl:
        e, b = kl["engram"], kl["baseline"]
        after = range(first, len(e) - 1)  # the final state is 0 for both by construction
        lower = [i for i in after if e[i] < b[i]]
        out.append(("LogitLens: with Engram, the layers are closer to the final prediction earlier",
                    "KL per state (emb, after block 0, 1, ...) engram " + ", ".join(_f(x) for x in e)
                    + "; baseline " + ", ".join(_f(x) for x in b),
                    ("holds" if len(lower) == len(after) else f"partly ({len(lower)} of "
                     f"{len(after)})" if lower else "does not hold")
                    + f" for the {len(after)} intermediate states after the Engram layer"))
        m = np.asarray(res["cka"])
        best = m.argmax(1).tolist()
        after = range(first, m.shape[0] - 1)
        deeper = [i for i in after if best[i] > i]
        margin = [float(m[i, best[i]] - m[i, i]) for i in deeper]  # over the same depth
        weak = " weakly" if margin and min(margin) < 0.02 else ""
        out.append(("CKA: Engram's layers align with deeper baseline layers",
                    "best baseline match per Engram state (0 = emb, i = after block i-1): " +
                    ", ".join(f"{i}->{j} ({m[i, j]:.3f})" for i, j in enumerate(best)) +
                    "; margin over the same depth " + ", ".join(f"{x:+.3f}" for x in margin),
                    (f"holds{weak}" if len(deeper) == len(after) else f"partly{weak} "
                     f"({len(deeper)} of {len(after)})" if deeper else "does not hold")
                    + f" for the {len(after)} intermediate states after the Engram layer"
                    + (" (margins under 0.02)" if weak else "")))
    r = res["retention"]
    mem, cp = r["probe memorised (acc)"]["zeroed"], r["probe copy (acc)"]["zeroed"]
    ph, fn = r["held-out phrase (all)"]["zeroed"], r["held-out function (all)"]["zeroed"]
    copy_full = res["probes"]["copy"]["full"]["acc"]
    can_copy = copy_full >= 0.05  # a model without induction heads has nothing to retain
    measured = (f"retention with the output zeroed: memorised-continuation probe {_f(mem, '.0%')}"
                f", copy probe {_f(cp, '.0%')} (full-model copy accuracy {copy_full:.1%}); "
                f"held-out fixed-phrase tokens {_f(ph, '.0%')}, function words {_f(fn, '.0%')}")
    knowledge = mem is not None and ph is not None and fn is not None and mem < 1 and ph < fn
    if not can_copy:
        v = ("knowledge side holds (memorised and fixed-phrase scores fall most); the in-context "
             "side is untested: the model cannot copy a repeated random span at all"
             if knowledge else "does not hold on the knowledge side; in-context side untested")
    else:
        v = "holds" if knowledge and mem < cp else "partly" if knowledge else "does not hold"
    out.append(("Suppression: knowledge is lost, in-context work kept (paper: TriviaQA 29%, "
                "C3 93%)", measured, v))
    g = res["gates"]["by_kind"]
    margin = {ln: v["phrase"] - max(v["other"], v["function"] or 0) for ln, v in g.items()
              if v["phrase"] is not None and v["other"] is not None}
    opens = [ln for ln, x in margin.items() if x > 0]
    weak = [ln for ln, x in margin.items() if 0 < x < 0.05]
    v = ("does not hold" if not opens else f"partly (only {', '.join(opens)})"
         if len(opens) < len(g) else f"holds weakly (margin under 0.05 in {', '.join(weak)})"
         if weak else "holds")
    out.append(("The gate opens on names and fixed phrases, in every language",
                "; ".join(f"{ln}: mean gate before a fixed-phrase token {_f(x['phrase'])}, "
                          f"function word {_f(x['function'])}, other {_f(x['other'])}"
                          for ln, x in g.items())
                + "; margin over the next kind " + ", ".join(f"{ln} {x:+.3f}"
                                                            for ln, x in margin.items()), v))
    return out


def report(res: dict[str, Any]) -> str:
    lines = ["# engram analyze", "",
             f"Run `{res['run']}` ({res['checkpoint']}, Engram at layers {res['engram_layers']}); "
             f"baseline `{res['baseline']}`"
             + (f", capacity-1 control `{res['pathway']}`" if res.get("pathway") else "")
             + f". One seed per model: {RULE}", "",
             "## The paper's claims here", "",
             "| claim | measured | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {m} | {v} |" for c, m, v in verdicts(res)]
    lines += ["", "## Retention (suppressed score / full score)", "",
              "Score: mean probability of the right token (held-out kinds; per language by the "
              "window's script), top-1 accuracy or mean probability (probes).", "",
              "| set | n | full score | zeroed | gate forced 0 | gate forced 1 |",
              "|---|---|---|---|---|---|"]
    for name, row in res["retention"].items():
        if name.startswith("probe"):
            p = res["probes"][name.split()[1]]
            metric = name.split("(")[1].rstrip(")")
            n, full = p["n"], p["full"][metric]
        else:
            kind, ln = name.split()[1], name.split("(")[1].rstrip(")")
            n, full = res["kinds"][ln][kind]["n"], res["kinds"][ln][kind]["full"]["p"]
        lines.append(f"| {name} | {n:,} | {_f(full)} | " + " | ".join(
            _f(row[c], ".0%") for c in ("zeroed", "gate0", "gate1")) + " |")
    lines += ["", "## Where the gate opens", ""]
    for ln in ("en", "zh"):
        g = res["gates"][ln]
        lines.append(f"- **{ln}** (mean gate {_f(g['mean_gate'])} over {g['positions']:,} "
                     "positions): highest bigrams " + ", ".join(
                         f"`{x['text']!r}` {x['mean_gate']:.2f}" for x in g["top_bigrams"][:8])
                     + "; lowest " + ", ".join(f"`{x['text']!r}` {x['mean_gate']:.2f}"
                                               for x in g["bottom_bigrams"][:5])
                     + "; highest tokens " + ", ".join(f"`{x['text']!r}` {x['mean_gate']:.2f}"
                                                      for x in g["top_tokens"][:8]))
    if "buckets" in res:
        lines += [""] + buckets.report(buckets.combine([res["buckets"]]))
    lines += ["", "![LogitLens](lens.png)", "", "![CKA](cka.png)", "",
              "![retention](retention.png)", "", "![gates](gates_examples.png)", ""]
    return "\n".join(lines)
