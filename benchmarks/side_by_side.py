"""Two training runs side by side vs one alone: what `engram compare`'s second worker costs.

    python benchmarks/side_by_side.py --json out/side_by_side.json [--rounds 3] [--smoke]

The compare variants (dense, Engram, MoE) are stepped on the study runner's own workers
(studies/common.Workers: spawned, one torch thread and one numba thread each, the allocator
settings) by the compare estimate's probe (studies/estimate.probe): each worker builds one run of
every variant and steps them in turn. ``alone``: one worker. ``pair``: two workers at once (each
step timed while the other worker steps). The phases alternate ``--rounds`` times, so load from
other processes falls on both alike; the load average is recorded beside each phase.

Figures per variant: tokens/s of one run (wall), CPU ms a step, and pair / alone for both. CPU
time is the robust one on a shared machine: a step's CPU time grows only from contention inside
the core's caches and memory (the pair's cost), its wall time also from waiting for a CPU.
``throughput_pair_over_alone``: two runs' tokens/s together over one run's (2.0 = no contention).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from engram.compute import machine
from engram.studies.common import Workers
from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.studies.estimate import probe
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig
from record import SMOKE, write_json  # benchmarks/record.py: the script's folder is on sys.path


def kinds(smoke: bool) -> list[tuple[str, TrainConfig]]:
    base = TrainConfig(out_dir="/tmp/engram-side-by-side", **(SMOKE if smoke else {}))
    cc = CompareConfig(batch_size=2, seq_len=16) if smoke else CompareConfig()
    base = budget(base, cc)
    vocab = build_corpus(base.data_config()).vocab_size
    return list(variant_configs(base, vocab).items())


def pinned_probe(task):
    """The probe with this worker pinned to CPU ``rank`` (--pin)."""
    os.sched_setaffinity(0, {task[0] % os.cpu_count()})
    return probe(task)


def phase(workers: int, ks, steps: int, warmup: int, pin: bool = False) -> dict:
    load = os.getloadavg()
    t0 = time.perf_counter()
    with Workers(workers) as pool:
        per = pool.each(pinned_probe if pin else probe,
                        [(r, ks, steps, warmup, 2) for r in range(workers)])
    return {"workers": workers, "load_before": load, "load_after": os.getloadavg(),
            "wall_s": time.perf_counter() - t0,
            "step_ms": {n: statistics.mean(p[n]["step_s"] for p in per) * 1e3 for n, _ in ks},
            "step_cpu_ms": {n: statistics.mean(p[n]["step_cpu_s"] for p in per) * 1e3
                            for n, _ in ks}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant and phase")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alone/pair alternations")
    ap.add_argument("--pin", action="store_true", help="pin worker k to CPU k")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the workers' environment (e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 round (CI)")
    args = ap.parse_args()
    for kv in args.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    if args.smoke:
        args.steps, args.warmup, args.rounds = 2, 1, 1
    ks = kinds(args.smoke)
    tokens = ks[0][1].batch_size * ks[0][1].seq_len
    phases = []
    for r in range(args.rounds):
        for w in ((1, 2) if r % 2 == 0 else (2, 1)):
            phases.append(phase(w, ks, args.steps, args.warmup, args.pin))
            p = phases[-1]
            print(f"round {r} {'alone' if w == 1 else 'pair '}: " + ", ".join(
                f"{n} {p['step_ms'][n]:.0f} ms ({p['step_cpu_ms'][n]:.0f} CPU)" for n, _ in ks)
                + f"; load {p['load_before'][0]:.1f}", flush=True)
    res = {"cpu": machine.cpu_id(), "cpus": os.cpu_count(), "config": vars(args),
           "tokens_per_step": tokens, "phases": phases, "variants": {}}
    for n, _ in ks:
        def mean(w, key):
            return statistics.mean(p[key][n] for p in phases if p["workers"] == w)
        alone, pair = mean(1, "step_ms"), mean(2, "step_ms")
        alone_cpu, pair_cpu = mean(1, "step_cpu_ms"), mean(2, "step_cpu_ms")
        res["variants"][n] = {
            "alone_tokens_per_s": tokens / alone * 1e3, "pair_tokens_per_s_per_run":
                tokens / pair * 1e3, "alone_step_cpu_ms": alone_cpu, "pair_step_cpu_ms": pair_cpu,
            "pair_over_alone_wall": pair / alone, "pair_over_alone_cpu": pair_cpu / alone_cpu,
            "throughput_pair_over_alone": 2 * alone / pair}
        v = res["variants"][n]
        print(f"{n:>7}: alone {v['alone_tokens_per_s']:,.0f} tok/s, pair {v['pair_tokens_per_s_per_run']:,.0f}"
              f" tok/s a run; a step's CPU time side by side {v['pair_over_alone_cpu']:.3f}x alone's,"
              f" wall {v['pair_over_alone_wall']:.3f}x; two runs' throughput "
              f"{v['throughput_pair_over_alone']:.2f}x one's")
    print(f"CPU: {res['cpu']} ({res['cpus']} CPUs)")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    sys.exit(main())
