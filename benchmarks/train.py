"""Training speed: tokens/s dense vs Engram, RowAdam 1M vs 50M rows, and peak memory.

    python benchmarks/train.py [--json out/bench_train.json] [--smoke]

1. Throughput. The `engram compare` configs (dense, and Engram with the FFN trimmed to the same
   activated parameters) train on the package corpus, step by step interleaved in one process (so
   load from other processes hits both alike), full training steps: batch + hash ids, forward,
   backward, clip, AdamW + RowAdam. Figure: Engram tokens/s / dense tokens/s (the cost of the
   memory at equal FLOPs; goal close to 1). Also the same Engram model with the module's gate and
   conv on the torch path (``engram_torch``, ``Engram.kernels = False``): what the compiled
   kernels (module/fused.py) buy at these shapes. Where engram/compute/gemm.py's backend is oneDNN, also
   dense and Engram with every product through torch's default BLAS (``dense_mkl``,
   ``engram_mkl``): what the GEMM route buys, and the Engram / dense ratio without it; and with
   oneDNN's weight gradient taken the old way (``dense_dw_copy``, ``engram_dw_copy``: dY^T copied
   as the first operand; the same bits): what engram/compute/gemm.py's ``_grad_weight`` buys.
2. Memory. Each variant again, alone in a fresh process: peak RSS after model + corpus, and after
   training steps (gradients and optimiser state included).
3. Optimiser. RowAdam step time with a table of 1M vs 50M rows at the same batch (see
   benchmarks/optim.py, run here with the same defaults): goal ~1, cost follows touched rows.
4. Where a step goes (``breakdown``): batch + hash ids, forward, backward, clip, optimisers, per
   variant (MoE too), in CPU time (robust to other processes on the machine), and minor page faults.
``engram compare`` estimates its own wall time now, by timing the runs on its workers side by side
before they start (studies/estimate.py); this script's single-process CPU-time estimate missed by
2x on a machine where two runs side by side run much slower than one (issue 25), and is gone.
benchmarks/side_by_side.py measures that slowdown.

The measuring process runs with the allocator settings compare gives its workers
(engram.training.train.ALLOCATOR_ENV); --no_allocator_env measures without them (as before).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engram import Engram
from engram.compute import gemm, machine
from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.training.corpus import build_corpus
from engram.training.optim import clip_grad_norm_
from engram.training.train import TrainConfig, build_run, train_step

try:
    from engram.training.train import ALLOCATOR_ENV
except ImportError:  # measuring an older checkout, which had none
    ALLOCATOR_ENV = {}

sys.path.insert(0, str(Path(__file__).parent))
import optim as optim_bench  # noqa: E402  (benchmarks/optim.py)
from record import SMOKE, write_json  # benchmarks/record.py: the script's folder is on sys.path


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Restart VmHWM (peak RSS) from the current RSS (Linux >= 4.0), so a phase's peak is its own."""
    Path("/proc/self/clear_refs").write_text("5")


_small: dict = {}


def configs(batch: int, seq: int, moe: bool = False) -> dict[str, TrainConfig]:
    base = budget(TrainConfig(out_dir="/tmp/engram-bench-train", threads=1, **_small),
                  CompareConfig(batch_size=batch, seq_len=seq))
    corpus = build_corpus(base.data_config())
    return {k: v for k, v in variant_configs(base, corpus.vocab_size).items() if moe or k != "moe"}


def step(run, i: int, backend: str | None = None) -> None:
    run.step = i  # hashing included: batch i and its hash ids are built inside the step
    with gemm.using(backend):
        train_step(run)


@contextlib.contextmanager
def copied_grad_weight():
    """oneDNN's weight gradient as it was before issue 33's change: dY^T X with dY^T as the first
    operand, which oneDNN copies whole (gemm._grad_weight takes (X^T dY)^T: the same bits)."""
    keep = gemm._grad_weight
    gemm._grad_weight = lambda gy, x: gemm._mm(gy.t(), x.t())
    try:
        yield
    finally:
        gemm._grad_weight = keep


