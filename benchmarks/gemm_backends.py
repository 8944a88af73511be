"""float32 matrix products on this CPU: torch's default (MKL) vs oneDNN (engram/gemm.py).

    python benchmarks/gemm_backends.py [--json benchmarks/results/gemm_backends.json]

For each shape this package multiplies (the compare model's attention, SwiGLU, MoE experts and LM
head at d = 128; the Engram module's value + key GEMM at the demo's shapes; a decode step), times
y = x W^T forward alone and forward + backward (dx, dW) through ``F.linear`` and through
``engram.gemm.linear`` with the oneDNN backend, interleaved in one process (medians), on 1 and 2
threads. Prints each ratio and writes them with the CPU model and the backend ``auto`` picks here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engram import gemm

# (name, rows n, in i, out o): the compare model (d = 128, batch 16 x 128 tokens) and the module
SHAPES = [
    ("attn qkv", 2048, 128, 384), ("attn proj", 2048, 128, 128), ("swiglu up", 2048, 128, 512),
    ("swiglu down", 2048, 512, 128), ("moe expert", 100, 128, 512),
    ("adaptive head", 2048, 128, 2052), ("engram demo kv", 2048, 1024, 5120),
    ("decode kv", 4, 1024, 5120), ("decode qkv", 16, 128, 384),
]


def median_s(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(n: int, i: int, o: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, i, generator=g, requires_grad=True)
    w = torch.randn(o, i, generator=g, requires_grad=True)
    gy = torch.randn(n, o, generator=g)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(x, w)
        return run

    def fwd_bwd(fn):
        def run():
            fn(x, w).backward(gy)
            x.grad = w.grad = None
        return run

    def onednn(a, b):
        with gemm.using("onednn"):
            return gemm.linear(a, b)
    fns = {"fwd_torch": fwd(F.linear), "fwd_onednn": fwd(onednn),
           "fwd_bwd_torch": fwd_bwd(F.linear), "fwd_bwd_onednn": fwd_bwd(onednn)}
    times = {k: [] for k in fns}
    for _ in range(rounds):  # interleaved: load from elsewhere hits both alike
        for k, fn in fns.items():
            times[k].append(median_s(fn, 3))
    t = {k: statistics.median(v) for k, v in times.items()}
    with gemm.using("onednn"):
        routed = gemm._routes(x, w, None)
    return {"ms": {k: v * 1e3 for k, v in t.items()}, "routed_by_default_threshold": routed,
            "fwd_speedup": t["fwd_torch"] / t["fwd_onednn"],
            "fwd_bwd_speedup": t["fwd_bwd_torch"] / t["fwd_bwd_onednn"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = ap.parse_args()
    if not gemm._onednn_available():
        raise SystemExit("this torch build has no oneDNN: nothing to compare")
    res = {"cpu": gemm.cpu_model(), "cpu_vendor": gemm.cpu_vendor(), "auto_backend": gemm.resolve("auto"),
           "torch": torch.__version__, "min_macs": gemm.MIN_MACS, "load_avg_before": os.getloadavg(),
           "threads": {}}
    print(f"{res['cpu']} ({res['cpu_vendor']}); ENGRAM_GEMM=auto means {res['auto_backend']} here")
    for th in (int(s) for s in args.threads.split(",")):
        torch.set_num_threads(th)
        rows = {}
        for name, n, i, o in SHAPES:
            rows[name] = r = {"shape": [n, i, o], **measure(n, i, o, args.rounds)}
            print(f"{th} thread(s) {name:>15} {n:5d} x {i:4d} -> {o:5d}: oneDNN / torch speed "
                  f"fwd {r['fwd_speedup']:.2f}x, fwd+bwd {r['fwd_bwd_speedup']:.2f}x"
                  f"{'' if r['routed_by_default_threshold'] else '  (under MIN_MACS: not routed)'}")
        res["threads"][str(th)] = rows
    res["load_avg_after"] = os.getloadavg()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
