"""Tables beyond memory: the reference LM with >= 2 GB of Engram tables served from each tier.

    python benchmarks/offload.py --json out/offload.json [--png out/offload_hit_rate.png]
    python benchmarks/offload.py --beyond-gb 32 --json out/beyond.json   # a table larger than RAM
    python benchmarks/offload.py --smoke --json out/offload.json   # tiny tables, every tier (CI)

Measures, in one process and against the in-memory baseline measured in the same run (machines are
noisy; tiers are interleaved batch by batch):
  prefill and decode tokens/s with the tables (a) in the model's memory (``model``, the baseline),
  (b) on each tier of the tier registry named in --tiers (engram.tables.registry; default the ones
  that read the table files where they lie: ``file``, the page cache; ``shared``, one mapping for
  every process; ``pool``, a pool region filled from the files), (c) in table files behind the hot
  cache + background prefetch (``file_cached``), (d) like (c) after the files' pages were evicted
  (posix_fadvise DONTNEED; ``file_cold_cached``, and ``_lookahead`` announcing the next batch);
  gather rows/s of the file tier vs torch.index_select on an in-memory tensor;
  cache hit rate vs cache size (fraction of the table) on real tokenised text (held-out split, the
  static part chosen by n-gram row frequency on the training split), with the rows' fitted Zipf
  exponent, drawn as a PNG;
  a table file several times larger than the RAM budget of a process still serving exact rows
  through windowed mappings: the process's address space is capped (RLIMIT_AS) at what its imports
  mapped (its baseline: ~0.6 GiB with torch's CPU build, ~3.1 GiB with the CUDA build that the
  package index gives on Linux x86_64) plus --budget-mb, and the table is at least twice that cap
  (3 GiB or more; --beyond-gb sets it).
Threads: torch runs single-threaded by default (--threads); on a shared 2-core machine OpenMP's
spinning threads stall whenever the other core is busy.

The tiers and their prefill / decode loops live in offload_tiers.py; this script runs them,
measures the rest and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engram import (
    EngramConfig,
    EngramLM,
    MemoryTable,
    NgramHasher,
    build_compression,
    build_engram,
)
from engram.artifacts.table_files import export_tables
from engram.compute.machine import cpu_id
from engram.tables.cache import build_cache, zipf_exponent
from engram.tables.registry import TIERS
from engram.tables.tablefile import table_path, write_table
from engram.tables.tiers import FileTable
from engram.training.corpus import DataConfig, build_corpus

sys.path.insert(0, str(Path(__file__).parent))
from offload_tiers import (  # noqa: E402  (benchmarks/offload_tiers.py)
    BASELINE,
    Tiers,
    bench_decode,
    bench_prefill,
    close,
    reference_model,
    resident_fraction,
    stats_of,
)
from record import write_json  # benchmarks/record.py: the script's folder is on sys.path

# The registered tiers that read the table files where they lie (the others copy them into memory).
DISK_TIERS = ("file", "shared", "pool")
FRACTIONS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)


def bench_gather(memory: EngramLM, folder: Path, hasher, corpus, io_threads: int) -> dict:
    lid = memory.config.engram_layers[0]
    weight = memory.engrams()[lid].table.weight.detach()
    raw = torch.from_numpy(corpus.val[:16 * 256].astype(np.int64)).view(16, 256)
    rows = memory.engrams()[lid].rows(hasher.hash(raw)[lid]).reshape(-1)  # 65,536 real-text rows
    table = FileTable(table_path(folder, lid), verify=False)

    def rate(fn, reps=10):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return rows.numel() * reps / (time.perf_counter() - t0)

    out = {"rows_per_s": rate(lambda: table.lookup(rows)),
           "index_select_rows_per_s": rate(lambda: torch.index_select(weight, 0, rows))}
    for threads in sorted({1, io_threads}):  # cold: every page from the disk
        cold = FileTable(table_path(folder, lid), verify=False, io_threads=threads,
                         min_split_rows=1)
        del table
        cold.evict()
        t0 = time.perf_counter()
        cold.lookup(rows)
        out[f"cold_rows_per_s_io{threads}"] = rows.numel() / (time.perf_counter() - t0)
        table = cold
    table.close()
    return out


def bench_hit_rate(hasher, config: EngramConfig, corpus, counts, png: str | None) -> dict:
    """Hit rate of the hot cache on held-out text (one consecutive stream, 2,048-token batches) as a
    function of its size. Hits do not depend on the rows' contents, so a 1-wide table stands in."""
    from tqdm.auto import tqdm

    lid = config.layer_ids[0]
    engram = build_engram(config, lid, 8, table=None)
    store = MemoryTable(hasher.num_rows(lid), 1)
    val = torch.from_numpy(corpus.val.astype(np.int64))
    n = val.numel() // 2048 * 2048
    rows = engram.rows(hasher.hash(val[None, :n])[lid]).view(-1, 2048 * config.num_heads)
    zipf = zipf_exponent(counts[lid], 1, 10_000)
    curves = {"static 90% + LRU 10%": {}, "static": {}, "LRU": {}}
    for frac in tqdm(FRACTIONS, desc="hit rate", leave=False):
        for policy, share in zip(curves, (0.9, 1.0, 0.0)):
            cache = build_cache(store, counts[lid], frac, static_share=share)
            with torch.no_grad():
                for r in rows:
                    cache.lookup(r)
            curves[policy][frac] = cache.stats.hit_rate
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, c in curves.items():
            ax.plot(list(c), list(c.values()), marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("cache size (fraction of the layer's table rows)")
        ax.set_ylabel("hit rate (row reads)")
        ax.set_title(f"Engram hot cache on held-out text (rows' Zipf s = {zipf:.2f})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        Path(png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=120)
        plt.close(fig)
    main = curves["static 90% + LRU 10%"]
    return {"zipf_exponent": zipf, "hit_rate": {str(f): main[f] for f in (0.001, 0.01, 0.1)},
            "curves": {p: {str(f): h for f, h in c.items()} for p, c in curves.items()},
            "rows_per_layer": store.num_rows, "eval_tokens": int(n), "png": png}


# -- a table larger than the process's RAM budget --------------------------------------------------

def _pattern(a: int, b: int, dim: int = 64) -> torch.Tensor:
    """Rows a..b-1 of the check table: row r = [r mod 2^16, r div 2^16, 0.5, 1.0, ...] (exact)."""
    r = torch.arange(a, b)
    x = (torch.arange(dim, dtype=torch.float32) * 0.5).expand(b - a, dim).clone()
    x[:, 0], x[:, 1] = (r & 0xFFFF).float(), (r >> 16).float()
    return x


def _vm() -> tuple[int, int]:
    """This process's address space and resident memory (VmSize, VmRSS), bytes."""
    status = open("/proc/self/status").read()
    return tuple(int(status.split(f"{k}:")[1].split()[0]) * 1024 for k in ("VmSize", "VmRSS"))


def beyond_ram_child(path: str, budget: int) -> None:
    """Runs in a fresh process: tell the parent the address space the imports took (it sizes the
    table from it), and on its "go" cap the address space at that baseline + ``budget``, then serve
    lookups from the big file."""
    torch.set_num_threads(1)
    print(json.dumps({"baseline_vm": _vm()[0]}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    table = FileTable(path, verify=False)  # reads only the header
    rows = table.num_rows
    vm, rss = _vm()  # torch and friends, before serving
    limit = vm + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {"rlimit_as": limit, "baseline_vm": vm, "baseline_rss": rss, "budget": budget,
           "rlimit_as_is": "baseline_vm (the address space mapped by the imports and the table "
                           "file's header) + budget"}
    try:  # one mapping of the whole file does not fit in the budget...
        table.lookup(torch.tensor([rows - 1]))
        out["whole_file_mapping"] = "fit"
    except (OSError, MemoryError, RuntimeError) as e:
        out["whole_file_mapping"] = f"refused: {type(e).__name__}: {e}"
    table.close()
    # ...windows of budget/8, at most 2 mapped at a time, do
    table = FileTable(path, verify=False, window_bytes=budget // 8, max_windows=2)
    g = torch.Generator().manual_seed(0)
    checked, t0, ok = 0, time.perf_counter(), True
    while time.perf_counter() - t0 < 10 and checked < 2_000_000:
        r = torch.randint(0, rows, (16384,), generator=g)
        got = table.lookup(r)
        ok &= bool(got[:, 0].long().eq(r & 0xFFFF).all() and got[:, 1].long().eq(r >> 16).all()
                   and torch.equal(got[:, 2:], _pattern(0, 1)[0, 2:].expand(r.numel(), -1)))
        checked += r.numel()
    status = open("/proc/self/status").read()
    out.update(rows_checked=checked, exact=ok, rows_per_s=checked / (time.perf_counter() - t0),
               peak_rss=int(status.split("VmHWM:")[1].split()[0]) * 1024,
               peak_vm=int(status.split("VmPeak:")[1].split()[0]) * 1024)
    print(json.dumps(out))


def bench_beyond_ram(folder: Path, table_gb: float | None, budget_mb: int) -> dict:
    """``table_gb`` None: 3 GiB, or twice the child's cap (its imports' address space + the
    budget) where that is larger."""
    path = folder / "beyond.table"
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--_beyond-child", str(path),
                             str(budget_mb << 20)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        hello = proc.stdout.readline()
        if not hello:
            _, err = proc.communicate(timeout=60)
            raise RuntimeError(f"beyond-RAM child failed before serving: {err[-2000:]}")
        expect = json.loads(hello)["baseline_vm"] + (budget_mb << 20)  # the cap, near enough
        size = table_gb * 2**30 if table_gb is not None else max(3 * 2**30, 2.05 * expect)
        if size <= expect:
            print(f"note: the {size / 2**30:.2f} GiB table is within the child's address-space "
                  f"cap (~{expect / 2**30:.2f} GiB), not beyond it (only the budget is free to map "
                  "it)", file=sys.stderr)
        t0 = time.perf_counter()
        header = write_table(path, _pattern, num_rows=int(size / 256), dim=64, layer_id=0,
                             config=EngramConfig(layer_ids=[0]), tag="beyond-ram check pattern",
                             progress=True)
        written_s = time.perf_counter() - t0
        stdout, err = proc.communicate("go\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"beyond-RAM child failed: {err[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    mem_total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    path.unlink()
    return {"table_bytes": header.file_size, "machine_ram_bytes": mem_total,
            "write_s": written_s, "table_over_rlimit_as": header.file_size / out["rlimit_as"],
            "table_over_budget": header.file_size / out["budget"], **out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="hit-rate curve (default: next to --json)")
    p.add_argument("--table-gb", type=float, default=2.0, help="GiB of fp32 tables, both layers")
    p.add_argument("--cache-fraction", type=float, default=0.01)
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--reps", type=int, default=40, help="prefill rounds (batches per tier)")
    p.add_argument("--prefill-batch", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--decode-reps", type=int, default=6)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--beyond-gb", type=float, default=None,
                   help="table size for the RAM-budget run (default: 3 GiB, or twice its "
                        "process's address-space cap where that is larger)")
    p.add_argument("--budget-mb", type=int, default=512,
                   help="address-space budget of that run, above what its imports mapped")
    p.add_argument("--only-beyond", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-chars", type=int, default=None, help="per corpus source (None: all)")
    p.add_argument("--tiers", default=",".join(DISK_TIERS),
                   help=f"registered tiers to serve from besides the baseline, of {TIERS} (the "
                        "in-memory ones hold another copy of the tables each)")
    p.add_argument("--tmp", default=None, help="folder for the table files (removed at the end)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny tables and rounds: the whole script in seconds (CI)")
    p.add_argument("--_beyond-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.table_gb, args.reps, args.decode_reps, args.new_tokens = 0.004, 2, 1, 3
        args.prefill_len, args.decode_batch, args.decode_prompt = 32, 2, 8
        args.beyond_gb, args.budget_mb, args.max_chars = 0.2, 64, 200_000
        args.tiers = ",".join(TIERS)  # every tier: tiny tables
    if set(args.tiers.split(",")) - set(TIERS):
        p.error(f"--tiers: unknown {sorted(set(args.tiers.split(',')) - set(TIERS))}; of {TIERS}")
    if args._beyond_child:
        beyond_ram_child(args._beyond_child[0], int(args._beyond_child[1]))
        return 0
    torch.set_num_threads(args.threads)
    png = args.png or (str(Path(args.json).with_suffix("")) + "_hit_rate.png"
                       if args.json else None)
    folder = Path(tempfile.mkdtemp(prefix="engram-offload-", dir=args.tmp))
    result: dict = {}
    load0 = os.getloadavg()[0]
    try:
        if not args.only_beyond:
            t0 = time.perf_counter()
            corpus = build_corpus(DataConfig(max_chars=args.max_chars))
            mc = reference_model(args.table_gb, corpus.vocab_size)
            hasher = NgramHasher(mc.engram, build_compression())
            torch.manual_seed(0)
            memory = EngramLM(mc).eval()
            table_bytes = sum(e.table.weight.numel() * 4 for e in memory.engrams().values())
            print(f"reference model: tables {table_bytes / 1e9:.2f} GB, rows/layer "
                  f"{memory.engrams()[1].table.num_rows:,}", file=sys.stderr)
            folders = {k: folder / k for k in ("warm", "cold", "ahead")}
            for f in folders.values():  # one copy per tier that must be evicted on its own
                export_tables(memory, f, hasher=hasher, tag="offload", progress=True)
            reads = hasher.count_reads(corpus.train)  # {layer: {part: counts}}: the hot caches'
            counts = {lid: r["cold"] for lid, r in reads.items()}
            tiers = Tiers(memory, folders, hasher, reads, args.cache_fraction, args.io_threads)
            served = tiers.all(lookahead=True, registered=tuple(args.tiers.split(",")))
            cold_files = served["file_cold_cached"].evict
            for f in cold_files:
                f.evict()
            resident = [resident_fraction(f.path) for f in cold_files]
            setup_s = time.perf_counter() - t0
            prefill, same_prefill = bench_prefill(served, corpus, hasher, args)
            lookahead = served.pop("file_cold_cached_lookahead")
            stats = {"prefill_lookahead": stats_of(lookahead.model)}
            close({"ahead": lookahead})
            decode, same_decode = bench_decode(served, corpus, hasher, args)
            stats.update({k: stats_of(t.model) for k, t in served.items() if k != BASELINE})
            close(served)
            result = {"prefill": prefill, "decode": decode,
                      "gather": bench_gather(memory, folders["warm"], hasher, corpus,
                                             args.io_threads),
                      "cache": bench_hit_rate(hasher, mc.engram, corpus, counts, png)}
            result["ratios"] = {ph: {k: v / result[ph][BASELINE]
                                     for k, v in result[ph].items() if k != BASELINE}
                                for ph in ("prefill", "decode")}
            result["setup"] = {
                "table_bytes": table_bytes, "cache_fraction": args.cache_fraction,
                "io_threads": args.io_threads, "threads": args.threads, "setup_s": setup_s,
                "prefill_tokens_per_batch": args.prefill_batch * args.prefill_len,
                "prefill_rounds": args.reps, "decode_batch": args.decode_batch,
                "decode_steps": args.decode_reps * (args.new_tokens - 1),
                "cold": "pages evicted before every timed batch / decode step "
                        "(POSIX_FADV_DONTNEED); *_lookahead also announces the next batch's rows "
                        "during this one",
                "cold_resident_fraction_after_evict": resident,
                "tok_s": "median round (best_tok_s: fastest; paired_ratios: median of "
                         "per-round t_memory / t_tier)",
                "tiers_agree": {"prefill_logits": same_prefill.pop("same"),
                                "decode_tokens": same_decode.pop("same")},
                "prefill_detail": same_prefill, "decode_detail": same_decode,
                "tier_stats": stats, "cpus": os.cpu_count(), "cpu": cpu_id(),
                "tiers": args.tiers.split(","), "tiers_skipped": tiers.skipped,
                "loadavg_1min": [load0, os.getloadavg()[0]]}  # other jobs on the machine
            del memory, tiers, served, lookahead
        result["beyond_ram"] = bench_beyond_ram(folder, args.beyond_gb, args.budget_mb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if "ratios" in result:
        load = result["setup"]["loadavg_1min"]
        if max(load) > os.cpu_count():
            print(f"note: load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs; "
                  "other jobs were competing, ratios are noisy (see paired ratios)")
        for ph in ("prefill", "decode"):
            r = result["ratios"][ph]
            q = result["setup"][f"{ph}_detail"]["paired_ratios"]
            print(f"{ph}: {BASELINE} {result[ph][BASELINE]:.0f} tok/s; vs {BASELINE}: "
                  + ", ".join(f"{k} {v:.3f}x (paired {q[k]:.3f})" for k, v in r.items()))
        g, c = result["gather"], result["cache"]
        print(f"gather: file {g['rows_per_s']:.3g} rows/s, index_select "
              f"{g['index_select_rows_per_s']:.3g} rows/s; hit rate "
              + ", ".join(f"{k}: {v:.3f}" for k, v in c["hit_rate"].items())
              + f"; Zipf s = {c['zipf_exponent']:.2f}")
    br = result["beyond_ram"]
    print(f"beyond RAM: {br['table_bytes'] / 2**30:.1f} GiB table served under a "
          f"{br['budget'] / 2**20:.0f} MiB address-space budget (RLIMIT_AS "
          f"{br['rlimit_as'] / 2**30:.2f} GiB = the imports' {br['baseline_vm'] / 2**30:.2f} GiB "
          f"+ the budget; the table {br['table_over_rlimit_as']:.2f}x it; RSS grew "
          f"{(br['peak_rss'] - br['baseline_rss']) / 2**20:.0f} MiB; machine RAM "
          f"{br['machine_ram_bytes'] / 2**30:.1f} GiB): whole-file mapping "
          f"{br['whole_file_mapping'].split(':')[0]}, windows exact={br['exact']}, "
          f"{br['rows_per_s']:.3g} rows/s")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
