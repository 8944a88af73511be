"""Command-line start-up: `engram --help` and `engram CMD --help` for every command, and `engram demo`.

    python benchmarks/cli_startup.py [--reps 5] [--json benchmarks/results/cli_startup.json]

`--help` reads every option from the config dataclasses' source (engram/commandline/schema.py) and imports no
torch, so it should cost about what the interpreter's own start costs, a fraction of one `import
torch`. Each command runs in a fresh interpreter `reps` times; the figures are medians of wall and
CPU (user + sys) seconds, and ratios against two baselines measured in the same run, the same way:
``python -c pass`` (the interpreter alone) and ``python -c "import torch"``. Each help run also
reports whether torch (or numpy) was imported. `engram demo` (tokenizer, compression, hashing, one
module forward) is timed too: its help line says how long it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CHECK = ("import sys, runpy\nsys.argv = {argv!r}\ntry:\n    runpy.run_module('engram', "
         "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('HEAVY', sorted(m for m in "
         "('torch', 'numpy') if m in sys.modules), file=sys.stderr)\n")



def timed(argv: list[str], reps: int) -> dict:
    """Median wall and CPU seconds of ``python *argv`` over ``reps`` fresh processes."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    walls, cpus, stderr = [], [], ""
    for _ in range(reps):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if r.returncode != 0:
            raise SystemExit(f"{argv} failed ({r.returncode}): {r.stderr[-2000:]}")
        stderr = r.stderr
    out = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
    heavy = [line for line in stderr.splitlines() if line.startswith("HEAVY ")]
    if heavy:
        out["heavy_imports"] = json.loads(heavy[-1][len("HEAVY "):].replace("'", '"'))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per figure (median)")
    ap.add_argument("--demo_reps", type=int, default=3, help="fresh processes for engram demo")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "cli_startup.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="one process per figure (CI: checks the script runs; figures meaningless)")
    args = ap.parse_args()
    if args.smoke:
        args.reps = args.demo_reps = 1
    sys.path.insert(0, str(SRC))
    from engram.compute import machine  # after the timings' subprocesses are set up: this imports torch
    from engram.cli import COMMANDS

    res: dict = {"cpu": machine.cpu_id(), "cores": os.cpu_count(),
                 "python": platform.python_version(),
                 "load_avg_start": os.getloadavg()[0], "reps": args.reps}
    res["python_pass"] = timed(["-c", "pass"], args.reps)
    res["import_torch"] = timed(["-c", "import torch"], args.reps)
    base, torch_s = res["python_pass"]["wall_s"], res["import_torch"]["wall_s"]
    helps = {"engram --help": ["--help"], **{f"engram {c} --help": [c, "--help"] for c in COMMANDS}}
    res["help"] = {}
    for name, argv in helps.items():
        t = timed(["-c", CHECK.format(argv=["engram", *argv])], args.reps)
        t["vs_import_torch"] = t["wall_s"] / torch_s
        t["vs_python_pass"] = t["wall_s"] / base
        res["help"][name] = t
        print(f"{name:<34} {t['wall_s']:.3f} s wall, {t['cpu_s']:.3f} s CPU "
              f"({t['vs_import_torch']:.2f}x import torch; torch imported: "
              f"{'torch' in t.get('heavy_imports', [])})")
    res["demo"] = timed(["-m", "engram", "demo"], args.demo_reps)
    res["load_avg_end"] = os.getloadavg()[0]
    worst = max(res["help"].values(), key=lambda t: t["wall_s"])
    print(f"baselines: python -c pass {base:.3f} s, import torch {torch_s:.3f} s; slowest help "
          f"{worst['wall_s']:.3f} s ({worst['vs_import_torch']:.2f}x import torch); engram demo "
          f"{res['demo']['wall_s']:.2f} s wall, {res['demo']['cpu_s']:.2f} s CPU")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
