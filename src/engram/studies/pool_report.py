"""The pool budget's verdict: per Engram layer and tier, does the read fit its prefetch window, by
what margin, at what injected latency it stops fitting, and the bandwidth bound; written as
budget.json, budget.png (window vs read latency per depth and tier; the latency sweep) and
report.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import publish_text
from .common import save, subplots
from .pool_tiers import break_even

US = 1e6
# The paper's example (arXiv 2603.10087): Qwen3-32B, a 3.6 ms decode step over 64 layers, ~56 us per
# layer, so an Engram layer at depth 2 has ~56 us to get its rows.
PAPER_WINDOW_US = 56.0


def layer_budget(timing: dict, reads: dict, waits: dict, sw: dict | None, tokens: int,
                 info: dict) -> dict[str, Any]:
    """One mode's budget from its measurements (seconds in, microseconds out)."""
    windows = timing["window_s"]
    layers = {}
    for lid in info["engram_layers"]:
        w = windows[lid]
        tiers = {}
        for name, r in reads.items():
            lat = r[lid]["latency_s"]
            tiers[name] = {
                "latency_us": lat * US, "fits": bool(lat < w), "margin_us": (w - lat) * US,
                "share_of_window": lat / w, "rows": r[lid]["rows"],
                "distinct": r[lid]["distinct"], "misses": r[lid]["misses"],
                "rows_per_s": r[lid]["rows_per_s"],
                "prefetch_wait_us": waits[name]["wait_s"][lid] * US,
                "prefetched_forward_us": waits[name]["forward_s"] * US}
        be = {}
        for variant in ("pool", "pool_cache"):
            if sw is not None and variant in sw:
                pts = sw[variant][lid]
                lat = [None if p["latency_s"] is None else p["latency_s"] * US for p in pts]
                be[variant] = {**break_even(w, sw["inject_us"], pts, sw["inflight"]),
                               "latency_us": lat}
        entry = {"window_us": w * US, "tiers": tiers, "break_even": be}
        if "mooncake" in tiers and "pool" in tiers:  # Mooncake as an injected latency per trip
            trips = max(1, -(-int(tiers["mooncake"]["distinct"]) // sw["inflight"])) if sw else 1
            entry["mooncake_as_injected_us"] = (tiers["mooncake"]["latency_us"]
                                                - tiers["pool"]["latency_us"]) / trips
        layers[lid] = entry
    n = len(windows)
    placement = {}
    for name, r in reads.items():
        worst = max(r[lid]["latency_s"] for lid in r)
        placement[name] = next((k for k in range(1, n) if windows[k] > worst), None)
    step_s = timing["step_s"]
    per_token_layer = info["heads"] * info["row_bytes"]  # S_layer
    need = tokens / step_s * per_token_layer * len(info["engram_layers"])
    # an FP8 tier's rows are smaller: its bytes moved, against the need in its own row format
    rb = {name: info.get("tier_row_bytes", {}).get(name, info["row_bytes"]) for name in reads}
    got = {name: min(r[lid]["rows"] * rb[name] / r[lid]["latency_s"] for lid in r)
           for name, r in reads.items()}
    headroom = {name: got[name] / (need * rb[name] / info["row_bytes"]) for name in reads}
    return {
        "tokens": tokens,
        "t_exec_us": {"embed": timing["embed_s"] * US,
                      "blocks": [b * US for b in timing["block_s"]],
                      "norm": timing["norm_s"] * US, "head": timing["head_s"] * US},
        "parts_sum_us": timing["parts_sum_s"] * US, "forward_us": timing["forward_s"] * US,
        "parts_over_forward": timing["parts_over_forward"],
        "step_us": step_s * US, "window_us": [w * US for w in windows],
        "layers": layers, "earliest_layer": placement,
        "bandwidth": {"tokens_per_s": tokens / step_s, "bytes_per_token_layer": per_token_layer,
                      "engram_layers": len(info["engram_layers"]), "required_GBps": need / 1e9,
                      "tier_GBps": {k: v / 1e9 for k, v in got.items()},
                      "tier_row_bytes": rb, "tier_headroom": headroom},
        "sweep": sw}


def _f(us: float) -> str:
    return f"{us:,.0f} us" if abs(us) >= 100 else f"{us:.1f} us"


def verdict(summary: dict) -> list[str]:
    """The short text verdict: per mode, Engram layer and tier."""
    lines = []
    for mode, m in summary["modes"].items():
        lines.append(f"{mode} ({m['tokens']} tokens/step, step {_f(m['step_us'])}):")
        for lid, lay in m["layers"].items():
            ok = [k for k, t in lay["tiers"].items() if t["fits"]]
            no = [f"{k} (+{_f(-t['margin_us'])})" for k, t in lay["tiers"].items()
                  if not t["fits"]]
            lines.append(f"  Engram layer {lid}, window {_f(lay['window_us'])}: fits from "
                         f"{', '.join(ok) or 'no tier'}; misses with {', '.join(no) or 'no tier'}")
            for variant, be in lay["break_even"].items():
                x = be["measured_us"]
                x = (f"> {summary['config']['inject_us'][-1]:g} us" if be["beyond_sweep"]
                     else f"{x:.2f} us")
                lines.append(f"    break-even injected latency ({variant}, {be['trips']} round "
                             f"trips of {summary['config']['inflight']} reads): measured {x}, "
                             f"model {be['model_us']:.2f} us")
        paper = [k for k, t in next(iter(m["layers"].values()))["tiers"].items()
                 if max(lay["tiers"][k]["latency_us"] for lay in m["layers"].values())
                 < PAPER_WINDOW_US]
        lines.append(f"  against the paper's {PAPER_WINDOW_US:g} us window (Qwen3-32B, layer 2), "
                     f"these reads fit: {', '.join(paper) or 'none'}")
        early = ", ".join(f"{k}: {'none' if v is None else f'>= {v}'}"
                          for k, v in m["earliest_layer"].items())
        lines.append(f"  earliest depth an Engram layer can sit at, per tier: {early}")
        bw = m["bandwidth"]
        lines.append(f"  bandwidth bound: {bw['required_GBps'] * 1e3:.1f} MB/s needed "
                     f"({bw['tokens_per_s']:,.0f} tokens/s x {bw['bytes_per_token_layer']} B x "
                     f"{bw['engram_layers']} layers); slowest tier "
                     f"{min(bw['tier_GBps'].values()) * 1e3:.1f} MB/s")
        if "tier_headroom" in bw:  # each tier against the need in its own row format
            low = min(bw["tier_headroom"], key=bw["tier_headroom"].get)
            lines.append(f"  least bandwidth headroom: {low} ({bw['tier_row_bytes'][low]} B rows), "
                         f"{bw['tier_headroom'][low]:,.1f}x its need")
    return lines


def plot(summary: dict, path: Path) -> None:
    from matplotlib import colormaps

    modes = list(summary["modes"])
    fig, axes = subplots(2, len(modes), figsize=(7.5 * len(modes), 9), squeeze=False)
    for c, mode in enumerate(modes):
        m = summary["modes"][mode]
        ax = axes[0][c]
        ks = list(range(len(m["window_us"])))
        ax.plot(ks, m["window_us"], "k-o", lw=2, label="window (embed + blocks before k)")
        names = list(next(iter(m["layers"].values()))["tiers"])
        for i, name in enumerate(names):
            lat = max(lay["tiers"][name]["latency_us"] for lay in m["layers"].values())
            ax.axhline(lat, color=colormaps["tab10"](i % 10), ls="--", lw=1.2, label=f"{name} read")
        for lid in m["layers"]:
            ax.axvline(int(lid), color="0.8", lw=6, zorder=0)
        ax.set_yscale("log")
        ax.set_xticks(ks)
        ax.set_xlabel("Engram layer depth k (grey: the model's Engram layers)")
        ax.set_ylabel("microseconds")
        ax.set_title(f"{mode}: {m['tokens']} tokens per step")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax = axes[1][c]
        sw = m["sweep"]
        if sw:
            x = [max(v, 0.03) for v in sw["inject_us"]]
            for lid, lay in m["layers"].items():
                for variant, style in (("pool", "-o"), ("pool_cache", "-s")):
                    if variant in lay["break_even"]:
                        y = [float("nan") if v is None else v
                             for v in lay["break_even"][variant]["latency_us"]]
                        ax.plot(x, y, style,
                                label=f"layer {lid}: {variant.replace('_', ' + ')}")
                ax.axhline(lay["window_us"], color="k", lw=1, ls=":")
                ax.text(x[0], lay["window_us"], f" window of layer {lid}", va="bottom", fontsize=7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"injected latency per round trip of {sw['inflight']} reads, us "
                          "(0 drawn at 0.03)")
            ax.set_ylabel("read latency of the step's rows, us")
            ax.legend(fontsize=7)
    save(fig, path, dpi=110)


def markdown(summary: dict) -> str:
    tc, pc = summary["train_config"], summary["config"]
    out = ["# Pool budget: do the rows arrive within the prefetch window?", "",
           f"Model: {'run ' + pc['run_dir'] if pc['run_dir'] else 'random weights'}, "
           f"{summary['n_layer']} layers, d={tc['d_model']}, Engram at {summary['engram_layers']} "
           f"({summary['heads']} heads x {summary['row_bytes']} B rows, "
           f"{sum(summary['table_rows'].values()):,} rows); batch {pc['batch']}, "
           f"{summary['threads']} torch thread(s), medians of {pc['reps']} steps of held-out text. "
           f"Mooncake: {summary['mooncake']}. Wall time {summary['wall_s']:.0f} s; 1-minute load "
           f"average {summary.get('load_avg_start', float('nan')):.1f} at the start, "
           f"{summary.get('load_avg_end', float('nan')):.1f} at the end.", ""]
    for mode, m in summary["modes"].items():
        t = m["t_exec_us"]
        out += [f"## {mode}", "",
                f"t_exec: embed {_f(t['embed'])}, blocks "
                + ", ".join(_f(b) for b in t["blocks"]) + f", norm {_f(t['norm'])}, head (last "
                f"position) {_f(t['head'])}; sum of parts {_f(m['parts_sum_us'])} vs forward "
                f"{_f(m['forward_us'])} (ratio paired by step: {m['parts_over_forward']:.3f}). "
                "Windows by depth: "
                + ", ".join(f"k={k}: {_f(w)}" for k, w in enumerate(m["window_us"])), ""]
        for lid, lay in m["layers"].items():
            out += [f"Engram layer {lid}, window {_f(lay['window_us'])}:", "",
                    "| tier | read | fits | margin | rows/s | distinct | misses | wait behind "
                    "prefetch |", "|---|---|---|---|---|---|---|---|"]
            for name, r in lay["tiers"].items():
                out.append(f"| {name} | {_f(r['latency_us'])} | {'yes' if r['fits'] else 'no'} | "
                           f"{_f(r['margin_us'])} | {r['rows_per_s']:,.0f} | {r['distinct']:.0f} | "
                           f"{r['misses']:.0f} | {_f(r['prefetch_wait_us'])} |")
            out.append("")
        out += ["Verdict:", "", "```"] + verdict({**summary, "modes": {mode: m}}) + ["```", ""]
    return "\n".join(out)


def write_report(summary: dict, out_dir: Path) -> None:
    publish_text(out_dir / "budget.json", json.dumps(summary, indent=1, default=str))
    plot(summary, out_dir / "budget.png")
    publish_text(out_dir / "report.md", markdown(summary))
