"""Sharded lookup cost against the all-to-all it cannot avoid, and bytes moved against the minimum.

    python benchmarks/sharded.py --world 2 --json sharded.json [--smoke]

``--world`` gloo processes on loopback (or run under torchrun, which sets the environment) hold a
row-sharded table. Every step each rank looks up ``tokens x heads`` Zipf-ranked ids (n-gram traffic
is Zipfian, spec section 4) spread over the whole table. Figures:

- time: ShardedTable.lookup (forward; and forward + backward) over a bare ``all_to_all_single`` of
  the same row payload with the same splits, i.e. the cost of routing (unique, counts and ids
  exchange, gather, scatter) on top of moving the rows. Each time is the slowest rank's (a
  collective ends when its last rank does), median over steps.
- bytes per token: what the lookup sends (counts + ids + rows; backward: row grads) over the
  minimum, unique rows x row bytes (each rank must receive each distinct row it reads once), and
  what a lookup without de-duplication would move. "off-rank" leaves out the chunk a rank
  sends to itself (a local copy, not network traffic).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from engram.tables.sharded import ShardedTable
from engram.training.process_group import init_distributed, spawn_local


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float) -> torch.Tensor:
    ranks = rng.zipf(a, n).astype(np.uint64) - np.uint64(1)
    return torch.from_numpy(((ranks * np.uint64(2654435761)) % np.uint64(rows)).astype(np.int64))


def timed(fn, d) -> float:
    """Wall time of a collective: from a common start to the slowest rank's end."""
    dist.barrier(group=d.control)
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.control)
    return float(t)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    d = init_distributed(timeout_s=120)
    table = ShardedTable(args.rows, args.dim, group=d.tables, init_std=0.02, seed=0)
    row_bytes = args.dim * table.weight.element_size()
    rng = np.random.default_rng([args.seed, d.rank])
    # The same lookup with no communication (a whole table in one process): the local work alone.
    alone = None
    if args.local:
        solo = [dist.new_group([r], backend="gloo") for r in range(d.world)][d.rank]  # collective
        alone = ShardedTable(args.rows, args.dim, group=solo, init_std=0.02)
    times = {"lookup": [], "lookup_fwd_bwd": [], "bare_all_to_all": [], "local_work": []}
    sent = {"fwd": 0, "fwd_off_rank": 0, "bwd": 0, "min": 0, "no_dedup": 0}
    n_ids = args.tokens * args.heads
    for step in range(args.warmup + args.steps):
        ids = zipf_ids(rng, n_ids, args.rows, args.zipf).view(args.tokens, args.heads)
        uniq = torch.unique(ids)
        send, recv, asked = table._route(uniq)  # the splits the lookup will use (untimed)
        served = table.weight.detach().index_select(0, asked)  # [s, e]
        out = served.new_empty(uniq.numel(), args.dim)  # [u, e]
        t_bare = timed(lambda: dist.all_to_all_single(out, served, send, recv, group=d.tables), d)
        with torch.no_grad():
            t_look = timed(lambda: table.lookup(ids), d)

        def fwd_bwd():
            table.lookup(ids).sum().backward()
            table.weight.grad = None
        t_train = timed(fwd_bwd, d)
        if alone is not None:
            with torch.no_grad():
                t0 = time.perf_counter()
                alone.lookup(ids)
                times["local_work"].append(time.perf_counter() - t0)
        if step < args.warmup:
            continue
        for k, t in zip(times, (t_look, t_train, t_bare)):
            times[k].append(t)
        counts = 2 * 8 * d.world  # the (count, error flag) pairs
        sent["fwd"] += counts + 8 * uniq.numel() + row_bytes * asked.numel()
        mine = recv[d.rank]  # rows this rank serves itself
        sent["fwd_off_rank"] += (counts + 8 * (uniq.numel() - send[d.rank])
                                 + row_bytes * (asked.numel() - mine))
        sent["bwd"] += row_bytes * uniq.numel()
        sent["min"] += row_bytes * uniq.numel()
        sent["no_dedup"] += (8 + row_bytes) * n_ids
    totals = torch.tensor([float(v) for v in sent.values()], dtype=torch.float64)
    dist.all_reduce(totals, group=d.control)
    if d.rank == 0:
        tokens = args.tokens * args.steps * d.world
        per_token = {k: v / tokens for k, v in zip(sent, totals.tolist())}
        med = {k: statistics.median(v) for k, v in times.items() if v}
        res = {"config": {**vars(args), "world": d.world, "row_bytes": row_bytes},
               "median_s": med, "bytes_per_token": per_token,
               "ratio_lookup_over_bare": med["lookup"] / med["bare_all_to_all"],
               "ratio_fwd_bwd_over_bare": med["lookup_fwd_bwd"] / med["bare_all_to_all"],
               "ratio_bytes_over_min": per_token["fwd"] / per_token["min"],
               "ratio_off_rank_bytes_over_min": per_token["fwd_off_rank"] / per_token["min"],
               "ratio_no_dedup_over_min": per_token["no_dedup"] / per_token["min"],
               "unique_ids_per_rank_step": per_token["min"] * args.tokens / row_bytes}
        print(f"world {d.world}, table {args.rows:,} x {args.dim} fp32, {args.tokens:,} tokens x "
              f"{args.heads} heads a rank a step ({res['unique_ids_per_rank_step']:,.0f} distinct)")
        for k, v in med.items():
            print(f"  {k:>16}: {v * 1e3:8.2f} ms")
        print(f"  lookup / bare all-to-all: {res['ratio_lookup_over_bare']:.2f}x   "
              f"fwd+bwd / bare: {res['ratio_fwd_bwd_over_bare']:.2f}x")
        print(f"  bytes/token: {per_token['fwd']:.0f} sent "
              f"(off-rank {per_token['fwd_off_rank']:.0f})"
              f", minimum {per_token['min']:.0f}, without dedup {per_token['no_dedup']:.0f}; "
              f"backward {per_token['bwd']:.0f}")
        print(f"  sent / minimum: {res['ratio_bytes_over_min']:.3f}x   off-rank / minimum: "
              f"{res['ratio_off_rank_bytes_over_min']:.3f}x   no-dedup / minimum: "
              f"{res['ratio_no_dedup_over_min']:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2,
                    help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=32, help="row width (fp32)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a rank a step")
    ap.add_argument("--heads", type=int, default=8, help="ids a token (hash heads x orders)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--local", type=int, default=1,
                    help="also time the lookup's local work alone (holds a whole table per rank)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--smoke", action="store_true", help="a small table, 2 steps (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.tokens, args.steps, args.warmup = 10_000, 64, 2, 1
    if "RANK" in os.environ:  # torchrun
        worker(args)
    else:
        spawn_local(worker, args.world, args)


if __name__ == "__main__":
    main()
