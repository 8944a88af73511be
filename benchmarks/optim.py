"""RowAdam step time follows touched rows, not table size; dense Adam for contrast.

    python benchmarks/optim.py --json optim.json [--smoke]

The same Zipf-ranked id batches (n-gram traffic is Zipfian, spec section 4), hashed over each
table's full row range so every table sees the same number of distinct rows a step, drive a small
and a large table. Figure of merit: median RowAdam step time large / small (goal ~1). Defaults:
1M vs 50M rows of width 16, float32 (the large table is 3.2 GB), 16,384 ids a step. The cases run
interleaved, step by step, so load from other processes hits all of them alike. Building the
sparse grad is outside the timer; the RowAdam step (coalesce, slot lookup, growth, update) is
inside. The first step, which allocates the one O(rows) slot map, is reported on its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from engram.training.row_optim import RowAdam


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def id_batches(n_steps: int, batch: int, rows: int, zipf_a: float, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        ranks = rng.zipf(zipf_a, batch).astype(np.uint64) - np.uint64(1)
        spread = (ranks * np.uint64(2654435761)) % np.uint64(rows)  # rank -> row, whole table
        out.append(torch.from_numpy(spread.astype(np.int64)))
    return out


class Case:
    """One table and its optimiser; ``dense`` gives torch.optim.Adam the densified gradient."""

    def __init__(self, rows: int, dim: int, dense: bool = False):
        self.rows, self.dim, self.dense = rows, dim, dense
        self.weight = torch.nn.Parameter(torch.empty(rows, dim).uniform_(-0.01, 0.01))
        opt = torch.optim.Adam if dense else RowAdam
        self.opt = opt([self.weight], lr=1e-3, betas=(0.9, 0.95))
        self.times: list[float] = []
        self.first = 0.0

    def step(self, ids: torch.Tensor, grad: torch.Tensor) -> float:
        if self.dense:
            self.weight.grad = torch.zeros(self.rows, self.dim).index_add_(0, ids, grad)
        else:
            self.weight.grad = torch.sparse_coo_tensor(
                ids.unsqueeze(0), grad, (self.rows, self.dim), check_invariants=False)
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0

    def report(self) -> dict:
        out = {"rows": self.rows, "median_step_s": statistics.median(self.times),
               "mean_step_s": statistics.fmean(self.times), "first_step_s": self.first,
               "table_bytes": self.weight.numel() * self.weight.element_size()}
        st = self.opt.state[self.weight]
        out["state_bytes"] = sum(t.numel() * t.element_size() for t in st.values()
                                 if isinstance(t, torch.Tensor))
        if not self.dense:
            out["touched_rows"] = st["n"]
        return out


def run(small: int = 1_000_000, large: int = 50_000_000, dim: int = 16, batch: int = 16_384,
        steps: int = 30, warmup: int = 5, zipf: float = 1.1) -> dict:
    """Step the three cases interleaved on the same gradients; figures and ratios as a dict."""
    cases = {"row_adam_small": Case(small, dim), "row_adam_large": Case(large, dim),
             "dense_adam_small": Case(small, dim, dense=True)}
    batches = {name: id_batches(steps, batch, c.rows, zipf, seed=0) for name, c in cases.items()}
    gen = torch.Generator().manual_seed(0)
    for i in tqdm(range(steps), desc="optimiser steps"):
        grad = torch.randn(batch, dim, generator=gen)
        for name, c in cases.items():
            dt = c.step(batches[name][i], grad)
            if i == 0:
                c.first = dt
            elif i >= warmup:
                c.times.append(dt)
    res = {name: c.report() for name, c in cases.items()}
    uniq = statistics.fmean(len(torch.unique(b)) for b in batches["row_adam_large"])
    res.update(config={"small": small, "large": large, "dim": dim, "batch": batch, "steps": steps,
                       "warmup": warmup, "zipf": zipf, "dtype": "float32",
                       "distinct_ids_per_step": uniq},
               ratio_large_over_small=(res["row_adam_large"]["median_step_s"]
                                       / res["row_adam_small"]["median_step_s"]),
               ratio_dense_over_row_adam=(res["dense_adam_small"]["median_step_s"]
                                          / res["row_adam_small"]["median_step_s"]),
               peak_rss_gib=peak_rss_gib())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--small", type=int, default=1_000_000)
    ap.add_argument("--large", type=int, default=50_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16_384, help="ids a step, before dedup")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on a shared 2-core box a 2-thread parallel "
                         "region stalls a scheduler slice (~8 ms) whenever the other core is busy")
    ap.add_argument("--smoke", action="store_true", help="small tables, 3 steps (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.small, args.large, args.batch, args.steps, args.warmup = 10_000, 100_000, 512, 3, 1
    torch.set_num_threads(args.threads)
    res = run(args.small, args.large, args.dim, args.batch, args.steps, args.warmup, args.zipf)
    res["config"]["threads"] = args.threads
    small, large, dense = res["row_adam_small"], res["row_adam_large"], res["dense_adam_small"]
    uniq = res["config"]["distinct_ids_per_step"]

    mib = 2**20
    for label, r in (("RowAdam", small), ("RowAdam", large), ("dense Adam", dense)):
        print(f"{label:>10} step, {r['rows']:>11,} x {args.dim}: "
              f"{r['median_step_s'] * 1e3:8.2f} ms  (first {r['first_step_s'] * 1e3:7.1f} ms; "
              f"state {r['state_bytes'] / mib:6.0f} MiB,"
              f" table {r['table_bytes'] / mib:6.0f} MiB)")
    print(f"RowAdam {args.large:,} / {args.small:,} rows: {res['ratio_large_over_small']:.2f}x "
          f"(goal ~1); dense Adam / RowAdam at {args.small:,}: "
          f"{res['ratio_dense_over_row_adam']:.1f}x")
    print(f"{args.batch:,} ids a step ({uniq:,.0f} distinct), {args.threads} thread(s), "
          f"peak RSS {res['peak_rss_gib']:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
