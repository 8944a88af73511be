"""Precision, compile and the GEMM route on this machine's CPU: what each choice buys, in one run.

    python benchmarks/precision.py [--json benchmarks/results/precision.json] [--smoke]

Every variant trains compare's model (``engram compare``'s configs at its defaults: Engram, and
dense at the same activated parameters) from the same init on the same batches, with the learning
rate schedule of ``fit``, one torch thread each as compare's workers have, step by step interleaved
in one process (load from other processes hits all alike):

1. precision: ``fp32`` vs ``bf16`` (``--precisions`` may add ``fp16``): tokens/s (median step) and
   the loss after N steps (the mean training loss of the last steps, and a validation loss), so
   the bf16 run's loss is read against the fp32 run's.
2. compile: the fp32 Engram model under ``torch.compile`` (``TrainConfig.compile``) vs eager:
   tokens/s after the warm-up steps (which compile), and the first step's seconds.
3. GEMM route (engram/compute/gemm.py): the fp32 models with ``ENGRAM_GEMM=auto`` (the route measured per
   shape bucket on this machine) vs each backend forced (``torch``: MKL, ``onednn``). The chosen
   route must be the faster within noise: auto's tokens/s at least the best forced backend's times
   (1 - noise), noise the largest split-half spread of a variant's median step here (at least 3%).

``--smoke``: a tiny model, a few steps (CI runs it so that a benchmark that stops working fails
there); its figures mean nothing. Writes the CPU model, its bf16/AMX flags and torch's CPU
capability beside the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

from engram.compute import gemm, machine
from engram.models.precision import DTYPES, autocast_supported
from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.training.corpus import build_corpus
from engram.training.loop import lr_at
from engram.training.train import (
    ALLOCATOR_ENV,
    TrainConfig,
    build_run,
    evaluate,
    train_step,
)
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

MIN_NOISE = 0.03
SMOKE = dict(max_chars=200_000, n_layer=2, d_model=64, n_head=2, seq_len=32, batch_size=4,
             table_size=2_000, n_embed_per_ngram=32, eval_batches=2)


def configs(smoke: bool) -> dict[str, TrainConfig]:
    base = TrainConfig(out_dir="/tmp/engram-bench-precision", threads=1)
    if smoke:
        base = dataclasses.replace(base, **SMOKE)
    else:
        base = budget(base, CompareConfig())
    corpus = build_corpus(base.data_config())
    cfgs = variant_configs(base, corpus.vocab_size)
    return {"engram": cfgs["engram"], "dense": cfgs["dense"]}


def variants(cfgs: dict[str, TrainConfig], precisions: list[str], compile_: bool
             ) -> dict[str, tuple[TrainConfig, str | None]]:
    """name -> (config, GEMM backend forced or None)."""
    out: dict[str, tuple[TrainConfig, str | None]] = {}
    eng = cfgs["engram"]
    for p in precisions:
        out[f"engram_{p}"] = (dataclasses.replace(eng, precision=p), None)
    if compile_:
        out["engram_fp32_compiled"] = (dataclasses.replace(eng, compile=True), None)
    for model in ("engram", "dense"):
        if model == "dense":
            out["dense_fp32"] = (cfgs["dense"], None)
        for backend in ("torch", "onednn"):
            out[f"{model}_fp32_{backend}"] = (cfgs[model], backend)
    return out


def split_half_noise(ts: list[float]) -> float:
    """|median of the first half - median of the second| / median: how much a median moves."""
    h = len(ts) // 2
    if h < 2:
        return 0.0
    return abs(statistics.median(ts[:h]) - statistics.median(ts[h:])) / statistics.median(ts)


def train(runs: dict, backends: dict[str, str | None], steps: int, warmup: int) -> dict:
    times: dict[str, list[float]] = {n: [] for n in runs}
    losses: dict[str, list[float]] = {n: [] for n in runs}
    first: dict[str, float] = {}
    for i in tqdm(range(warmup + steps), desc="train steps (interleaved)"):
        for name, run in runs.items():
            run.step = i
            run.optim.set_lr(lr_at(i, run.cfg))
            t0 = time.perf_counter()
            with gemm.using(backends[name]):
                losses[name].append(train_step(run))
            dt = time.perf_counter() - t0
            if i == 0:
                first[name] = dt
            if i >= warmup:
                times[name].append(dt)
    out = {}
    for name, run in runs.items():
        cfg = run.cfg
        med = statistics.median(times[name])
        tail = losses[name][-max(1, min(10, steps)):]
        out[name] = {"median_step_s": med, "tokens_per_s": cfg.batch_size * cfg.seq_len / med,
                     "first_step_s": first[name], "noise": split_half_noise(times[name]),
                     "loss_last_steps": sum(tail) / len(tail), "loss_first": losses[name][0],
                     "gemm_backend": backends[name] or gemm.backend(),
                     "precision": cfg.precision, "compile": cfg.compile}
    return out


def cpu_flags() -> dict:
    flags = set(machine.cpuinfo("flags").split())
    want = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {"torch_cpu_capability": cap, **{f: f in flags for f in want}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=40, help="timed training steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile in them)")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated; fp32 first")
    ap.add_argument("--no_compile", action="store_true", help="skip the compiled variant")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 3 steps (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 3, 1
    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        # compare's workers' allocator settings; glibc reads them at start-up only: start again.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    torch.set_num_threads(1)
    precisions = [p for p in args.precisions.split(",") if p]
    if precisions[:1] != ["fp32"]:
        ap.error("--precisions must start with fp32 (the reference)")
    skipped = [p for p in precisions if not autocast_supported("cpu", DTYPES[p])]
    precisions = [p for p in precisions if p not in skipped]

    cfgs = configs(args.smoke)
    total = args.warmup + args.steps
    cfgs = {k: dataclasses.replace(v, steps=total, warmup=min(v.warmup, max(1, total // 10)))
            for k, v in cfgs.items()}
    plan = variants(cfgs, precisions, not args.no_compile)
    corpus = build_corpus(cfgs["engram"].data_config())
    runs = {name: build_run(cfg, corpus) for name, (cfg, _) in plan.items()}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = train(runs, {n: b for n, (_, b) in plan.items()}, args.steps, args.warmup)
    wall = time.perf_counter() - t0
    for p in precisions:
        res[f"engram_{p}"]["val_loss"] = evaluate(runs[f"engram_{p}"])

    ref = res["engram_fp32"]
    noise = max(MIN_NOISE, max(r["noise"] for r in res.values()))
    cpu = machine.cpu_id()  # under both keys, as earlier records have them
    out = {"config": {**vars(args), "model": {k: v for k, v in dataclasses.asdict(
               cfgs["engram"]).items() if k in ("n_layer", "d_model", "batch_size", "seq_len",
                                                 "table_size", "steps", "lr", "threads")}},
           "cpu": cpu, "cpu_id": cpu, "cpu_flags": cpu_flags(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
           "wall_s": wall, "precisions_unsupported_here": skipped, "variants": res,
           "noise": noise, "gemm_routes": gemm.routes()}
    out["precision"] = {p: {"tokens_per_s_over_fp32": res[f"engram_{p}"]["tokens_per_s"]
                            / ref["tokens_per_s"],
                            "loss_last_steps_minus_fp32": res[f"engram_{p}"]["loss_last_steps"]
                            - ref["loss_last_steps"],
                            "val_loss_minus_fp32": res[f"engram_{p}"]["val_loss"] - ref["val_loss"]}
                        for p in precisions if p != "fp32"}
    if "engram_fp32_compiled" in res:
        c = res["engram_fp32_compiled"]
        out["compile"] = {"tokens_per_s_over_eager": c["tokens_per_s"] / ref["tokens_per_s"],
                          "first_step_s": c["first_step_s"],
                          "eager_first_step_s": ref["first_step_s"],
                          "loss_last_steps_minus_eager": c["loss_last_steps"]
                          - ref["loss_last_steps"]}
    route = {}
    for model in ("engram", "dense"):
        auto = res[f"{model}_fp32"]["tokens_per_s"]
        forced = {b: res[f"{model}_fp32_{b}"]["tokens_per_s"] for b in ("torch", "onednn")}
        best = max(forced, key=forced.get)
        route[model] = {"auto_over_torch": auto / forced["torch"],
                        "auto_over_onednn": auto / forced["onednn"], "best_forced": best,
                        "chosen_is_fastest_within_noise": auto >= forced[best] * (1 - noise)}
    out["gemm_route"] = route

    for name, r in res.items():
        print(f"{name:>22}: {r['tokens_per_s']:8,.0f} tok/s  loss(last) {r['loss_last_steps']:.4f}"
              f"  first step {r['first_step_s']:.1f} s" + (f"  val {r['val_loss']:.4f}"
                                                         if "val_loss" in r else ""))
    for p, d in out["precision"].items():
        print(f"{p} vs fp32: {d['tokens_per_s_over_fp32']:.2f}x tokens/s, loss "
              f"{d['loss_last_steps_minus_fp32']:+.4f} (train, last steps), "
              f"{d['val_loss_minus_fp32']:+.4f} (val)")
    if "compile" in out:
        c = out["compile"]
        print(f"compiled vs eager (fp32): {c['tokens_per_s_over_eager']:.2f}x tokens/s; first step "
              f"{c['first_step_s']:.0f} s (compiling) vs {c['eager_first_step_s']:.1f} s")
    for model, r in route.items():
        print(f"GEMM route ({model}): auto / torch {r['auto_over_torch']:.2f}x, auto / onednn "
              f"{r['auto_over_onednn']:.2f}x; chosen is the faster within {noise:.0%}: "
              f"{r['chosen_is_fastest_within_noise']}")
    print(f"CPU: {out['cpu']} ({out['cpu_flags']}); {wall:.0f} s")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
