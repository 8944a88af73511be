"""Could a command-line library replace engram/commandline/options.py + schema.py? `--help` of the same
tiny CLI (TrainConfig's options) built with ours, tyro, jsonargparse and simple-parsing.

    pip install tyro jsonargparse simple-parsing   # a throwaway venv (--system-site-packages) does
    python benchmarks/cli_libraries.py [--reps 10] [--json benchmarks/results/cli_libraries.json]

Each CLI is the library's shortest way to a command line for a dataclass (``tyro.cli(C)``,
``jsonargparse.auto_cli(C)``, ``simple_parsing.parse(C, add_config_path_arg=True)``; ours:
``add_config(parser, "module:C", 0)``), run as ``CLI --help`` in a fresh interpreter. Each runs on
two configs: the real ``engram.training.train:TrainConfig`` (its module imports torch, as do most of
our configs' modules), and a copy of it written from its source (same fields, types, defaults,
comments) in a module that imports nothing: what the library itself costs if every config moved to
a torch-free module of its own. Per CLI: min and median wall seconds (and median CPU seconds) over
``reps`` fresh processes, the runs interleaved, whether torch was imported, and whether --help shows
the fields' comments (TrainConfig.seed's "model init and batch order"); ratios against ours on the
same config (the median over reps of each run over ours' run beside it, wall and CPU) and against
``python -c "import torch"``, measured the same way in the same run. A library that is not
installed is skipped and said so in the JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_json  # noqa: E402

REAL = "engram.training.train"
COPY = "cli_copy"  # the torch-free copy's module (written to a temporary folder)
SHOWN = "model init and batch order"  # TrainConfig.seed's comment: does --help show comments?

# Each CLI, for the config class TrainConfig of module {module}.
CLIS = {
    "ours": ("torch-engram", "from engram.commandline.options import add_config, new_parser\n"
             "p = new_parser('train', 'train')\nadd_config(p, '{module}:TrainConfig', 0)\n"
             "p.parse_args()\n"),
    "tyro": ("tyro", "import tyro\nfrom {module} import TrainConfig\ntyro.cli(TrainConfig)\n"),
    "jsonargparse": ("jsonargparse", "from jsonargparse import auto_cli\n"
                     "from {module} import TrainConfig\nauto_cli(TrainConfig)\n"),
    "simple-parsing": ("simple-parsing", "import simple_parsing\nfrom {module} import TrainConfig\n"
                       "simple_parsing.parse(TrainConfig, add_config_path_arg=True)\n"),
}
# Runs a CLI script as __main__ with --help, then says which heavy modules it imported.
CHECK = ("import sys, runpy\nsys.argv = [{path!r}, '--help']\ntry:\n    runpy.run_path({path!r}, "
         "run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
         "print('HEAVY', code, sorted(m for m in ('torch', 'numpy') if m in sys.modules), "
         "file=sys.stderr)\n")


def torch_free_copy() -> str:
    """TrainConfig's source with nothing imported: its fields, types, defaults and comments (read
    by engram.commandline.schema, as --help reads them)."""
    from engram.commandline.schema import fields_of

    lines = ["from dataclasses import dataclass, field", "", "", "@dataclass", "class TrainConfig:",
             '    """Train one LM."""']
    for f in fields_of(f"{REAL}:TrainConfig"):
        default = "" if f.required else f" = {f.default!r}"
        if f.choices and not f.required:
            default = f" = field(default={f.default!r}, metadata={{'choices': {f.choices!r}}})"
        lines.append(f"    {f.name}: {f.type}{default}" + (f"  # {f.comment}" if f.comment else ""))
    return "\n".join(lines) + "\n"


def run_once(argv: list[str], env: dict) -> tuple[float, float, str, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, r.stdout, r.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="fresh processes per figure")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "cli_libraries.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="one process per figure (CI: checks the script runs; figures meaningless)")
    args = ap.parse_args()
    reps = 1 if args.smoke else args.reps

    res: dict = {"cores": os.cpu_count(), "python": platform.python_version(),
                 "load_avg_start": os.getloadavg()[0], "reps": reps, "versions": {}, "skipped": {}}
    tmp = Path(tempfile.mkdtemp(prefix="cli_libraries_"))
    (tmp / f"{COPY}.py").write_text(torch_free_copy())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp)])}
    jobs = {"python -c pass": [sys.executable, "-c", "pass"],
            "import torch": [sys.executable, "-c", "import torch"]}
    for name, (dist, code) in CLIS.items():
        if name != "ours":
            try:
                res["versions"][name] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                res["skipped"][name] = f"not installed (pip install {dist})"
                continue
        for config, module in (("real", REAL), ("torch-free copy", COPY)):
            path = tmp / f"{name}_{config.split()[0]}.py"
            path.write_text(code.format(module=module))
            jobs[f"{name} / {config}"] = [sys.executable, "-c", CHECK.format(path=str(path))]

    runs: dict[str, list] = {k: [] for k in jobs}
    for _ in range(reps):  # interleaved: a drift in the machine's speed touches every CLI alike
        for k, argv in jobs.items():
            runs[k].append(run_once(argv, env))
    res["timings"] = {}
    for k, rs in runs.items():
        walls = [r[0] for r in rs]
        t = {"wall_min_s": min(walls), "wall_median_s": statistics.median(walls),
             "cpu_median_s": statistics.median(r[1] for r in rs)}
        heavy = [x for x in rs[-1][3].splitlines() if x.startswith("HEAVY ")]
        if heavy:
            _, code, mods = heavy[-1].split(" ", 2)
            t["help_exit"] = int(code) if code.isdigit() else code
            t["imports_torch"] = "torch" in json.loads(mods.replace("'", '"'))
            t["help_shows_comments"] = SHOWN in " ".join(rs[-1][2].split())
            t["help_lines"] = len(rs[-1][2].splitlines())
            if t["help_exit"] != 0:
                t["error"] = rs[-1][3].strip().splitlines()[-2:]
        res["timings"][k] = t
    torch_s = res["timings"]["import torch"]["wall_median_s"]
    for k, t in res["timings"].items():
        t["vs_import_torch"] = t["wall_median_s"] / torch_s
        if " / " in k:  # ratio of each rep's run to ours of the same rep, which ran beside it
            ours = runs["ours / " + k.split(" / ")[1]]
            t["vs_ours_wall"] = statistics.median(a[0] / b[0] for a, b in zip(runs[k], ours))
            t["vs_ours_cpu"] = statistics.median(a[1] / b[1] for a, b in zip(runs[k], ours))
        print(f"{k:<34} wall min {t['wall_min_s']:.3f} s, median {t['wall_median_s']:.3f} s; CPU "
              f"median {t['cpu_median_s']:.3f} s ({t.get('vs_ours_wall', 0):.2f}x ours wall, "
              f"{t.get('vs_ours_cpu', 0):.2f}x CPU; {t['vs_import_torch']:.2f}x import torch)"
              + (f"; torch imported: {t['imports_torch']}; comments in --help: "
                 f"{t['help_shows_comments']}" if "imports_torch" in t else "")
              + (f"; --help FAILED: {t['error']}" if "error" in t else ""))
    for name, why in res["skipped"].items():
        print(f"{name}: skipped, {why}")
    res["load_avg_end"] = os.getloadavg()[0]
    shutil.rmtree(tmp)
    from engram.compute import machine  # imports torch: after the timings

    res["cpu"] = machine.cpu_id()
    write_json(args.json, res, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
