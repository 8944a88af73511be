"""Is it the memory, on text no run trained on? `engram compare`'s runs scored on a held-out
source, and Engram's gain split there as compare splits it on its own validation set (issue 46).

    python benchmarks/heldout_split.py OUT/runs --source python-doc \
        --json benchmarks/results/compare/heldout/python_doc.json
    python benchmarks/heldout_split.py --smoke --json out/heldout.json  # tiny runs trained here

Every run folder in RUNS named ``<arm>-s<seed>`` (compare's layout) is scored with `engram eval`
(tokens a run never saw stay as context and are left out as targets; every run of one seed scores
the same targets, since they share the corpus's vocabulary). Arms pair by seed as in compare; the
split (dense - pathway) + (pathway - engram) and each difference get the rule over their own arms'
spreads and the paired interval (studies/compare.py ``split_gain``, ``difference``). The default
corpus (King James Bible + People's Daily) holds no Python documentation, so python-doc (the
standard library's reST sources, ``apt-get install python3-doc``) is text from elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from engram.compute import machine
from engram.studies.common import seed_spread
from engram.studies.compare import CompareConfig, difference, run_compare, split_gain
from engram.studies.evaluate import EvalConfig, run_eval
from engram.training.train import TrainConfig
from eval_docstrings import docstrings  # benchmarks/: the script's folder is on sys.path
from record import SMOKE, write_json

RUN = re.compile(r"^(?P<arm>[a-z-]+)-s(?P<seed>\d+)$")


def score_runs(runs: Path, ec: EvalConfig) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: eval result}}`` for every run folder under ``runs``."""
    out: dict[str, dict[int, dict]] = {}
    for folder in sorted(p for p in runs.iterdir() if p.is_dir() and RUN.match(p.name)):
        m = RUN.match(folder.name)
        res = run_eval(str(folder), ec, progress=False)
        out.setdefault(m["arm"], {})[int(m["seed"])] = res
        print(f"{folder.name}: {res['loss']:.4f} nats over {res['scored']:,} scored targets",
              flush=True)
    return out


def summarise(scored: dict[str, dict[int, dict]]) -> dict:
    """compare's shape ({arm: {"val_loss_per_seed": [...]}}, spreads) on the held-out losses,
    over the seeds every arm has, and the split where dense, engram and pathway are there."""
    seeds = sorted(set.intersection(*(set(s) for s in scored.values())))
    runs = {arm: {"val_loss_per_seed": [by[s]["loss"] for s in seeds],
                  "scored_per_seed": [by[s]["scored"] for s in seeds]}
            for arm, by in scored.items()}
    for r in runs.values():
        r["val_loss"] = sum(r["val_loss_per_seed"]) / len(seeds)
    noise = {arm: seed_spread(r["val_loss_per_seed"]) for arm, r in runs.items()}
    out = {"seeds": seeds, "runs": runs, "seed_spread": noise,
           "differences": {a: difference(runs, noise, a, "engram")
                           for a in runs if a != "engram" and "engram" in runs}}
    if {"dense", "engram", "pathway"} <= set(runs):
        out["split"] = split_gain(runs, noise)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", help="compare's OUT/runs folder")
    ap.add_argument("--source", help="a corpus source by name (engram eval --source)")
    ap.add_argument("--text", help="or a UTF-8 text file (engram eval --text)")
    ap.add_argument("--max_chars", type=int, default=None, help="keep the first N characters")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny compare runs trained here, scored on stdlib docstrings (CI)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory()
        cc = CompareConfig(out_dir=tmp.name, steps=4, batch_size=2, seq_len=16, eval_every=2,
                           eval_batches=1, seeds=(0, 1), workers=1, estimate=False,
                           arms=("dense", "engram", "pathway"))
        run_compare(cc, dataclasses.replace(TrainConfig(), **SMOKE))
        args.runs = str(Path(tmp.name) / "runs")
        args.text = str(Path(tmp.name) / "docstrings.txt")
        Path(args.text).write_text(docstrings(("json", "textwrap")))
        args.source = None
    if not args.runs:
        ap.error("give compare's runs folder (or --smoke)")
    ec = EvalConfig(source=args.source, text=args.text, max_chars=args.max_chars)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    res = summarise(score_runs(Path(args.runs), ec))
    res.update({"source": args.source, "text": None if args.smoke else args.text,
                "max_chars": args.max_chars, "runs_folder": None if args.smoke else args.runs,
                "cpu": machine.cpu_id(), "torch": torch.__version__,
                "wall_s": time.perf_counter() - t0, "smoke": args.smoke})
    sp = res.get("split")
    if sp is not None:
        share = sp["memory_share"]
        print(f"held out: pathway part {sp['pathway']['mean']:+.4f}, memory part "
              f"{sp['memory']['mean']:+.4f} (resolved: {sp['memory']['resolved']}), share "
              f"{share['estimate'] if share['estimate'] is None else round(share['estimate'], 3)}"
              f"; CPU {res['cpu']}")
    if args.json:
        write_json(args.json, res)
    if tmp is not None:
        tmp.cleanup()
    return res


if __name__ == "__main__":
    main()
