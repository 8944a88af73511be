"""`engram analyze` over several seeds: each claim's numbers as mean +- sd, and in how many seeds
the claim holds, from the per-run ``analysis.json`` files (nothing is recomputed).

One seed cannot tell a real effect from a lucky initialisation: a claim holds here when it goes the
paper's way in every seed, and it is resolved by common.RULE, each per-seed number a claim rests on
(a state's KL gap, a language's gate margin) taken as one result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..files import publish_text
from . import buckets
from .analysis_report import verdicts
from .common import RULE, largest_spread, resolved, save, seed_spread, subplots

# Retention rows the suppression claim reads (paper: knowledge tasks fall, reading comprehension
# stays; here: memorised continuations and fixed phrases vs function words and copying).
RETENTION_ROWS = ("held-out all (all)", "held-out phrase (all)", "held-out function (all)",
                  "held-out other (all)", "held-out phrase (en)", "held-out phrase (zh)",
                  "probe memorised (acc)", "probe memorised (p)", "probe copy (acc)")


def seed_numbers(res: dict[str, Any]) -> dict[str, Any]:
    """The scalars each claim rests on, for one analysed run."""
    first = min(res["engram_layers"]) + 1  # states before the first Engram block cannot differ
    out: dict[str, Any] = {"states_after": list(range(first, len(res["lens"]["engram"]) - 1))}
    if "baseline" in res["lens"]:
        e, b = np.asarray(res["lens"]["engram"]), np.asarray(res["lens"]["baseline"])
        out["lens_gap"] = [float(b[i] - e[i]) for i in out["states_after"]]  # > 0: Engram closer
        m = np.asarray(res["cka"])
        # > 0: the state matches some deeper baseline state better than the one at its own depth
        out["cka_deeper_margin"] = [float(m[i, i + 1:].max() - m[i, i]) if i + 1 < m.shape[1]
                                    else float("nan") for i in out["states_after"]]
        out["cka_best"] = [int(m[i].argmax()) for i in range(m.shape[0])]
    r = res["retention"]
    out["retention_zeroed"] = {k: r[k]["zeroed"] for k in RETENTION_ROWS if k in r}
    out["retention_gate1"] = {k: r[k]["gate1"] for k in RETENTION_ROWS if k in r}
    out["copy_full_acc"] = res["probes"]["copy"]["full"]["acc"]
    g = res["gates"]["by_kind"]
    out["gate_margin"] = {ln: v["phrase"] - max(v["other"], v["function"] or 0)
                          for ln, v in g.items()
                          if v["phrase"] is not None and v["other"] is not None}
    claims = verdicts(res)
    out["verdicts"] = [v for _, _, v in claims]
    out["claims"] = [c for c, _, _ in claims]
    return out


def _stat(xs: list[float]) -> dict[str, Any]:
    a = np.asarray([x for x in xs if x is not None and np.isfinite(x)], dtype=float)
    if a.size == 0:
        return {"mean": None, "sd": None, "spread": None, "per_seed": list(xs), "positive": 0,
                "n": 0}
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "spread": seed_spread(a.tolist()), "per_seed": [float(x) for x in a],
            "positive": int((a > 0).sum()), "n": int(a.size)}


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-claim statistics over runs of different seeds (same configuration)."""
    if not results:
        raise ValueError("need at least one analysis")
    layers = {tuple(r["engram_layers"]) for r in results}
    if len(layers) > 1:
        raise UserError(f"the runs have Engram at different layers {sorted(layers)}: combine "
                         "seeds of one configuration")
    nums = [seed_numbers(r) for r in results]
    n_states = len(nums[0]["states_after"])
    out: dict[str, Any] = {"runs": [r["run"] for r in results],
                           "baselines": [r["baseline"] for r in results],
                           "pathways": [r.get("pathway") for r in results],
                           "n_seeds": len(results), "states_after": nums[0]["states_after"],
                           "per_seed": nums}
    if all("lens_gap" in n for n in nums):
        out["lens_gap"] = [_stat([n["lens_gap"][i] for n in nums]) for i in range(n_states)]
        out["cka_deeper_margin"] = [_stat([n["cka_deeper_margin"][i] for n in nums])
                                    for i in range(n_states)]
        out["lens"] = {k: _stack([r["lens"][k] for r in results]) for k in ("engram", "baseline")}
    for key in ("retention_zeroed", "retention_gate1"):
        out[key] = {row: _stat([n[key].get(row) for n in nums]) for row in nums[0][key]}
    out["gate_margin"] = {ln: _stat([n["gate_margin"].get(ln) for n in nums])
                          for ln in nums[0]["gate_margin"]}
    out["copy_full_acc"] = _stat([n["copy_full_acc"] for n in nums])
    # knowledge side of suppression, per seed: fixed phrases and memorised continuations keep
    # less of their score than function words do
    out["knowledge_gap"] = _stat([n["retention_zeroed"]["held-out function (all)"]
                                  - n["retention_zeroed"]["held-out phrase (all)"] for n in nums])
    out["verdicts"] = seed_verdicts(out)
    if all("buckets" in r for r in results):  # analyses written before the buckets have none
        out["buckets"] = buckets.combine([r["buckets"] for r in results])
    return out


