"""DeepSeek-V4.1 tables: FP8 row lookup + dequantisation vs an fp32 gather, and bytes per row.

    python benchmarks/v41.py [--rows 262144] [--json benchmarks/results/v41.json] [--smoke]

One layer's table at V4.1's head dim (256), stored four ways: fp32 rows, bf16 rows, FP8 rows with
E8M0 scales (V4.1's format, one byte per 32 values) and FP8 rows with fp32 scales. Lookups of the
row ids a decode step and a prefill read (a batch of real-text hash ids would be Zipfian; uniform
random ids are the cold worst case) are timed in memory and from the table file (the page-cache
tier), rows/s and the ratio to the fp32 in-memory gather measured in the same run. The outputs of
every FP8 path are checked equal to each other (the E8M0 table is the fp32-scale table's values
re-quantised losslessly). Records the CPU model and the torch thread count.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from engram import EngramConfig
from engram.gemm import cpu_model
from engram.tables.fp8 import dequantize_fp8, quantize_fp8_e8m0, row_bytes
from engram.tables.tablefile import write_table
from engram.tables.tiers import FileTable
from timing import median_seconds  # benchmarks/timing.py: the script's folder is on sys.path
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

DIM, BLOCK = 256, 32



def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=262_144, help="rows of the table (x 256 values)")
    p.add_argument("--json", default="benchmarks/results/v41.json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="a 4,096-row table, one timing each (CI)")
    a = p.parse_args()
    if a.smoke:
        a.rows, a.repeat = 4096, 1
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(a.rows, DIM, generator=g) * 40).to(torch.float8_e4m3fn)
    codes = torch.randint(110, 130, (a.rows, DIM // BLOCK), generator=g, dtype=torch.uint8)
    fp32 = dequantize_fp8(q, codes)  # [R, e]: the same values in every format
    bf16 = fp32.to(torch.bfloat16)
    scales32 = dequantize_fp8(torch.ones(a.rows, DIM // BLOCK, dtype=torch.float8_e4m3fn),
                              codes)  # the E8M0 scales as fp32 values
    q2, c2 = quantize_fp8_e8m0(fp32, BLOCK)
    assert torch.equal(dequantize_fp8(q2, c2), fp32)
    cfg = EngramConfig(engram_vocab_size=a.rows, max_ngram_size=4, n_embed_per_ngram=8 * DIM,
                       n_head_per_ngram=8, layer_ids=[1], profile="v4.1")
    shapes = {"decode (64 seqs x 24 heads)": 64 * 24, "prefill (4 x 512 x 24 heads)": 4 * 512 * 24}
    res = {"cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "rows": a.rows,
           "load_avg_start": os.getloadavg()[0],
           "head_dim": DIM, "bytes_per_row": {f: row_bytes(DIM, f) for f in
                                              ("fp8+e8m0", "fp8+fp32", "bf16", "fp32")},
           "lookups": {}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        paths = {}
        for name, fmt in (("fp8+e8m0", "e8m0"), ("fp8+fp32", "fp32")):
            paths[name] = Path(tmp) / f"{name}.table"
            src = (lambda x, y: (q2[x:y], c2[x:y])) if fmt == "e8m0" else fp32
            write_table(paths[name], src, num_rows=a.rows, dim=DIM, layer_id=1, config=cfg,
                        dtype="fp8", scale_format=fmt)
        files = {k: FileTable(v) for k, v in paths.items()}
        for shape, n in shapes.items():
            ids = torch.randint(0, a.rows, (n,), generator=g)
            paths_ = {
                "fp32 gather (memory)": lambda: fp32.index_select(0, ids),
                "bf16 gather -> fp32 (memory)": lambda: bf16.index_select(0, ids).float(),
                "fp8+e8m0 gather + dequant (memory)": lambda: dequantize_fp8(
                    q.index_select(0, ids), codes.index_select(0, ids)),
                "fp8+fp32 gather + dequant (memory)": lambda: dequantize_fp8(
                    q.index_select(0, ids), scales32.index_select(0, ids)),
                "fp8+e8m0 file tier": lambda: files["fp8+e8m0"].lookup(ids),
                "fp8+fp32 file tier": lambda: files["fp8+fp32"].lookup(ids),
            }
            want = fp32.index_select(0, ids)
            for name, fn in paths_.items():
                if "fp8+e8m0" in name:
                    assert torch.equal(fn(), want), name
            times = {name: median_seconds(fn, a.repeat) for name, fn in paths_.items()}
            base = times["fp32 gather (memory)"]
            res["lookups"][shape] = {name: {"rows_per_s": n / t, "vs_fp32_gather": base / t}
                                     for name, t in times.items()}
            print(f"{shape}, {n} rows:")
            for name, r in res["lookups"][shape].items():
                print(f"  {name:38s} {r['rows_per_s']:>14,.0f} rows/s  "
                      f"{r['vs_fp32_gather']:.2f}x the fp32 gather")
        for f in files.values():
            f.close()
    res["load_avg_end"] = os.getloadavg()[0]  # other jobs on the machine during the timings
    print("bytes per row: " + ", ".join(f"{k} {v}" for k, v in res["bytes_per_row"].items()))
    write_json(a.json, res, indent=1)
    print(f"wrote {a.json} ({res['cpu']}, {res['torch_threads']} thread)")


if __name__ == "__main__":
    main()
