"""Engram-Nine's cost: hot-tier lookup and training-step tokens/s vs the hashed tables, and the
memory of the MPHF + fingerprints per hot key.

    python benchmarks/nine.py [--json benchmarks/results/nine/bench.json] [--steps 20] [--smoke]

1. Lookup. Token ids -> ids for the model, per batch of the study (16 x 128): the plain hasher
   (compression + multi-head hashing) vs the Nine hasher (the same + exact n-gram keys + hot index
   lookup), for each index: the torch BBHash + 16-bit fingerprints, the ``bbhash`` wheel (if
   installed) + fingerprints, and the exact sorted keys. Interleaved call by call in one process.
2. Training step. The study's Hash-10K and Nine-2K/8K models (equal parameters, one table set shared
   by 3 layers), full steps (batch + ids, forward, backward, clip, AdamW + RowAdam), interleaved step
   by step. Goal: Nine within 5% of hashed (the paper pays 11-12%).
3. Memory. Bytes of what a lookup needs per hot key (MPHF levels + rank words + fingerprints); the
   exact variant's 64-bit keys for contrast; hot keys stored beside for export are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from engram.retrieval.hot import HotIndex, NineHasher, count_keys, top_keys
from engram.studies.compare import budget
from engram.studies.nine import NineStudyConfig, study_configs
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, build_run, train_step
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path


def _median_rate(times: list[float], tokens: int) -> float:
    return tokens / statistics.median(times)


def bench_lookup(run, rounds: int, n_hot: int) -> dict:
    plain = run.hasher.hasher
    keys = top_keys(count_keys(plain, run.corpus.train), n_hot)
    indexes = {"mphf-torch": HotIndex.build(keys, "mphf", 16, "torch"),
               "exact": HotIndex.build(keys, "exact")}
    try:
        indexes["mphf-bbhash"] = HotIndex.build(keys, "mphf", 16, "bbhash")
    except ImportError:
        pass
    hashers = {"hashed": plain, **{k: NineHasher(plain, v) for k, v in indexes.items()}}
    raws = [run.batches.batch(i).raw for i in range(rounds)]
    times: dict[str, list[float]] = {k: [] for k in hashers}
    for raw in raws:  # interleaved: the machine's load hits every variant alike
        for name, h in hashers.items():
            t0 = time.perf_counter()
            h.hash(raw)
            times[name].append(time.perf_counter() - t0)
    tokens = raws[0].numel()
    rates = {k: _median_rate(v, tokens) for k, v in times.items()}
    mem = {k: v.nbytes() for k, v in indexes.items()}
    return {"tokens_per_s": rates, "ratio_vs_hashed": {k: rates[k] / rates["hashed"]
                                                        for k in rates},
            "memory_per_hot_key": mem, "hot_keys": int(keys.numel())}


def bench_train(runs: dict, steps: int, warmup: int) -> dict:
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + steps):
        for name, run in runs.items():
            run.step = i
            t0 = time.perf_counter()
            train_step(run)  # batch i and its ids are built inside the step
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    cfg = next(iter(runs.values())).cfg
    tokens = cfg.batch_size * cfg.seq_len
    rates = {k: _median_rate(v, tokens) for k, v in times.items()}
    base = next(iter(rates))
    return {"tokens_per_s": rates, "ratio_vs_" + base: {k: rates[k] / rates[base] for k in rates},
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per model")
    ap.add_argument("--rounds", type=int, default=40, help="timed lookup batches per variant")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="a small corpus, 2 steps, 2 rounds (CI)")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.rounds = 2, 2
    torch.set_num_threads(a.threads)
    sc = NineStudyConfig()
    small = dict(max_chars=200_000, d_model=32, n_head=2) if a.smoke else {}
    base = budget(TrainConfig(out_dir="/tmp/engram-bench-nine", **small), sc)
    corpus = build_corpus(base.data_config())
    cfgs = study_configs(base, sc)
    names = ["hash-10k", "nine-2k/8k"]
    runs = {n: build_run(dataclasses.replace(cfgs[n], seed=0), corpus) for n in names}
    out = {"lookup": bench_lookup(runs["nine-2k/8k"], a.rounds, cfgs["nine-2k/8k"].hot_rows),
           "train": bench_train(runs, a.steps, warmup=3), "threads": a.threads,
           "batch": [base.batch_size, base.seq_len]}
    lk, tr = out["lookup"], out["train"]
    for k, v in lk["tokens_per_s"].items():
        m = lk["memory_per_hot_key"].get(k)
        extra = f", {m['bits_per_key']:.1f} bits/hot key" if m else ""
        print(f"lookup {k:12s} {v / 1e6:7.2f} M tok/s  x{lk['ratio_vs_hashed'][k]:.3f}{extra}")
    for k, v in tr["tokens_per_s"].items():
        print(f"train  {k:12s} {v:9.0f} tok/s  x{tr['ratio_vs_hash-10k'][k]:.3f}")
    if a.json:
        write_json(a.json, out, indent=1)


if __name__ == "__main__":
    main()
