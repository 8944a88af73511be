"""What each table format costs on trained runs (issue 47): every lossy --table_dtype exported by
the quality gate (studies/table_cost.py) from each of compare's Engram runs, its paired loss change
against the run's own fp32 tables, KL and top-1 agreement per seed, with bytes per row.

    python benchmarks/table_formats.py out/compare/runs [--formats bf16,fp16,fp8,int8,int4] \
        [--max_tokens 32768] --json benchmarks/results/tables/formats.json
    python benchmarks/table_formats.py --adapters A0,A1,A2 [--max_tokens 4096] \
        --json benchmarks/results/tables/formats_smollm2.json  # `engram finetune` adapters
    python benchmarks/table_formats.py --smoke --json out/formats.json   # tiny runs trained here

Adapters (``--adapters``, one per seed) are scored on the held-out split of the data they were
finetuned on, as `engram export-tables ADAPTER` scores them.

Each run's files go to a folder of their own under --out (the runs are only read). The gate is
told to keep every format (``accept_loss`` 1e9 nats): this records what each costs; the gate's own
0.01 nats decides in use. A format's loss change is said to resolve when its mean over seeds is
at least twice its seeds' spread (compare's rule), and the JSON says which do not. The figure:
bytes per row (at the runs' head width) against the mean loss change, each seed a dot.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from engram.compute import machine
from engram.studies.common import figure, save
from engram.studies.compare import CompareConfig, run_compare
from engram.studies.table_cost import export_gated
from engram.tables.fp8 import row_bytes
from engram.training.train import TrainConfig
from record import SMOKE, write_json  # benchmarks/record.py

FORMATS = ("bf16", "fp16", "fp8", "int8", "int4")
# How each --table_dtype stores a row, in fp8.row_bytes' names (fp8 table files keep fp32 scales).
ROW_FORMAT = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16", "fp8": "fp8+fp32", "int8": "int8",
              "int4": "int4"}


def engram_runs(runs: Path) -> list[Path]:
    found = sorted(p for p in runs.iterdir() if p.name.startswith("engram-") and p.is_dir())
    if not found:
        raise SystemExit(f"no engram-* run folders in {runs} (compare's OUT/runs)")
    return found


def head_dim(path: Path) -> int:
    """The head width of a run's or an adapter's tables (a table row's values)."""
    from engram.artifacts import adapter
    from engram.artifacts.run import read_run_files
    from engram.retrieval.config import EngramConfig

    if adapter.detect(path):
        return EngramConfig.from_dict(adapter.read_meta(path)["config"]).head_dim
    return read_run_files(path).config.engram.head_dim


def per_format(records: list[dict], width: int, fmt: str) -> dict:
    means = [r["mean"] for r in records]
    mean = statistics.fmean(means)
    spread = max(means) - min(means)  # compare's seed spread: max - min over the seeds
    return {"bytes_per_row": row_bytes(width, ROW_FORMAT[fmt]),
            "loss_change_per_seed": means, "loss_change": mean, "seed_spread": spread,
            "resolved": bool(len(means) > 1 and abs(mean) >= 2 * spread),
            "interval_per_seed": [r["interval"] for r in records],
            "kl_per_seed": [r["kl"] for r in records],
            "top1_per_seed": [r["top1"] for r in records],
            "tokens_per_seed": [r["tokens"] for r in records]}


def plot(res: dict, path: Path) -> None:
    fig = figure(figsize=(6, 4))
    ax = fig.subplots()
    for fmt, r in res["formats"].items():
        ys = r.get("loss_change_per_seed", [r["loss_change"]])  # fp32: exact, one point
        ax.scatter([r["bytes_per_row"]] * len(ys), ys, s=14, alpha=0.6)
        ax.annotate(fmt, (r["bytes_per_row"], r["loss_change"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"bytes per row (head width {res['width']})")
    ax.set_ylabel("loss change vs fp32 tables (nats/token)")
    ax.set_title("What a table format costs (each dot a seed)")
    ax.grid(alpha=0.3)
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", help="compare's OUT/runs folder")
    ap.add_argument("--adapters", help="`engram finetune` adapter folders, comma-separated (one "
                    "per seed), instead of compare's runs")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--max_tokens", type=int, default=32_768, help="held-out tokens scored a run")
    ap.add_argument("--out", help="table files, a folder per run and format (default: a temp dir)")
    ap.add_argument("--json", help="write the figures here (the PNG beside it)")
    ap.add_argument("--smoke", action="store_true", help="tiny compare runs trained here (CI)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        cc = CompareConfig(out_dir=tmp.name, steps=4, batch_size=2, seq_len=16, eval_every=2,
                           eval_batches=1, seeds=(0, 1), workers=1, estimate=False,
                           arms=("dense", "engram"))
        run_compare(cc, dataclasses.replace(TrainConfig(), **SMOKE))
        args.runs, args.formats, args.max_tokens = str(Path(tmp.name) / "runs"), "fp8,int4", 256
    if not args.runs and not args.adapters:
        ap.error("give compare's runs folder, --adapters (or --smoke)")
    out = Path(args.out or Path(tmp.name) / "tables")
    formats = args.formats.split(",")
    runs = [Path(a) for a in args.adapters.split(",")] if args.adapters else \
        engram_runs(Path(args.runs))
    records: dict[str, list[dict]] = {f: [] for f in formats}
    width = None
    for run in runs:
        for fmt in formats:
            _, rec = export_gated(run, out / run.name / fmt, fmt, accept_loss=1e9,
                                  max_tokens=args.max_tokens)
            records[fmt].append(rec)
            print(f"{run.name} {fmt}: {rec['mean']:+.2e} nats/token, KL {rec['kl']:.2e}, "
                  f"top-1 {rec['top1']:.2%}", flush=True)
        if width is None:
            width = head_dim(run)
    res = {"cpu": machine.cpu_id(), "runs": [str(r) if args.adapters else r.name for r in runs],
           "runs_folder": None if args.smoke or args.adapters else args.runs,
           "max_tokens": args.max_tokens,
           "width": width, "formats": {f: per_format(records[f], width, f) for f in formats},
           "gate_threshold": 0.01, "smoke": args.smoke, "wall_s": time.perf_counter() - t0}
    res["formats"]["fp32"] = {"bytes_per_row": row_bytes(width, "fp32"), "loss_change": 0.0,
                              "exact": True}
    if args.json:
        write_json(args.json, res)
        plot(res, Path(args.json).with_suffix(".png"))
    return res


if __name__ == "__main__":
    main()
