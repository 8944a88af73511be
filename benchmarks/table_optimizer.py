"""Table optimisers side by side: state bytes a row, validation loss at compare's budget, tokens/s.

    python benchmarks/table_optimizer.py --json benchmarks/results/table_optimizer.json \
        [--seeds 0,1,2] [--optimizers adam,adagrad,rmsprop] [--workers 2] [--runs DIR] [--smoke]

1. Loss. `engram compare`'s Engram model at its default shapes and token budget (480 steps of
   16 x 128 tokens, warmup + cosine, full validation set at the last step), trained once per
   (table optimiser, seed) exactly as compare trains it (studies' worker processes, one torch
   thread each, resumable: a killed benchmark resumes its runs from their checkpoints), only
   ``--table_optimizer`` differing. Figure: each optimiser's mean validation loss minus RowAdam's
   (``adam``, the baseline), beside the seed spread of each.
2. State. Per touched row, the bytes a checkpoint keeps (row id + per-row state) and the bytes held
   in memory after loading the final checkpoint (the 4-byte-a-row slot map included), against
   the row's own bytes (float32).
3. Speed. The runs of each optimiser built side by side in this process, training steps
   interleaved (load from other processes hits all alike): median step wall time, tokens/s and the
   table optimiser's own step (CPU ms). Ratios against RowAdam measured in the same loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engram.compute import gemm, machine
from engram.studies.common import job, run_jobs, seed_spread, train_run
from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.tables.store import MemoryTable
from engram.training.corpus import build_corpus
from engram.training.optim import TABLE_OPTIMIZERS
from engram.training.train import TrainConfig, build_run, train_step, try_resume

sys.path.insert(0, str(Path(__file__).parent))
from record import SMOKE, with_allocator_env, write_json  # noqa: E402  (benchmarks/record.py)



def engram_config(small: dict, cc: CompareConfig) -> TrainConfig:
    """compare's Engram variant (FFN trimmed to dense's activated parameters) at its budget."""
    base = budget(TrainConfig(**small), cc)
    corpus = build_corpus(base.data_config())
    return variant_configs(base, corpus.vocab_size)["engram"]


def losses(cfg: TrainConfig, optimizers: list[str], seeds: list[int], workers: int,
           runs: Path) -> dict:
    # seed-major: with fewer seeds finished, every optimiser has as many
    jobs = [job(f"engram-{o}", dataclasses.replace(cfg, table_optimizer=o), s, runs)
            for s in seeds for o in optimizers]
    results = run_jobs(jobs, train_run, workers, "table optimiser runs")
    out = {}
    for o in optimizers:
        rs = [r for j, r in zip(jobs, results) if j.cfg.table_optimizer == o]
        vals = [r["val_loss"] for r in rs]
        out[o] = {"val_loss": statistics.mean(vals), "val_loss_per_seed": vals,
                  "seed_spread": seed_spread(vals), "seeds": [r["seed"] for r in rs],
                  "tokens_per_s_in_run": [r["tokens_per_s"] for r in rs],
                  "wall_s": [r["wall_s"] for r in rs], "out_dirs": [r["out_dir"] for r in rs]}
    base = out[optimizers[0]]["val_loss"]
    for o in optimizers:
        out[o]["val_loss_minus_baseline"] = out[o]["val_loss"] - base
    return out


def tables_of(model: torch.nn.Module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, MemoryTable) and all(m.weight is not t for t in seen):
            seen.append(m.weight)
    return seen


def state(out_dir: str, cfg: TrainConfig) -> dict:
    """Bytes of the table optimiser's state in a finished run (its final checkpoint)."""
    run = build_run(dataclasses.replace(cfg, out_dir=out_dir))
    if not try_resume(run):
        raise RuntimeError(f"{out_dir} has no checkpoint")
    opt = run.optim.tables
    touched = saved = held = table_rows = 0
    width = None
    for w in tables_of(run.model):
        b = opt.state_bytes(w)
        touched, saved, held = touched + b["rows"], saved + b["saved"], held + b["held"]
        table_rows, width = table_rows + w.shape[0], w.shape[1]
    row_bytes = width * 4  # float32 rows
    return {"optimizer": type(opt).__name__, "table_rows": table_rows, "row_width": width,
            "row_bytes": row_bytes, "touched_rows": touched,
            "touched_fraction": touched / table_rows,
            "saved_bytes": saved, "saved_bytes_per_touched_row": saved / touched,
            "held_bytes": held, "held_bytes_per_touched_row": held / touched,
            "held_bytes_per_table_row": held / table_rows,
            "held_over_table_bytes": held / (table_rows * row_bytes)}


