"""Training speed: tokens/s dense vs Engram, RowAdam 1M vs 50M rows, and peak memory.

    python benchmarks/train.py [--json out/bench_train.json]

1. Throughput. The `engram compare` configs (dense, and Engram with the FFN trimmed to the same
   activated parameters) train on the package corpus, step by step interleaved in one process (so
   load from other processes hits both alike), full training steps: batch + hash ids, forward,
   backward, clip, AdamW + RowAdam. Figure: Engram tokens/s / dense tokens/s (the cost of the
   memory at equal FLOPs; goal close to 1).
2. Memory. Each variant again, alone in a fresh process: peak RSS after model + corpus, and after
   training steps (gradients and optimiser state included).
3. Optimiser. RowAdam step time with a table of 1M vs 50M rows at the same batch (see
   benchmarks/optim.py, run here with the same defaults): goal ~1, cost follows touched rows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, build_run, train_step

sys.path.insert(0, str(Path(__file__).parent))
import optim as optim_bench  # noqa: E402  (benchmarks/optim.py)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Restart VmHWM (peak RSS) from the current RSS (Linux >= 4.0), so a phase's peak is its own."""
    Path("/proc/self/clear_refs").write_text("5")


def configs(batch: int, seq: int) -> dict[str, TrainConfig]:
    base = budget(TrainConfig(out_dir="/tmp/engram-bench-train", threads=1),
                  CompareConfig(batch_size=batch, seq_len=seq))
    corpus = build_corpus(base.data_config())
    return {k: v for k, v in variant_configs(base, corpus.vocab_size).items() if k != "moe"}


def step(run, i: int) -> None:
    run.step = i  # hashing included: batch i and its hash ids are built inside the step
    train_step(run)


def throughput(cfgs: dict[str, TrainConfig], steps: int, warmup: int) -> dict:
    runs = {name: build_run(cfg) for name, cfg in cfgs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in tqdm(range(warmup + steps), desc="train steps (interleaved)"):
        for name, run in runs.items():
            t0 = time.perf_counter()
            step(run, i)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    cfg = next(iter(cfgs.values()))
    tokens = cfg.batch_size * cfg.seq_len
    out = {}
    for name, ts in times.items():
        pc = runs[name].model.param_counts()
        out[name] = {"median_step_s": statistics.median(ts), "tokens_per_s":
                     tokens / statistics.median(ts), "active_params": pc["active"],
                     "total_params": pc["total"], "table_params": pc["table"]}
    return out


def _memory_child(args: tuple[TrainConfig, int]) -> dict:
    cfg, steps = args
    torch.set_num_threads(1)
    corpus = build_corpus(cfg.data_config())
    reset_peak_rss()
    before = _status_mib("VmRSS")
    run = build_run(cfg, corpus)  # model, optimisers, batches (the corpus is shared by both)
    built = _status_mib("VmRSS")
    reset_peak_rss()
    for i in range(steps):
        step(run, i)
    return {"rss_corpus_mib": before, "rss_built_mib": built, "model_mib": built - before,
            "peak_rss_train_mib": _status_mib("VmHWM"),
            "train_over_built_mib": _status_mib("VmHWM") - built}


def memory(cfgs: dict[str, TrainConfig], steps: int) -> dict:
    out = {}
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a fresh process each
        for name, cfg in tqdm(cfgs.items(), desc="peak memory (fresh process each)"):
            out[name] = pool.apply(_memory_child, ((cfg, steps),))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--memory_steps", type=int, default=5)
    ap.add_argument("--optim_steps", type=int, default=30)
    ap.add_argument("--skip_optim", action="store_true", help="skip the 1M vs 50M rows part")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in `engram compare`: one thread per training process

    cfgs = configs(args.batch, args.seq)
    speed = throughput(cfgs, args.steps, args.warmup)
    mem = memory(cfgs, args.memory_steps)
    res = {"config": vars(args), "throughput": speed, "memory": mem,
           "engram_over_dense_tokens_per_s":
               speed["engram"]["tokens_per_s"] / speed["dense"]["tokens_per_s"]}
    for name in cfgs:
        s, m = speed[name], mem[name]
        print(f"{name:>7}: {s['tokens_per_s']:8,.0f} tok/s  ({s['median_step_s'] * 1e3:6.0f} ms a "
              f"step of {args.batch}x{args.seq}); active {s['active_params']:,}, tables "
              f"{s['table_params']:,}; model + optimisers {m['model_mib']:,.0f} MiB, peak RSS "
              f"while training {m['peak_rss_train_mib']:,.0f} MiB "
              f"(+{m['train_over_built_mib']:,.0f} MiB over the built model)")
    print(f"Engram / dense tokens/s at equal activated parameters: "
          f"{res['engram_over_dense_tokens_per_s']:.3f}")
    if not args.skip_optim:
        res["optimizer"] = optim_bench.run(steps=args.optim_steps)
        o = res["optimizer"]
        print(f"RowAdam step, 50M / 1M rows at the same batch: {o['ratio_large_over_small']:.2f}x "
              f"(goal ~1); dense Adam / RowAdam at 1M rows: {o['ratio_dense_over_row_adam']:.1f}x; "
              f"peak RSS {o['peak_rss_gib']:.2f} GiB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
