"""How far do last-bit differences move `engram compare`'s Engram result? One seed, many runs.

    python benchmarks/ulp_noise.py [--json benchmarks/results/compare/ulp_noise.json] [--smoke]

Compare's Engram config (seed 0, its full 480 steps, final full validation) trained several times,
each run identical up to rounding: the torch path of the table update, the numba kernels
(training/sparse_rows.py: another summation order when coalescing, the hardware's square root
instead of SLEEF's), each kernel alone, and the torch path with one weight of the Engram value
projection (read every step) moved by one ulp before training. The spread of their final losses is
the run-to-run noise a study sees from rounding alone, to set beside its seed spread. Runs go to
--workers spawned processes (one torch thread each, as compare runs them), a fresh one per run:
each variant patches module state.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import statistics
import time

import torch
from tqdm import tqdm

from engram.studies.compare import CompareConfig, budget, variant_configs
from engram.training import sparse_rows, train as train_mod
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, allocator_env
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

VARIANTS = ("torch", "kernels", "kernel_coalesce_only", "kernel_adam_only", "ulp@0", "ulp@100",
            "ulp@7777")


def _one(args: tuple[str, TrainConfig]) -> dict:
    name, cfg = args
    torch.set_num_threads(1)
    if name == "torch" or name.startswith("ulp"):
        sparse_rows._HAVE_NUMBA, sparse_rows._warned = False, True  # both kernels off, no warning
    if name == "kernel_adam_only":
        sparse_rows.coalesce_rows = lambda g: g.coalesce()
    build = train_mod.build_run

    def build_run(*a, **k):
        run = build(*a, **k)
        if name == "kernel_coalesce_only":
            run.optim.tables.kernels = False
        if name.startswith("ulp"):
            w = run.model.blocks[cfg.engram_layers[0]].engram.value_proj.weight.view(-1)
            i = int(name.split("@")[1])
            with torch.no_grad():
                w[i] = torch.nextafter(w[i], torch.tensor(float("inf")))
        return run
    train_mod.build_run = build_run  # train() builds its run through this name
    t0 = time.perf_counter()
    run = train_mod.train(cfg, progress=False, resume=False)
    return {"variant": name, "val_loss": run.history[-1]["val_loss"],
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--out_dir", default="/tmp/engram-ulp-noise", help="the runs' folders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {VARIANTS}")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, 2 steps, two variants, in a fresh temp folder (CI)")
    args = ap.parse_args()
    base, cc = TrainConfig(), CompareConfig()
    if args.smoke:
        import tempfile

        base = TrainConfig(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
                           n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,))
        cc = CompareConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_batches=1)
        args.variants, args.out_dir = "kernels,ulp@0", tempfile.mkdtemp(prefix="engram-ulp-")
    base = budget(base, cc)
    corpus = build_corpus(base.data_config())
    cfg = dataclasses.replace(variant_configs(base, corpus.vocab_size)["engram"], seed=args.seed)
    jobs = [(v, dataclasses.replace(cfg, out_dir=f"{args.out_dir}/{v}"))
            for v in args.variants.split(",")]
    results = []
    with allocator_env(), mp.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
        for r in tqdm(pool.imap_unordered(_one, jobs), total=len(jobs), desc="runs"):
            tqdm.write(f"  {r['variant']}: val loss {r['val_loss']:.4f}")
            results.append(r)
    losses = [r["val_loss"] for r in results]
    res = {"config": vars(args), "runs": sorted(results, key=lambda r: r["variant"]),
           "mean": statistics.mean(losses), "sd": statistics.stdev(losses) if len(losses) > 1 else 0,
           "range": max(losses) - min(losses)}
    print(f"final val loss over {len(losses)} runs equal up to rounding: mean {res['mean']:.4f}, "
          f"sd {res['sd']:.4f}, range {res['range']:.4f}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