def speed(cfg: TrainConfig, optimizers: list[str], steps: int, warmup: int) -> dict:
    runs = {o: build_run(dataclasses.replace(cfg, table_optimizer=o,
                                             out_dir="/tmp/engram-bench-table-optimizer-speed"))
            for o in optimizers}
    opt_cpu: dict[str, list[float]] = {o: [] for o in runs}
    for o, run in runs.items():  # the table optimiser's own step, in CPU time (robust to load)
        inner, acc = run.optim.tables.step, opt_cpu[o]

        def timed(closure=None, inner=inner, acc=acc):
            t0 = time.process_time()
            out = inner(closure)
            acc.append(time.process_time() - t0)
            return out

        run.optim.tables.step = timed
    wall: dict[str, list[float]] = {o: [] for o in runs}
    cpu: dict[str, list[float]] = {o: [] for o in runs}
    for i in range(warmup + steps):
        for o, run in runs.items():
            run.step = i
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(run)
            if i >= warmup:
                wall[o].append(time.perf_counter() - t0)
                cpu[o].append(time.process_time() - c0)
    tokens = cfg.batch_size * cfg.seq_len
    out = {o: {"median_step_s": statistics.median(wall[o]),
               "tokens_per_s": tokens / statistics.median(wall[o]),
               "median_step_cpu_ms": 1e3 * statistics.median(cpu[o]),
               "tokens_per_cpu_s": tokens / statistics.median(cpu[o]),
               "table_step_cpu_ms": 1e3 * statistics.median(opt_cpu[o][warmup:])} for o in runs}
    base = out[optimizers[0]]
    for o in runs:
        out[o]["tokens_per_s_over_baseline"] = out[o]["tokens_per_s"] / base["tokens_per_s"]
        out[o]["tokens_per_cpu_s_over_baseline"] = (out[o]["tokens_per_cpu_s"]
                                                    / base["tokens_per_cpu_s"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated (compare's default seeds)")
    ap.add_argument("--optimizers", default=",".join(TABLE_OPTIMIZERS),
                    help="comma-separated, the baseline first")
    ap.add_argument("--workers", type=int, default=2, help="parallel training processes")
    ap.add_argument("--runs", default="/tmp/engram-bench-table-optimizer",
                    help="the training runs' folders (reused: finished runs are read back)")
    ap.add_argument("--speed_steps", type=int, default=30, help="interleaved timed steps, 0 skips")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 6 steps, one seed (CI)")
    args = ap.parse_args(argv)
    small, cc = {}, CompareConfig()
    if args.smoke:
        small = SMOKE
        cc = CompareConfig(steps=6, batch_size=2, seq_len=16, eval_every=3, eval_batches=2,
                           ckpt_every=3)
        args.seeds, args.speed_steps = "0", min(args.speed_steps, 2)
        args.runs = args.runs + "-smoke"
    with_allocator_env()
    torch.set_num_threads(1)  # as compare's workers
    optimizers = args.optimizers.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = engram_config(small, cc)
    load0, t0 = os.getloadavg(), time.perf_counter()
    loss = losses(cfg, optimizers, seeds, args.workers, Path(args.runs))
    res = {"cpu": machine.cpu_id(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "gemm_backend": gemm.backend(), "baseline": optimizers[0],
           "budget": {"steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                      "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "lr": cfg.lr,
                      "table_lr_mult": cfg.table_lr_mult, "seeds": seeds,
                      "workers": args.workers, "smoke": args.smoke},
           "model": {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "d_ff": cfg.d_ff,
                     "table_size": cfg.table_size, "engram_layers": list(cfg.engram_layers)},
           "loss": loss,
           "state": {o: state(loss[o]["out_dirs"][0], dataclasses.replace(cfg, table_optimizer=o))
                     for o in optimizers},
           "load_avg": {"start": load0, "after_runs": os.getloadavg()},
           "runs_wall_s": time.perf_counter() - t0}
    if args.speed_steps:
        res["speed"] = speed(cfg, optimizers, args.speed_steps, 3)
        res["load_avg"]["after_speed"] = os.getloadavg()
    print(f"CPU: {res['cpu']}; {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len}, seeds {seeds}")
    for o in optimizers:
        lo, st = loss[o], res["state"][o]
        line = (f"{o:>8}: val loss {lo['val_loss']:.4f} ({lo['val_loss_minus_baseline']:+.4f} vs "
                f"{optimizers[0]}; per seed {', '.join(f'{v:.4f}' for v in lo['val_loss_per_seed'])})"
                f"; state {st['saved_bytes_per_touched_row']:.0f} B a touched row saved, "
                f"{st['held_bytes_per_touched_row']:.0f} B held (row: {st['row_bytes']} B)")
        if "speed" in res:
            sp = res["speed"][o]
            line += (f"; {sp['tokens_per_s']:,.0f} tok/s ({sp['tokens_per_s_over_baseline']:.3f}x), "
                     f"table step {sp['table_step_cpu_ms']:.1f} ms CPU")
        print(line)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
