"""Opening a run does not depend on its training data: a run trained on a large prepared corpus
opens as fast as one trained on a small one, with both corpora deleted (issue 32's goal: within
10%).

    python benchmarks/open_run.py [--small_mb 1] [--large_mb 1000] [--rounds 7]
        [--json benchmarks/results/open_run.json]

Both runs: the same tiny model (``--vocab full``, so both have the tokenizer's whole vocabulary and
the same shapes) trained 1 step on a corpus of that size (``engram prepare`` of JSON Lines built
from every text source on the machine, benchmarks/prepare.py), then the text and the prepared
folders are deleted. Timed: ``engram.open(run)`` in this process, the two runs alternated round
by round after one untimed open each (imports, file cache); reported min and median per run and
the ratio large / small of the medians. Before the runtime, opening rebuilt the corpus (it failed
with the corpus gone) and re-checked it token for token.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prepare import build_corpus_files, text_sources  # noqa: E402
from record import write_json  # noqa: E402

TINY = dict(n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=2, table_size=2003,
            n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,), steps=1, warmup=1,
            eval_every=1, eval_batches=1, ckpt_every=1, log_every=1, vocab="full")


def cpu() -> str:
    from engram.compute import machine

    return machine.cpu_id()  # model and vector ISA


def make_run(work: Path, name: str, mb: float, sources: dict) -> tuple[Path, dict]:
    from engram.training.prepare import PrepareConfig, prepare
    from engram.training.train import TrainConfig, train

    text, data, run = work / f"text-{name}", work / f"data-{name}", work / f"run-{name}"
    info = build_corpus_files(text, mb, sources)
    t0 = time.perf_counter()
    manifest = prepare(PrepareConfig(out=str(data), input=[str(text)], workers=2), progress=False)
    prep_s = time.perf_counter() - t0
    train(TrainConfig(out_dir=str(run), data=str(data), **TINY), progress=False)
    shutil.rmtree(text)
    shutil.rmtree(data)  # the run must open without them
    return run, {"mb": info["mb"], "tokens": manifest["summary"]["tokens"], "prepare_s": prep_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small_mb", type=float, default=1.0)
    p.add_argument("--large_mb", type=float, default=1000.0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default="benchmarks/results/open_run.json")
    p.add_argument("--smoke", action="store_true", help="0.2 and 0.4 MB, 2 rounds (CI)")
    a = p.parse_args()
    if a.smoke:
        a.small_mb, a.large_mb, a.rounds = 0.2, 0.4, 2
    import engram

    sources = text_sources()
    with tempfile.TemporaryDirectory(prefix="open-run-") as tmp:
        work = Path(tmp)
        runs, info = {}, {}
        for name, mb in (("small", a.small_mb), ("large", a.large_mb)):
            runs[name], info[name] = make_run(work, name, mb, sources)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for name, run in runs.items():
            engram.open(run)  # untimed: imports, the file cache
        for r in range(a.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                t0 = time.perf_counter()
                engram.open(runs[name])
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"cpu": cpu(), "corpora": info, "open_s": times,
              "open_s_min": {k: min(v) for k, v in times.items()}, "open_s_median": med,
              "large_over_small": med["large"] / med["small"], "goal": 1.10,
              "met": med["large"] / med["small"] <= 1.10}
    for k in runs:
        print(f"{k}: {info[k]['mb']} MB, {info[k]['tokens']:,} tokens; open min "
              f"{result['open_s_min'][k] * 1e3:.0f} ms, median {med[k] * 1e3:.0f} ms")
    print(f"large / small: {result['large_over_small']:.3f}x (goal <= 1.10) on {result['cpu']}")
    write_json(a.json, result)


if __name__ == "__main__":
    main()
