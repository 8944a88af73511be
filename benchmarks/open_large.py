"""Opening a run with a 1M-row table: built on meta and loaded with assign (issue 48, gpt-fast's
``_load_model``) against the build it replaced, which drew every table from N(0, std) and then
copied the checkpoint over it.

    python benchmarks/open_large.py [--table_size 125000] [--rounds 5]
        [--json benchmarks/results/open_large.json]

The run: a tiny backbone (2 layers, d 32) with one Engram layer at the default table layout (2
orders x 4 heads, 32 wide), ``table_size`` rows a head (primes), so 125,000 gives a table of
about 1M rows (128 MB in float32), trained 1 step. Each open is a fresh process (imports done
before the clock starts): ``engram.open(run)`` as it is ("new"), and the same call with
``build_lm`` forced to ``init=True`` ("old": today's code path before issue 48, bit for bit the
same model). The two alternate round by round; reported: the median of the rounds' wall times
and of the processes' peak resident memory (VmHWM), the peak above the process's resident memory
just before opening, the ratios new / old, and whether both opened the same state dict (a digest
of every tensor's bytes). The CPU and the load average go with them: the machines are shared.

The new path's tables are the checkpoint's own tensors, which safetensors maps from the file
(private, copy on write): their pages come in as rows are first read, from the page cache. So the
digest pass, which reads every value once, is timed too ("read_all_s", and the peak after it):
opening plus one read of everything is the fair total when every row will be used.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record import SMOKE, open_line, open_summary, run_child, write_json  # noqa: E402

RUN = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=2,
           engram_layers=(0,), n_head_per_ngram=4, n_embed_per_ngram=128, steps=1, warmup=1,
           eval_every=1, eval_batches=1, ckpt_every=1, log_every=1)

# One open in a fresh process: "old" forces the build that initialises every table (init=True).
CHILD = r"""
import hashlib, json, sys, time
import torch
import engram
import engram.models.nine_model as nine
import engram.serving.loader  # imports before the clock
run, mode = sys.argv[1], sys.argv[2]
if mode == "old":
    build = nine.build_lm
    nine.build_lm = lambda *a, init=True, **k: build(*a, init=True, **k)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])  # kB
before = status("VmRSS:")
t0 = time.perf_counter()
rt = engram.open(run)
took = time.perf_counter() - t0
peak = status("VmHWM:")
t0 = time.perf_counter()
with torch.no_grad():  # every value read once, no copy: the assigned tables page in here
    for v in rt.model.state_dict().values():
        v.sum()
read_all = time.perf_counter() - t0
after_read = status("VmHWM:")
h = hashlib.sha256()
for k, v in rt.model.state_dict().items():
    raw = v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    h.update(k.encode() + str(v.dtype).encode() + raw)
print(json.dumps({"open_s": took, "read_all_s": read_all, "rss_before_kb": before,
                  "peak_kb": peak, "peak_after_read_kb": after_read, "digest": h.hexdigest()}))
"""


def make_run(folder: Path, table_size: int, smoke: bool) -> dict:
    """A 1-step run with one Engram layer of ``table_size`` rows a head; its table's shape."""
    import torch

    from engram.training.train import TrainConfig, train

    base = {**RUN, **({k: SMOKE[k] for k in ("n_head_per_ngram", "n_embed_per_ngram")}
                      if smoke else {})}
    torch.manual_seed(0)
    run = train(TrainConfig(out_dir=str(folder), table_size=table_size, **base), progress=False)
    w = run.model.engrams()[0].table.weight
    return {"rows": w.shape[0], "dim": w.shape[1], "mb": w.numel() * w.element_size() / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table_size", type=int, default=125_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="benchmarks/results/open_large.json")
    p.add_argument("--smoke", action="store_true", help="a 997-row-a-head table, 1 round (CI)")
    a = p.parse_args()
    if a.smoke:
        a.table_size, a.rounds = SMOKE["table_size"], 1
    import safetensors
    import torch

    from engram.compute import machine

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="open-large-") as tmp:
        run = Path(tmp) / "run"
        table = make_run(run, a.table_size, a.smoke)
        got: dict[str, list[dict]] = {"new": [], "old": []}
        for r in range(a.rounds):
            for mode in (("new", "old") if r % 2 == 0 else ("old", "new")):
                got[mode].append(run_child(CHILD, [str(run), mode]))
    load_after = os.getloadavg()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in got[mode])

    summary = {m: {**open_summary(got[m]), "read_all_s": med(m, "read_all_s"),
                   "peak_after_read_mb": med(m, "peak_after_read_kb") / 1024}
               for m in got}
    same = len({x["digest"] for m in got for x in got[m]}) == 1
    result = {
        "cpu": machine.cpu_id(), "threads": os.cpu_count(), "torch": torch.__version__,
        "safetensors": safetensors.__version__,  # its tensors map the file: the new path's pages
        "load_average_before": load_before, "load_average_after": load_after,
        "note": "shared machine: the load average is that of everything running beside it",
        "table": table, "table_size": a.table_size, "rounds": a.rounds,
        "median": summary,
        "new_over_old": {k: summary["new"][k] / summary["old"][k] for k in summary["new"]},
        "same_state_dict": same, "runs": got,
    }
    for m in ("old", "new"):
        s = summary[m]
        print(f"{open_line(m, s)}; then every value read once {s['read_all_s'] * 1e3:.0f} ms, "
              f"peak {s['peak_after_read_mb']:.0f} MB")
    r = result["new_over_old"]
    print(f"new / old: time {r['open_s']:.3f}x, peak {r['peak_mb']:.3f}x, above start "
          f"{r['peak_over_start_mb']:.3f}x, peak after reading all "
          f"{r['peak_after_read_mb']:.3f}x; table {table['rows']:,} x {table['dim']} "
          f"({table['mb']:.0f} MB); same state dict: {same}; {result['cpu']}, load "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f}")
    if not same:
        raise SystemExit("the two builds opened different state dicts")
    write_json(a.json, result)


if __name__ == "__main__":
    main()
