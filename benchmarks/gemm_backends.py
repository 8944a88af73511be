"""float32 matrix products here: the route engram/compute/gemm.py chooses against each backend forced.

    python benchmarks/gemm_backends.py [--json benchmarks/results/gemm_backends.json] [--smoke]

For each shape this package multiplies (the compare model's attention, SwiGLU, MoE experts, LM
head, adaptive-softmax tail and Engram value + key GEMM at d = 128; the module's GEMM at the
demo's shapes; decode steps), on 1 and 2 threads: the route ``ENGRAM_GEMM=auto`` decides (measured
in this run into a fresh decisions file, unless --user_cache; the decision's own timing beside it),
then y = x W^T forward alone and forward + backward (dx, dW) through ``engram.compute.gemm.linear`` with the
chosen route, with torch forced and with oneDNN forced, interleaved in one process, as many rounds
as --budget_s allows (7 to 61). Prints the chosen route's speed against each forced backend (the
chosen one should be the faster, within noise; against the backend it chose, the ratio is the
noise itself) and writes everything with the CPU model.

Ratios are of medians; the fastest samples are kept too. On this shared 2-core machine a run's
samples fall in two modes ~2x apart and the fast one is rare at milliseconds a sample, so minima
do not compare two variants here (gemm.measure's ~0.2 ms samples do find it). Runs with
engram.training.train.ALLOCATOR_ENV (freed memory kept), so a backward's fresh gradients do not
page-fault in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engram.compute import gemm, gemm_decisions, machine
from record import with_allocator_env, write_json  # benchmarks/record.py: the script's folder is on sys.path

# (name, rows n, in i, out o): the compare model (d = 128, batch 16 x 128 tokens) and the module
SHAPES = [
    ("attn qkv", 2048, 128, 384), ("attn proj", 2048, 128, 128), ("swiglu up", 2048, 128, 512),
    ("swiglu down", 2048, 512, 128), ("moe expert", 100, 128, 512),
    ("adaptive head", 2048, 128, 2052), ("adaptive tail", 400, 32, 6144),
    ("engram kv", 2048, 256, 256), ("engram demo kv", 2048, 1024, 5120),
    ("decode kv", 4, 1024, 5120), ("decode qkv", 16, 128, 384),
]
VARIANTS = ("chosen", "torch", "onednn")


def time_variants(n: int, i: int, o: int, budget_s: float) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, i, generator=g, requires_grad=True)
    w = torch.randn(o, i, generator=g, requires_grad=True)
    gy = torch.randn(n, o, generator=g)

    def fwd():
        with torch.no_grad():
            gemm.linear(x, w)

    def fwd_bwd():
        gemm.linear(x, w).backward(gy)
        x.grad = w.grad = None

    backends = {"chosen": None, "torch": "torch", "onednn": "onednn"}
    out = {}
    for k, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        for v in VARIANTS:  # warm: the route's first use, oneDNN's primitives
            with gemm.using(backends[v]):
                fn()
        t0 = time.perf_counter()
        for v in VARIANTS:  # a round's time, for the number of rounds
            with gemm.using(backends[v]):
                fn()
        # under load only many samples hold a clean one: as many rounds as the budget allows
        rounds = max(7, min(61, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
        samples = {v: [] for v in VARIANTS}
        for r in range(rounds):  # interleaved, rotating order: load from elsewhere hits all alike
            for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                with gemm.using(backends[v]):
                    t1 = time.perf_counter()
                    fn()
                    samples[v].append(time.perf_counter() - t1)
        med = {v: statistics.median(samples[v]) for v in VARIANTS}
        out[k] = {"rounds": rounds, "median_ms": {v: t * 1e3 for v, t in med.items()},
                  "best_ms": {v: min(samples[v]) * 1e3 for v in VARIANTS},
                  "chosen_vs_torch": med["torch"] / med["chosen"],
                  "chosen_vs_onednn": med["onednn"] / med["chosen"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--budget_s", type=float, default=2.0,
                    help="seconds of samples per shape, pass and thread count")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--note", default="", help="recorded with the figures")
    ap.add_argument("--user_cache", action="store_true",
                    help="use the decisions already in the user's cache instead of measuring")
    ap.add_argument("--smoke", action="store_true",
                    help="three small shapes, one thread, minimal samples (CI)")
    args = ap.parse_args()
    shapes = SHAPES
    if args.smoke:
        args.budget_s, args.threads = 0.0, "1"
        shapes = [s for s in SHAPES if s[0] in ("attn proj", "moe expert", "decode qkv")]
    with_allocator_env()
    if not gemm._onednn_available():
        raise SystemExit("this torch build has no oneDNN: nothing to compare")
    if not args.user_cache:
        os.environ["ENGRAM_GEMM_CACHE"] = str(Path(tempfile.mkdtemp()) / "gemm_routes.json")
    gemm.set_backend("auto")
    cpu = machine.cpu_id()  # under both keys, as earlier records have them
    res = {"cpu": cpu, "cpu_id": cpu, "torch": torch.__version__,
           "note": args.note, "min_macs": gemm.MIN_MACS, "margin": gemm.MARGIN, "decisions": "user cache"
           if args.user_cache else "measured in this run", "load_avg_before": os.getloadavg(),
           "threads": {}}
    print(f"{res['cpu_id']}, torch {res['torch']}; routes {res['decisions']}")
    worst = 1.0
    for th in (int(s) for s in args.threads.split(",")):
        torch.set_num_threads(th)
        rows = {}
        for name, n, i, o in shapes:
            t0 = time.perf_counter()
            chosen = gemm.route(n, i, o)
            decide_s = time.perf_counter() - t0
            key = gemm.bucket(n, i, o)
            record = (gemm_decisions.read(gemm_decisions.cache_path(), gemm._machine()).get(key)
                      if n * i * o >= gemm.MIN_MACS else None)
            r = time_variants(n, i, o, args.budget_s)
            rows[name] = {"shape": [n, i, o], "route": chosen, "bucket": key,
                          "decision": record, "decide_s": decide_s, **r}
            fb = r["fwd_bwd"]
            worst = min(worst, fb["chosen_vs_torch"], fb["chosen_vs_onednn"])
            why = (f"measured {record['onednn_speedup']:.2f}x at {key}" if record else
                   "under MIN_MACS" if n * i * o < gemm.MIN_MACS else "cached")
            print(f"{th} thread(s) {name:>14} {n:5d} x {i:4d} -> {o:5d}: {chosen:6} ({why}); "
                  f"chosen / torch speed fwd {r['fwd']['chosen_vs_torch']:.2f}x fwd+bwd "
                  f"{fb['chosen_vs_torch']:.2f}x, chosen / oneDNN fwd "
                  f"{r['fwd']['chosen_vs_onednn']:.2f}x fwd+bwd {fb['chosen_vs_onednn']:.2f}x",
                  flush=True)
        res["threads"][str(th)] = rows
    res["worst_chosen_vs_forced_fwd_bwd"] = worst
    res["load_avg_after"] = os.getloadavg()
    print(f"worst chosen / forced fwd+bwd: {worst:.2f}x")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
