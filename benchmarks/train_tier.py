"""Training from the file tier against training in memory, at `engram compare`'s shapes.

    python benchmarks/train_tier.py --json benchmarks/results/train_tier.json [--steps 40]
        [--budget_frac 0.1] [--smoke]

compare's Engram model (its default shapes: 16 x 128 tokens a step, one Engram layer, ~160k rows
of 32 floats, RowAdam) is built twice in this process, once with its table in memory and once on
the file tier (``--table_tier file``, the tier folder under TMPDIR) with a resident budget of
``--budget_frac`` of the table's file bytes (rows and optimiser state), raised to the least budget
the tier accepts (one step's most rows, ``tier_tables.budget_need``) where that is larger. Their
training steps are interleaved (load from other processes hits both alike), one torch thread each
as compare's workers. Reported:

(a) whether the two runs' losses are bit-identical at every timed step;
(b) tokens/s of each (median step wall time) and the tier's ratio to memory (goal >= 0.9x), with
    the tier's time on the training thread reading rows (or waiting on the read-ahead) and
    writing them back, and how many steps were read ahead.
A third run, on the tier with two steps' budget (room for the read-ahead), is interleaved too.

Goal (c) (a table 2x a process's memory limit) is not measured here (not built: the table is
initialised in memory once, and the file is memory-mapped, which RLIMIT_AS counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engram import gemm
from engram.studies.compare import CompareConfig
from engram.training import tier_tables
from engram.training.train import build_run, train_step

sys.path.insert(0, str(Path(__file__).parent))
from record import write_json  # noqa: E402  (benchmarks/record.py)
from table_optimizer import SMOKE, engram_config  # noqa: E402  (compare's Engram variant)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (each run)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--budget_frac", type=float, default=0.1,
                    help="resident budget, a fraction of the table's file bytes")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 3 steps (CI)")
    args = ap.parse_args(argv)
    small, cc = {}, CompareConfig()
    if args.smoke:
        small, cc = SMOKE, CompareConfig(steps=8, batch_size=2, seq_len=16)
        args.steps, args.warmup = 3, 1
    torch.set_num_threads(1)  # as compare's workers
    root = Path(tempfile.mkdtemp(prefix="engram-bench-train-tier-"))
    cfg = dataclasses.replace(engram_config(small, cc), steps=args.warmup + args.steps,
                              eval_every=10**9, ckpt_every=10**9)
    mem = build_run(dataclasses.replace(cfg, out_dir=str(root / "mem")))
    engrams = mem.model.engrams().values()
    table_bytes = sum(e.table.num_rows * e.table.dim * 4 for e in engrams)
    file_bytes = sum(e.table.num_rows * tier_tables.row_bytes(cfg.table_optimizer, e.table.dim)
                     for e in engrams)
    need = tier_tables.budget_need(cfg, mem.model)
    budget = max(int(args.budget_frac * file_bytes), need)
    runs = {"memory": mem}
    # the budget asked for, and two steps' worst case (room for the read-ahead)
    for name, b in (("file", budget), ("file_read_ahead", max(2 * need, budget))):
        runs[name] = build_run(dataclasses.replace(cfg, out_dir=str(root / name),
                                                   table_tier="file", table_budget_mb=b / 2**20))
    wall: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    load0 = os.getloadavg()
    for i in range(args.warmup + args.steps):
        for k, run in runs.items():
            t0 = time.perf_counter()
            loss = train_step(run)
            run.step += 1
            if i >= args.warmup:
                wall[k].append(time.perf_counter() - t0)
            losses[k].append(loss)
    tokens = cfg.batch_size * cfg.seq_len
    speed = {k: {"median_step_s": statistics.median(w), "tokens_per_s": tokens / statistics.median(w)}
             for k, w in wall.items()}
    tiers = {}
    for k in ("file", "file_read_ahead"):
        t = runs[k].batches.tier
        t.wait()
        tiers[k] = {"budget_bytes": t.budget, "budget_over_file_bytes": t.budget / file_bytes,
                    "budget_over_table_bytes": t.budget / table_bytes,
                    "peak_working_sets_bytes": t.peak, "steps_read_ahead": t.read_ahead,
                    "losses_bit_identical": losses[k] == losses["memory"],
                    "tokens_per_s_over_memory": speed[k]["tokens_per_s"]
                    / speed["memory"]["tokens_per_s"],
                    "read_ms_per_step": 1e3 * t.read_s / len(losses[k]),
                    "write_ms_per_step": 1e3 * t.write_s / len(losses[k])}
        t.close()
    res = {"cpu": gemm.cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "threads": 1, "smoke": args.smoke, "budget_frac_asked": args.budget_frac,
           "shape": {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                     "table_size": cfg.table_size, "table_optimizer": cfg.table_optimizer,
                     "d_model": cfg.d_model, "n_layer": cfg.n_layer},
           "table_bytes": table_bytes, "file_bytes": file_bytes, "least_budget_bytes": need,
           "timed_steps": args.steps, "speed": speed, "tiers": tiers,
           "load_avg": {"start": load0, "end": os.getloadavg()}}
    print(f"CPU: {res['cpu']}; {tokens} tokens a step, table {table_bytes / 2**20:.1f} MB "
          f"({file_bytes / 2**20:.1f} MB with {cfg.table_optimizer} state); memory "
          f"{speed['memory']['tokens_per_s']:,.0f} tok/s")
    for k, r in tiers.items():
        print(f"{k}: budget {r['budget_bytes'] / 2**20:.2f} MB ({r['budget_over_file_bytes']:.1%} "
              f"of the files): (a) losses bit-identical {r['losses_bit_identical']}; (b) "
              f"{speed[k]['tokens_per_s']:,.0f} tok/s = {r['tokens_per_s_over_memory']:.3f}x "
              f"memory (read {r['read_ms_per_step']:.1f} ms, write {r['write_ms_per_step']:.1f} "
              f"ms a step on the training thread; {r['steps_read_ahead']} steps read ahead)")
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