def _stack(curves: list[list[float]]) -> dict[str, list[float]]:
    a = np.asarray(curves, dtype=float)
    return {"mean": a.mean(0).tolist(),
            "sd": (a.std(0, ddof=1) if len(a) > 1 else np.zeros(a.shape[1])).tolist()}


def _all_seeds(stats: list[dict[str, Any]]) -> str:
    """'holds' when every stat is positive in every seed, and whether each mean is resolved
    against the largest seed spread of the stats (common.RULE); else how far it gets."""
    if not stats:
        return "untested"
    pos = sum(s["positive"] for s in stats)
    total = sum(s["n"] for s in stats)
    spread = largest_spread(s.get("spread", seed_spread(s["per_seed"])) for s in stats)
    if pos == total:
        return "holds in every seed" + (", resolved" if all(resolved(s["mean"], spread)
                                                            for s in stats) else ", not resolved")
    if pos == 0:
        return "does not hold in any seed"
    return f"mixed: {pos} of {total} (state, seed) pairs go the paper's way"


def _ms(s: dict[str, Any], spec: str = "+.3f") -> str:
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean']:{spec}} +- {s['sd']:.3f}"


def seed_verdicts(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    st = c["states_after"]
    if "lens_gap" in c:
        out.append(("LogitLens: with Engram, the layers are closer to the final prediction earlier",
                    "baseline KL - Engram KL per state after the Engram layer (mean +- sd over "
                    f"{c['n_seeds']} seeds): " + ", ".join(
                        f"state {i}: {_ms(s)}" for i, s in zip(st, c["lens_gap"])),
                    _all_seeds(c["lens_gap"])))
        out.append(("CKA: Engram's layers align with deeper baseline layers",
                    "best deeper-layer CKA - same-depth CKA per state: " + ", ".join(
                        f"state {i}: {_ms(s)}" for i, s in zip(st, c["cka_deeper_margin"])),
                    _all_seeds(c["cka_deeper_margin"])))
    z = c["retention_zeroed"]
    kg = c["knowledge_gap"]
    can_copy = (c["copy_full_acc"]["mean"] or 0) >= 0.05
    out.append(("Suppression: knowledge is lost, in-context work kept (paper: TriviaQA 29%, "
                "C3 93%)",
                "retention with the output zeroed: memorised probe "
                f"{_ms(z['probe memorised (acc)'], '.0%')}, fixed-phrase tokens "
                f"{_ms(z['held-out phrase (all)'], '.0%')}, function words "
                f"{_ms(z['held-out function (all)'], '.0%')}; function - phrase {_ms(kg)}; "
                f"full-model copy accuracy {c['copy_full_acc']['mean']:.1%}",
                "knowledge side: " + _all_seeds([kg]) + ("" if can_copy else
                                                         "; in-context side untested (the "
                                                         "models cannot copy)")))
    gm = c["gate_margin"]
    out.append(("The gate opens on names and fixed phrases, in every language",
                "gate before a fixed-phrase token - the next kind's: "
                + ", ".join(f"{ln} {_ms(s)}" for ln, s in gm.items()),
                _all_seeds(list(gm.values()))))
    return out


def plot_seeds(c: dict[str, Any], path: Path) -> None:
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    if "lens" in c:
        for name, color in (("engram", "tab:red"), ("baseline", "tab:gray")):
            m, s = np.asarray(c["lens"][name]["mean"]), np.asarray(c["lens"][name]["sd"])
            a.errorbar(range(len(m)), m, yerr=s, fmt="o-", color=color, capsize=3, label=name)
        a.set_xticks(range(len(m)), ["emb"] + [f"block {i}" for i in range(len(m) - 1)])
        a.set_ylabel("KL to the final prediction, nats")
        a.legend()
    a.set_title(f"LogitLens, mean +- sd over {c['n_seeds']} seeds")
    a.grid(alpha=0.3)
    rows = list(c["retention_zeroed"])
    means = [c["retention_zeroed"][r]["mean"] or 0 for r in rows]
    sds = [c["retention_zeroed"][r]["sd"] or 0 for r in rows]
    b.barh(range(len(rows)), means, xerr=sds, color="tab:blue", capsize=3)
    b.axvline(1.0, color="k", lw=0.8)
    b.set_yticks(range(len(rows)), rows, fontsize=7)
    b.set_xlabel("retention with the Engram output zeroed")
    b.set_title("suppression, mean +- sd")
    save(fig, path)


def seeds_report(c: dict[str, Any]) -> str:
    lines = ["# engram analyze: several seeds", "",
             f"{c['n_seeds']} Engram runs, each against the dense baseline of its seed:", ""]
    pathways = c.get("pathways") or [None] * len(c["runs"])
    lines += [f"- `{r}` vs `{b}`" + (f" and `{p}`" if p else "")
              for r, b, p in zip(c["runs"], c["baselines"], pathways)]
    lines += ["", "A claim holds when it goes the paper's way in every seed. " + RULE + " Here each "
              "per-seed number a claim rests on (a state's KL gap, a language's gate margin) is one "
              "result. Each seed's full analysis is in its own folder.",
              "", "## The paper's claims here", "",
              "| claim | measured (mean +- sd) | per seed | across seeds |", "|---|---|---|---|"]
    for k, (claim, measured, verdict) in enumerate(c["verdicts"]):
        per = "; ".join(n["verdicts"][k] for n in c["per_seed"] if k < len(n["verdicts"]))
        lines.append(f"| {claim} | {measured} | {per} | {verdict} |")
    lines += ["", "## Retention over seeds (suppressed score / full score)", "",
              "| set | zeroed | gate forced 1 |", "|---|---|---|"]
    for row, s in c["retention_zeroed"].items():
        lines.append(f"| {row} | {_ms(s, '.0%')} | {_ms(c['retention_gate1'][row], '.0%')} |")
    if "buckets" in c:
        lines += [""] + buckets.report(c["buckets"])
    lines += ["", "![seeds](seeds.png)", ""]
    return "\n".join(lines)


def write_seeds(results: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Combine per-run analyses into ``out``: analysis.json, seeds.png, report.md."""
    c = combine(results)
    out.mkdir(parents=True, exist_ok=True)
    plot_seeds(c, out / "seeds.png")
    publish_text(out / "report.md", seeds_report(c))
    publish_text(out / "analysis.json", json.dumps(c, indent=2))
    return c


def run_seeds(run_dirs: list[str], baselines: list[str] | None, ac: Any,
              pathways: list[str] | None = None) -> dict[str, Any]:
    """Analyse each run (against the baseline and the pathway run at the same position) into
    ``out_dir/<run name>``, then combine them into ``out_dir`` (default: ``analysis`` beside the
    first run)."""
    import dataclasses

    from .analyze import run_analyze

    baselines, pathways = list(baselines or []), list(pathways or [])
    for flag, given, what in (("baselines", baselines, "dense baseline"),
                              ("pathway runs", pathways, "pathway run (capacity 1)")):
        if given and len(given) != len(run_dirs):
            raise UserError(f"{len(run_dirs)} runs but {len(given)} {flag}: pass one {what} per "
                            "Engram run (same seed), in the same order")
    names = [Path(r).name for r in run_dirs]
    if len(set(names)) != len(names):
        raise UserError(f"runs with the same folder name {names}: their analyses would collide")
    for k, r in enumerate(run_dirs):  # every pair before the first analysis: one clear line
        for flag, given in (("--baseline", baselines), ("--pathway", pathways)):
            if given:
                buckets.check_pair(r, buckets.read_config(r, "RUN_DIR"), given[k], flag)
    out = Path(ac.out_dir) if ac.out_dir else Path(run_dirs[0]).parent / "analysis"
    results = [run_analyze(r, baselines[k] if baselines else None,
                           dataclasses.replace(ac, out_dir=str(out / names[k])),
                           pathway=pathways[k] if pathways else None)
               for k, r in enumerate(run_dirs)]
    return write_seeds(results, out)
