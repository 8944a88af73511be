"""Training from the file tier against training in memory, at `engram compare`'s shapes.

    python benchmarks/train_tier.py --json benchmarks/results/train_tier.json [--steps 40]
        [--budget_frac 0.1] [--smoke]

compare's Engram model (its default shapes: 16 x 128 tokens a step, one Engram layer, ~160k rows
of 32 floats, RowAdam) is built twice in this process, once with its table in memory and once on
the file tier (``--table_tier file``, the tier folder under TMPDIR) with a resident budget of
``--budget_frac`` of the table's file bytes (rows and optimiser state), raised to the least budget
the tier accepts (one step's most rows, ``tier_attach.budget_need``) where that is larger. Their
training steps are interleaved (load from other processes hits both alike), one torch thread each
as compare's workers. Reported:

(a) whether the two runs' losses are bit-identical at every timed step;
(b) tokens/s of each (median step wall time) and the tier's ratio to memory (goal >= 0.9x), with
    the tier's time on the training thread reading rows (or waiting on the read-ahead) and
    writing them back, and how many steps were read ahead.
A third run, on the tier with two steps' budget (room for the read-ahead), is interleaved too.
The tier reads and writes rows by id (os.preadv / os.pwritev; no memory map): at this shape the
run without read-ahead went from 1.009x (the map, its read 5 ms + write 13 ms a step) to 0.990x
memory (9 + 31 ms), within this machine's noise; one path serves small tables and large.

    python benchmarks/train_tier.py --beyond --json benchmarks/results/train_tier.json
        [--headroom_mb 1536] [--steps 20] [--smoke]

(c), ``--beyond`` (its figures go under "beyond" in the JSON, beside the rest): three child
processes step in lockstep (the parent asks each for one step in turn, so load from other processes
hits them alike): "memory" (compare's model, table in memory), "b" (the file tier at compare's
table and a budget of ``--budget_frac`` of its files, as above) and "c": the same model with a
table of at least twice its process's cap, on the file tier with the default budget (two steps'
rows: room for the read-ahead), in a process whose address space is capped (RLIMIT_AS) at its own
baseline plus ``--headroom_mb``: the baseline is the address space the child has mapped after its
imports (torch's CPU build maps ~0.6 GiB, its CUDA build, the index's default on Linux x86_64,
~3.1 GiB of libraries even with no GPU), measured by the child itself; the cap is set then, before
the model or any table is built, as offload.py's ``beyond_ram`` does for serving, and (c)'s table
is sized from it, so the table is twice the cap whichever torch is installed. Reported: each
child's tokens/s (median step), (c)'s ratio to (b) (goal >= 0.8x), peak RSS (VmHWM), the cap
with its baseline and headroom, the table's and the files' bytes, the setup time (writing the
initial rows), and whether "b" trained the same losses as "memory".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engram.compute import machine
from engram.studies.compare import CompareConfig
from engram.training import tier_attach
from engram.training.train import TrainConfig, build_run, train_step

sys.path.insert(0, str(Path(__file__).parent))
from record import SMOKE, write_json  # noqa: E402  (benchmarks/record.py)
from table_optimizer import engram_config  # noqa: E402  (compare's Engram variant)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (each run)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--budget_frac", type=float, default=0.1,
                    help="resident budget, a fraction of the table's file bytes")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 3 steps (CI)")
    ap.add_argument("--beyond", action="store_true",
                    help="goal (c): a table twice a process's RLIMIT_AS, against (b)")
    # 1.5 GiB above the imports' address space: at compare's shapes the uncapped children peak
    # 1.1-1.3 GiB above it (numba's JIT, the tokenizer, compare's activations at 16 x 128 tokens);
    # the cap once was an absolute 2 GiB, 1.46 GiB above torch's CPU build's imports (an absolute
    # 1.5 GiB failed in the backward), and left nothing once the CUDA build's 3.1 GiB had mapped
    ap.add_argument("--headroom_mb", type=float, default=1536,
                    help="--beyond: the capped child's address space (RLIMIT_AS) above its own "
                         "after its imports, MiB")
    ap.add_argument("--tmp", default=None, help="folder for the tier files (default: TMPDIR)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args._in_smoke = False
    if args._child:
        return child(json.loads(args._child))
    if args.beyond:
        return beyond(args)
    small, cc = {}, CompareConfig()
    if args.smoke:
        small, cc = SMOKE, CompareConfig(steps=8, batch_size=2, seq_len=16)
        args.steps, args.warmup = 3, 1
    torch.set_num_threads(1)  # as compare's workers
    root = Path(tempfile.mkdtemp(prefix="engram-bench-train-tier-"))
    cfg = dataclasses.replace(engram_config(small, cc), steps=args.warmup + args.steps,
                              eval_every=10**9, ckpt_every=10**9)
    mem = build_run(dataclasses.replace(cfg, out_dir=str(root / "mem")))
    engrams = mem.model.engrams().values()
    table_bytes = sum(e.table.num_rows * e.table.dim * 4 for e in engrams)
    file_bytes = sum(e.table.num_rows * tier_attach.row_bytes(cfg.table_optimizer, e.table.dim)
                     for e in engrams)
    need = tier_attach.budget_need(cfg, mem.model)
    budget = max(int(args.budget_frac * file_bytes), need)
    runs = {"memory": mem}
    # the budget asked for, and two steps' worst case (room for the read-ahead)
    for name, b in (("file", budget), ("file_read_ahead", max(2 * need, budget))):
        runs[name] = build_run(dataclasses.replace(cfg, out_dir=str(root / name),
                                                   table_tier="file", table_budget_mb=b / 2**20))
    wall: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    load0 = os.getloadavg()
    for i in range(args.warmup + args.steps):
        for k, run in runs.items():
            t0 = time.perf_counter()
            loss = train_step(run)
            run.step += 1
            if i >= args.warmup:
                wall[k].append(time.perf_counter() - t0)
            losses[k].append(loss)
    tokens = cfg.batch_size * cfg.seq_len
    speed = {k: {"median_step_s": statistics.median(w), "tokens_per_s": tokens / statistics.median(w)}
             for k, w in wall.items()}
    tiers = {}
    for k in ("file", "file_read_ahead"):
        t = runs[k].batches.tier
        t.wait()
        tiers[k] = {"budget_bytes": t.budget, "budget_over_file_bytes": t.budget / file_bytes,
                    "budget_over_table_bytes": t.budget / table_bytes,
                    "peak_working_sets_bytes": t.peak, "steps_read_ahead": t.read_ahead,
                    "losses_bit_identical": losses[k] == losses["memory"],
                    "tokens_per_s_over_memory": speed[k]["tokens_per_s"]
                    / speed["memory"]["tokens_per_s"],
                    "read_ms_per_step": 1e3 * t.read_s / len(losses[k]),
                    "write_ms_per_step": 1e3 * t.write_s / len(losses[k])}
        t.close()
    res = {"cpu": machine.cpu_id(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "threads": 1, "smoke": args.smoke, "budget_frac_asked": args.budget_frac,
           "shape": {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                     "table_size": cfg.table_size, "table_optimizer": cfg.table_optimizer,
                     "d_model": cfg.d_model, "n_layer": cfg.n_layer},
           "table_bytes": table_bytes, "file_bytes": file_bytes, "least_budget_bytes": need,
           "timed_steps": args.steps, "speed": speed, "tiers": tiers,
           "load_avg": {"start": load0, "end": os.getloadavg()}}
    print(f"CPU: {res['cpu']}; {tokens} tokens a step, table {table_bytes / 2**20:.1f} MB "
          f"({file_bytes / 2**20:.1f} MB with {cfg.table_optimizer} state); memory "
          f"{speed['memory']['tokens_per_s']:,.0f} tok/s")
    for k, r in tiers.items():
        print(f"{k}: budget {r['budget_bytes'] / 2**20:.2f} MB ({r['budget_over_file_bytes']:.1%} "
              f"of the files): (a) losses bit-identical {r['losses_bit_identical']}; (b) "
              f"{speed[k]['tokens_per_s']:,.0f} tok/s = {r['tokens_per_s_over_memory']:.3f}x "
              f"memory (read {r['read_ms_per_step']:.1f} ms, write {r['write_ms_per_step']:.1f} "
              f"ms a step on the training thread; {r['steps_read_ahead']} steps read ahead)")
    shutil.rmtree(root, ignore_errors=True)
    if args.smoke:  # CI runs --smoke alone: (c)'s machinery (the cap, the children) too
        args._in_smoke = True
        res["beyond"] = beyond(args)
    if args.json:  # (c)'s figures, from a run of their own, are kept
        old = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        write_json(args.json, {**({"beyond": old["beyond"]} if "beyond" in old else {}), **res})
    return res


def child(spec: dict) -> dict:
    """One run of ``--beyond``, in its own process: capped (RLIMIT_AS) first where asked, at its
    baseline (the address space its imports mapped) plus ``spec["headroom"]``, its table sized
    from that cap where ``spec["table"]`` asks; then built; then one training step per line on
    stdin, its wall time a line on stdout."""
    torch.set_num_threads(1)
    status = open("/proc/self/status").read()
    base_rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
    base_vm = int(status.split("VmSize:")[1].split()[0]) * 1024
    limit = None
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["cfg"].items()}  # JSON lists
    if spec.get("headroom"):
        limit = base_vm + spec["headroom"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if spec.get("table"):  # table_size for table bytes of at least this many times the cap or bytes
        t = spec["table"]
        want = t["over_limit"] * limit if "over_limit" in t else t["bytes"]
        cfg["table_size"] = int(want / t["bytes_per_size"]) + 1
    t0 = time.perf_counter()
    run = build_run(TrainConfig(**cfg))
    setup_s = time.perf_counter() - t0
    print(json.dumps({"ready": setup_s, "limit": limit, "baseline_vm": base_vm,
                      "table_size": cfg["table_size"]}), flush=True)
    losses = []
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        losses.append(train_step(run))
        run.step += 1
        print(json.dumps({"wall": time.perf_counter() - t0}), flush=True)
    tier = getattr(run.batches, "tier", None)
    out = {"setup_s": setup_s, "losses": losses, "baseline_rss": base_rss,
           "baseline_vm": base_vm, "limit": limit, "headroom": spec.get("headroom")}
    if tier is not None:
        tier.wait()
        out.update(budget_bytes=tier.budget, peak_working_sets_bytes=tier.peak,
                   fixed_bytes=tier.fixed, steps_read_ahead=tier.read_ahead,
                   read_ms_per_step=1e3 * tier.read_s / max(len(losses), 1),
                   write_ms_per_step=1e3 * tier.write_s / max(len(losses), 1))
        tier.close()
    status = open("/proc/self/status").read()  # VmHWM: getrusage's ru_maxrss keeps the parent's
    out.update(peak_rss=int(status.split("VmHWM:")[1].split()[0]) * 1024,  # peak from before exec
               peak_vm=int(status.split("VmPeak:")[1].split()[0]) * 1024)
    print(json.dumps({"done": out}), flush=True)
    return out


def beyond(args) -> dict:
    small, cc = {}, CompareConfig()
    if args.smoke:
        small, cc = SMOKE, CompareConfig(steps=8, batch_size=2, seq_len=16)
        args.steps, args.warmup = 3, 1
    headroom = int(args.headroom_mb * 2**20)
    root = Path(tempfile.mkdtemp(prefix="engram-bench-train-beyond-", dir=args.tmp))
    cfg = dataclasses.replace(engram_config(small, cc), steps=args.warmup + args.steps,
                              eval_every=10**9, ckpt_every=10**9, threads=1)
    probe = build_run(dataclasses.replace(cfg, out_dir=str(root / "probe")))
    e = next(iter(probe.model.engrams().values()))
    rows_per_size = e.table.num_rows / cfg.table_size  # rows per unit of table_size (n-gram heads)
    n_tables = len(probe.model.engrams())
    file_bytes_b = sum(t.table.num_rows * tier_attach.row_bytes(cfg.table_optimizer, t.table.dim)
                       for t in probe.model.engrams().values())
    budget_b = max(int(args.budget_frac * file_bytes_b), tier_attach.budget_need(cfg, probe.model))
    del probe
    # table_size for (c), set by its child from its cap: tables of at least twice the cap (primes
    # are picked near table_size); --smoke: 32 MiB of table, under the same kind of cap: the
    # machinery, not the goal
    table = {"bytes_per_size": 4 * e.table.dim * n_tables * rows_per_size,
             **({"bytes": 32 * 2**20} if args.smoke else {"over_limit": 2.05})}
    specs = {"memory": {"cfg": cfg.to_dict() | {"out_dir": str(root / "memory")}},
             "b": {"cfg": cfg.to_dict() | {"out_dir": str(root / "b"), "table_tier": "file",
                                           "table_budget_mb": budget_b / 2**20}},
             "c": {"cfg": cfg.to_dict() | {"out_dir": str(root / "c"), "table_tier": "file"},
                   "headroom": headroom, "table": table}}
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    print(f"(c): RLIMIT_AS at its imports' address space + {headroom / 2**20:.0f} MiB, a table "
          f"{'of 32 MiB' if args.smoke else 'twice that'}; starting the runs", file=sys.stderr)
    procs = {k: subprocess.Popen([sys.executable, __file__, "--_child", json.dumps(v)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for k, v in specs.items()}
    try:
        return _lockstep(args, cfg, procs, root, headroom)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)


def _lockstep(args, cfg, procs: dict, root: Path, headroom: int) -> dict:
    hello = {k: json.loads(_line(p, k)) for k, p in procs.items()}
    ready = {k: h["ready"] for k, h in hello.items()}
    limit, base_vm, big = hello["c"]["limit"], hello["c"]["baseline_vm"], hello["c"]["table_size"]
    print(f"(c): RLIMIT_AS {limit / 2**20:.0f} MiB = {base_vm / 2**20:.0f} MiB of imports + "
          f"{headroom / 2**20:.0f} MiB; table_size {big:,}", file=sys.stderr)
    wall: dict[str, list[float]] = {k: [] for k in procs}
    load0 = os.getloadavg()
    for i in range(args.warmup + args.steps):
        for k, p in procs.items():
            p.stdin.write("step\n")
            p.stdin.flush()
            w = json.loads(_line(p, k))["wall"]
            if i >= args.warmup:
                wall[k].append(w)
    done = {}
    for k, p in procs.items():
        p.stdin.write("done\n")
        p.stdin.flush()
        done[k] = json.loads(_line(p, k))["done"]
        p.wait()
    files_c = _table_bytes(root / "c" / "tier")
    big_tables = files_c["table_bytes"]
    tokens = cfg.batch_size * cfg.seq_len
    speed = {k: {"median_step_s": statistics.median(w),
                 "tokens_per_s": tokens / statistics.median(w)} for k, w in wall.items()}
    c = done["c"]
    res = {"cpu": machine.cpu_id(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "threads": 1, "smoke": args.smoke, "timed_steps": args.steps,
           "rlimit_as_bytes": limit, "rlimit_as_baseline_vm_bytes": base_vm,
           "rlimit_as_over_baseline_bytes": headroom,
           "rlimit_as": "the (c) child's address space after its imports (baseline_vm) + "
                        "rlimit_as_over_baseline_bytes, set before the model or any table is built",
           "table_size_c": big, "table_bytes_c": big_tables, "file_bytes_c": files_c["file_bytes"],
           "table_over_limit": big_tables / limit,
           "table_over_headroom": big_tables / headroom, "speed": speed,
           "c_tokens_per_s_over_b": speed["c"]["tokens_per_s"] / speed["b"]["tokens_per_s"],
           "b_tokens_per_s_over_memory": speed["b"]["tokens_per_s"]
           / speed["memory"]["tokens_per_s"],
           "b_losses_bit_identical_to_memory": done["b"]["losses"] == done["memory"]["losses"],
           "setup_s": ready, "children": {k: {x: y for x, y in v.items() if x != "losses"}
                                          for k, v in done.items()},
           "load_avg": {"start": load0, "end": os.getloadavg()}}
    print(f"CPU: {res['cpu']}; (c) table {big_tables / 2**30:.2f} GiB "
          f"({res['table_over_limit']:.2f}x RLIMIT_AS {limit / 2**30:.2f} GiB = the imports' "
          f"{base_vm / 2**30:.2f} GiB + {headroom / 2**30:.2f} GiB; files "
          f"{res['file_bytes_c'] / 2**30:.2f} GiB), peak RSS {c['peak_rss'] / 2**20:.0f} MiB "
          f"(before the model {c['baseline_rss'] / 2**20:.0f} MiB, table budget "
          f"{c['budget_bytes'] / 2**20:.1f} MiB), setup {ready['c']:.1f} s")
    for k in procs:
        print(f"{k}: {speed[k]['tokens_per_s']:,.0f} tok/s, peak RSS "
              f"{done[k]['peak_rss'] / 2**20:.0f} MiB")
    print(f"(c) / (b) tokens/s: {res['c_tokens_per_s_over_b']:.3f}x (goal >= 0.8); (b) / memory "
          f"{res['b_tokens_per_s_over_memory']:.3f}x, losses identical "
          f"{res['b_losses_bit_identical_to_memory']}")
    if args.json and not args._in_smoke:
        old = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        write_json(args.json, {**old, "beyond": res})
    return res


def _table_bytes(folder: Path) -> dict:
    rows = sum(p.stat().st_size for p in folder.glob("layer*.rows"))
    files = sum(p.stat().st_size for p in folder.glob("layer*.*"))
    return {"table_bytes": rows, "file_bytes": files}


def _line(p: subprocess.Popen, name: str) -> str:
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise RuntimeError(f"the {name!r} child ended (exit {p.returncode})")
    return line


if __name__ == "__main__":
    main()