def throughput(cfgs: dict[str, TrainConfig], steps: int, warmup: int) -> dict:
    runs = {name: build_run(cfg) for name, cfg in cfgs.items()}
    if "engram" in cfgs:  # the same model with the module's gate and conv as eager torch ops
        runs["engram_torch"] = build_run(cfgs["engram"])
        for mod in runs["engram_torch"].model.modules():
            if isinstance(mod, Engram):
                mod.kernels = False
    if gemm.backend() != "torch":  # the same models with every product through F.linear (MKL),
        for name in [k for k in ("dense", "engram") if k in cfgs]:  # and with the old dW
            runs[f"{name}_mkl"] = build_run(cfgs[name])
            runs[f"{name}_dw_copy"] = build_run(cfgs[name])
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in tqdm(range(warmup + steps), desc="train steps (interleaved)"):
        for name, run in runs.items():
            t0 = time.perf_counter()
            with copied_grad_weight() if name.endswith("_dw_copy") else contextlib.nullcontext():
                step(run, i, "torch" if name.endswith("_mkl") else None)
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


def _cpu() -> float:
    return time.process_time()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def breakdown(cfgs: dict[str, TrainConfig], steps: int, warmup: int) -> dict:
    """CPU ms per step phase and minor page faults per step, variants interleaved."""
    corpus = build_corpus(next(iter(cfgs.values())).data_config())
    runs = {name: build_run(cfg, corpus) for name, cfg in cfgs.items()}
    phases = ("batch", "forward", "backward", "clip", "optim")
    rec = {n: {p: [] for p in (*phases, "step", "faults")} for n in runs}
    for i in tqdm(range(warmup + steps), desc="step breakdown (CPU time)"):
        for name, run in runs.items():
            f0, t = _faults(), [_cpu()]
            b = run.batches.batch(i)
            t.append(_cpu())
            loss = run.model.loss(run.model(b.inputs, b.hash_ids), b.targets)
            t.append(_cpu())
            loss.backward()
            t.append(_cpu())
            clip_grad_norm_([p for p in run.model.parameters() if p.grad is not None], 1.0)
            t.append(_cpu())
            run.optim.step()
            run.optim.zero_grad(set_to_none=True)
            t.append(_cpu())
            if i >= warmup:
                for p, a, z in zip(phases, t, t[1:]):
                    rec[name][p].append(z - a)
                rec[name]["step"].append(t[-1] - t[0])
                rec[name]["faults"].append(_faults() - f0)
    return {n: {k: statistics.median(v) * (1 if k == "faults" else 1e3) for k, v in r.items()}
            for n, r in rec.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=60, help="timed training steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--memory_steps", type=int, default=5)
    ap.add_argument("--optim_steps", type=int, default=30)
    ap.add_argument("--skip_optim", action="store_true", help="skip the 1M vs 50M rows part")
    ap.add_argument("--skip_memory", action="store_true", help="skip the peak memory part")
    ap.add_argument("--breakdown_steps", type=int, default=12, help="0 skips part 4")
    ap.add_argument("--no_allocator_env", action="store_true",
                    help="measure without compare's allocator settings (ALLOCATOR_ENV)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model and corpus, 2 steps of each part (CI)")
    args = ap.parse_args()
    if args.smoke:
        _small.update(SMOKE)
        args.steps, args.warmup, args.batch, args.seq, args.memory_steps = 2, 1, 2, 16, 1
        args.breakdown_steps, args.optim_steps = 2, 3
    if not args.no_allocator_env and any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        # glibc reads them at start-up only: start again with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    torch.set_num_threads(1)  # as in `engram compare`: one thread per training process

    cfgs = configs(args.batch, args.seq)
    load_before = os.getloadavg()  # the ratios are interleaved; absolute numbers follow the load
    speed = throughput(cfgs, args.steps, args.warmup)

    def faster(a: str, b: str) -> float:  # run a's tokens/s over run b's
        return speed[a]["tokens_per_s"] / speed[b]["tokens_per_s"]

    res = {"config": vars(args), "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_ENV},
           "load_avg": {"before": load_before, "after_throughput": os.getloadavg(),
                        "cpus": os.cpu_count()},
           "cpu": machine.cpu_id(), "gemm_backend": gemm.backend(),
           "throughput": speed, "engram_over_dense_tokens_per_s": faster("engram", "dense"),
           "engram_module_kernels_speedup": faster("engram", "engram_torch")}
    if "dense_mkl" in speed:
        res["gemm_route_speedup"] = {k: faster(k, f"{k}_mkl") for k in ("dense", "engram")}
        res["engram_over_dense_tokens_per_s_mkl"] = faster("engram_mkl", "dense_mkl")
        # issue 33: the step against the same code with oneDNN's old weight gradient (same bits)
        res["grad_weight_speedup"] = {k: faster(k, f"{k}_dw_copy") for k in ("dense", "engram")}
    if args.breakdown_steps:
        all_cfgs = configs(args.batch, args.seq, moe=True)
        res["breakdown_cpu_ms"] = bd = breakdown(all_cfgs, args.breakdown_steps, 2)
        res["engram_over_dense_cpu"] = bd["dense"]["step"] / bd["engram"]["step"]
        for name, r in bd.items():
            print(f"{name:>7}: step {r['step']:6.1f} ms CPU = " + ", ".join(
                f"{p} {r[p]:.1f}" for p in ("batch", "forward", "backward", "clip", "optim"))
                + f"; {r['faults']:,.0f} minor faults a step")
        print(f"Engram / dense tokens per CPU second: {res['engram_over_dense_cpu']:.3f}")
    if not args.skip_memory:
        # --smoke: one variant (a fresh process each costs seconds of imports)
        res["memory"] = mem = memory({k: cfgs[k] for k in list(cfgs)[:1 if args.smoke else None]},
                                     args.memory_steps)
    for name in cfgs:
        s = speed[name]
        print(f"{name:>7}: {s['tokens_per_s']:8,.0f} tok/s  ({s['median_step_s'] * 1e3:6.0f} ms a "
              f"step of {args.batch}x{args.seq}); active {s['active_params']:,}, tables "
              f"{s['table_params']:,}")
        if not args.skip_memory and name in mem:
            m = mem[name]
            print(f"{'':>9}model + optimisers {m['model_mib']:,.0f} MiB, peak RSS while training "
                  f"{m['peak_rss_train_mib']:,.0f} MiB (+{m['train_over_built_mib']:,.0f} MiB over "
                  f"the built model)")
    print(f"Engram / dense tokens/s at equal activated parameters: "
          f"{res['engram_over_dense_tokens_per_s']:.3f} (the module's compiled kernels: "
          f"{res['engram_module_kernels_speedup']:.3f}x the torch path's tokens/s)")
    if "gemm_route_speedup" in res:
        r = res["gemm_route_speedup"]
        print(f"GEMM route ({res['gemm_backend']}) vs F.linear (MKL): dense {r['dense']:.2f}x, "
              f"Engram {r['engram']:.2f}x tokens/s; Engram / dense with MKL "
              f"{res['engram_over_dense_tokens_per_s_mkl']:.3f}; CPU: {res['cpu']}")
    if "grad_weight_speedup" in res:
        r = res["grad_weight_speedup"]
        print(f"oneDNN's weight gradient as (X^T dY)^T vs dY^T copied first (same bits): dense "
              f"{r['dense']:.3f}x, Engram {r['engram']:.3f}x the tokens/s")
    if not args.skip_optim:
        sizes = dict(small=10_000, large=100_000, batch=512, warmup=1) if args.smoke else {}
        res["optimizer"] = optim_bench.run(steps=args.optim_steps, **sizes)
        o = res["optimizer"]
        print(f"RowAdam step, 50M / 1M rows at the same batch: {o['ratio_large_over_small']:.2f}x "
              f"(goal ~1); dense Adam / RowAdam at 1M rows: {o['ratio_dense_over_row_adam']:.1f}x; "
              f"peak RSS {o['peak_rss_gib']:.2f} GiB")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
