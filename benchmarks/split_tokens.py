"""Does it last? Engram's gain over dense and the memory's part of it at 1x, 2x and 4x compare's
tokens (issue 46: deepseek-ai/Engram #20 saw the gain vanish with training, and compare's gain
halves when the tokens double).

    python benchmarks/split_tokens.py --out out/split_tokens [--steps 480,960,1920] \
        [--seeds 0,1,2] [--workers 2] --json benchmarks/results/compare/split_tokens/split.json
    python benchmarks/split_tokens.py --from A/results.json,B/results.json,... --json OUT.json
    python benchmarks/split_tokens.py --smoke --json out/split.json   # tiny sizes (CI)

Each budget is `engram compare --arms=dense,engram,pathway --steps S` (the default's warmup of
30% of the steps, then cosine; the same seeds, so the same batch order at the start of every
budget) in OUT/steps<S>/; finished runs are read back, so the default's and the thorough preset's
runs serve as 1x and 2x (their dense, engram and pathway runs copied into steps480/runs/ and
steps960/runs/). The figure: the gain (dense - engram), the pathway's part
(dense - pathway) and the memory's (pathway - engram) against training tokens, each with its
paired 95% interval. ``--from`` draws the same figure from finished compares' results.json
(e.g. `engram compare --data DIR` at 480, 960 and 1920 steps), training nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from engram.compute import machine
from engram.studies.common import figure, save
from engram.studies.compare import CompareConfig, run_compare
from engram.training.train import TrainConfig
from record import SMOKE, with_allocator_env, write_json  # benchmarks/record.py

ARMS = ("dense", "engram", "pathway")
PARTS = (("gain", "dense - engram", "tab:red"), ("pathway", "dense - pathway", "tab:green"),
         ("memory", "pathway - engram", "tab:blue"))


def budget_point(summary: dict, steps: int | None) -> dict:
    """One budget's split, as the figure and the JSON keep it (``steps`` None: a results.json,
    which does not record them; its tokens do)."""
    sp = summary["split"]
    gain = summary["paired_interval"]["engram_vs_dense"]
    tokens = summary["runs"]["dense"]["tokens"]
    return {"steps": steps, "tokens": tokens,
            "gain": {"mean": summary["engram_gain_vs_dense"], "interval": gain,
                     "per_seed": summary["engram_gain_per_seed"],
                     "resolved": summary["resolved"]["engram_vs_dense"]},
            "pathway": sp["pathway"], "memory": sp["memory"],
            "memory_share": sp["memory_share"], "memory_carries_gain": sp["memory_carries_gain"],
            "val_loss": {a: summary["runs"][a]["val_loss_per_seed"] for a in ARMS},
            "wall_s": summary["wall_s"]}


def plot(points: list[dict], path: Path) -> None:
    fig = figure(figsize=(6, 4))
    ax = fig.subplots()
    xs = [p["tokens"] for p in points]
    for key, label, color in PARTS:
        ivs = [p[key]["interval"] for p in points]
        ys = [p[key]["mean"] for p in points]
        ax.plot(xs, ys, "o-", color=color, label=label)
        if all(iv is not None for iv in ivs):
            ax.fill_between(xs, [iv["low"] for iv in ivs], [iv["high"] for iv in ivs],
                            color=color, alpha=0.15, linewidth=0)
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per run")
    ax.set_ylabel("validation loss difference (nats)")
    ax.set_title("Engram's gain and its parts vs tokens (band: paired 95%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def from_recorded(paths: list[str], out: str | None) -> dict:
    """The split of finished compares (their results.json), in order of tokens."""
    points = []
    for path in paths:
        summary = json.loads(Path(path).read_text())
        missing = [a for a in ARMS if a not in summary["runs"]]
        if missing or not summary.get("split"):
            raise SystemExit(f"{path}: a compare without the {', '.join(missing) or 'split'} "
                             "arm(s) (it needs dense, engram and pathway)")
        points.append({**budget_point(summary, None), "results": str(path),
                       "machine": summary.get("machine")})
    points.sort(key=lambda p: p["tokens"])
    # each point's machine is its compare's; "cpu" is where the figure was drawn
    res = {"cpu": machine.cpu_id(), "recorded": True, "points": points, "smoke": False}
    if out:
        write_json(out, res)
        plot(points, Path(out).with_suffix(".png"))
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/split_tokens", help="one compare folder per budget")
    ap.add_argument("--steps", default="480,960,1920", help="budgets (compare's default: 480)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write the figures here (the PNG beside it)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2/4 steps, 2 seeds (CI)")
    ap.add_argument("--from", dest="recorded", help="finished compares' results.json files, "
                    "comma-separated: their splits, nothing trained")
    args = ap.parse_args(argv)
    if args.recorded:
        return from_recorded(args.recorded.split(","), args.json)
    small, extra = {}, {}
    if args.smoke:
        small, args.steps, args.seeds = SMOKE, "2,4", "0,1"
        extra = dict(batch_size=2, seq_len=16, eval_every=2, eval_batches=1, estimate=False)
    else:
        with_allocator_env()
    t0 = time.perf_counter()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    points = []
    for steps in (int(s) for s in args.steps.split(",")):
        cc = CompareConfig(out_dir=str(Path(args.out) / f"steps{steps}"), steps=steps, seeds=seeds,
                           workers=args.workers, arms=ARMS, **extra)
        points.append(budget_point(run_compare(cc, dataclasses.replace(TrainConfig(), **small)),
                                   steps))
        p = points[-1]
        print(f"{p['tokens']:,} tokens: gain {p['gain']['mean']:+.4f}, pathway "
              f"{p['pathway']['mean']:+.4f}, memory {p['memory']['mean']:+.4f}", flush=True)
    if args.smoke:  # --from reads the same splits back from the compares' results.json
        again = from_recorded([str(Path(args.out) / f"steps{p['steps']}" / "results.json")
                               for p in points], None)["points"]
        assert [(p["tokens"], p["memory"]) for p in again] == \
            [(p["tokens"], p["memory"]) for p in points]
    res = {"cpu": machine.cpu_id(), "seeds": list(seeds), "points": points, "smoke": args.smoke,
           "wall_s": time.perf_counter() - t0}
    if args.json:
        write_json(args.json, res)
        plot(points, Path(args.json).with_suffix(".png"))
    return res


if __name__ == "__main__":
    main()
