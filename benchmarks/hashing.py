"""Hashing throughput vs a plain NumPy port of the official demo, and the module's fwd+bwd speed.

    python benchmarks/hashing.py [--json out/hashing.json] [--smoke]

Figures are ratios against baselines measured in the same process (machines are noisy).
Goal: the torch hasher at >= 2x the NumPy port (demo config, two layers, batch 8 x 4096).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engram import EngramConfig, NgramHasher, build_compression, build_engram
from engram.retrieval.reference import NumpyReferenceHasher


def timeit(fn, repeat: int = 15, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hashing(comp, cfg: EngramConfig, batch: int, seq: int, repeat: int = 15,
                  warmup: int = 2) -> dict:
    x = torch.randint(0, comp.raw_vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ours, ref = NgramHasher(cfg, comp), NumpyReferenceHasher(cfg, comp.lookup)
    xn = x.numpy()
    t_ours = timeit(lambda: ours.hash(x), repeat, warmup)
    t_ref = timeit(lambda: ref.hash(xn), repeat, warmup)
    same = all((ours.hash(x)[lid].numpy() == ref.hash(xn)[lid]).all() for lid in cfg.layer_ids)
    if not same and cfg.profile == "demo-v1":
        raise AssertionError("torch hasher disagrees with the NumPy port")
    n = batch * seq
    return {"tokens_per_s": n / t_ours, "numpy_tokens_per_s": n / t_ref, "ratio": t_ref / t_ours,
            "batch": batch, "seq": seq, "layers": len(cfg.layer_ids), "heads": cfg.num_heads}


def bench_module(comp, batch: int, seq: int, hidden: int, table_size: int, repeat: int = 5,
                 warmup: int = 1) -> dict:
    """Forward+backward of one Engram layer at the demo's widths with small tables; baseline: one
    nn.Linear(hidden, hidden) forward+backward on the same tokens."""
    cfg = EngramConfig.demo_v1(engram_vocab_size=[table_size] * 2)
    hasher = NgramHasher(cfg, comp)
    x = torch.randint(0, comp.raw_vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = hasher.hash(x)[cfg.layer_ids[0]]
    out = {}
    for hc in (1, 4):
        torch.manual_seed(0)
        m = build_engram(cfg, cfg.layer_ids[0], hidden, hc_mult=hc, sparse=True)
        h = torch.randn(batch, seq, hc, hidden, requires_grad=True) if hc > 1 else \
            torch.randn(batch, seq, hidden, requires_grad=True)

        def step():
            m.zero_grad(set_to_none=True)
            m(h, ids).sum().backward()
        out[f"hc{hc}_tokens_per_s"] = batch * seq / timeit(step, repeat, warmup)
    lin = torch.nn.Linear(hidden, hidden)
    hl = torch.randn(batch, seq, hidden, requires_grad=True)
    t_lin = timeit(lambda: lin(hl).sum().backward(), repeat, warmup)
    out["linear_tokens_per_s"] = batch * seq / t_lin
    out["hc1_vs_linear"] = out["hc1_tokens_per_s"] / out["linear_tokens_per_s"]
    out.update(batch=batch, seq=seq, hidden=hidden, table_rows=hasher.num_rows(cfg.layer_ids[0]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="out/bench_hashing.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one timing each (CI)")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq = 1, 256
    reps = dict(repeat=1, warmup=0) if args.smoke else {}
    mod = dict(batch=1, seq=32, hidden=64, table_size=500) if args.smoke else \
        dict(batch=4, seq=512, hidden=1024, table_size=20_000)
    comp = build_compression()
    res = {"torch_threads": torch.get_num_threads()}
    res["demo_v1"] = bench_hashing(comp, EngramConfig.demo_v1(), args.batch, args.seq, **reps)
    print(f"hashing demo-v1 (2 layers, {args.batch}x{args.seq}): "
          f"{res['demo_v1']['tokens_per_s']:,.0f} tok/s, {res['demo_v1']['ratio']:.2f}x the NumPy port")
    res["v4_1"] = bench_hashing(comp, EngramConfig.v4_1(), args.batch, args.seq, **reps)
    print(f"hashing v4.1 (2 layers, N=4): {res['v4_1']['tokens_per_s']:,.0f} tok/s, "
          f"{res['v4_1']['ratio']:.2f}x the NumPy port")
    res["module"] = bench_module(comp, **mod, **reps)
    m = res["module"]
    print(f"module fwd+bwd (d={mod['hidden']}, {mod['batch']}x{mod['seq']}): hc=1 {m['hc1_tokens_per_s']:,.0f} tok/s, "
          f"hc=4 {m['hc4_tokens_per_s']:,.0f} tok/s; hc=1 vs one dxd Linear: {m['hc1_vs_linear']:.2f}x")
    import os
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
