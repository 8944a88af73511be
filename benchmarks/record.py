"""What the benchmarks share: writing results (the JSON file, its folder made first), the process
settings compare's workers run with, and the small model of every ``--smoke`` run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# --smoke: a model and corpus small enough for CI (the code paths, not the figures)
SMOKE = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
             n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,))


def write_json(path: str | Path, results: Any, indent: int = 2) -> None:
    """``results`` as JSON at ``path``, its folders made as needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent))


def with_allocator_env() -> None:
    """Run under compare's workers' allocator settings (engram.training.train.ALLOCATOR_ENV: freed
    memory kept). glibc reads them at start-up only, so without them the script starts again."""
    from engram.training.train import ALLOCATOR_ENV

    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})


def run_child(code: str, args: list[str], src: Path | None = None) -> dict[str, Any]:
    """Run the Python snippet ``code`` with ``args`` in a fresh process, ``src`` (default this
    checkout's src/) first on its PYTHONPATH; its last line of output, as JSON."""
    import subprocess

    src = src or Path(__file__).resolve().parent.parent / "src"
    path = os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                       check=False)
    if p.returncode != 0:
        raise SystemExit(f"{args} with {src} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def open_summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over fresh-process opens ("open_s", "peak_kb", "rss_before_kb" each): the time,
    the peak resident memory and the peak above the process just before opening, in MB."""
    import statistics

    return {"open_s": statistics.median(x["open_s"] for x in runs),
            "peak_mb": statistics.median(x["peak_kb"] for x in runs) / 1024,
            "peak_over_start_mb": statistics.median((x["peak_kb"] - x["rss_before_kb"]) / 1024
                                                    for x in runs)}


def open_line(name: str, s: dict[str, float]) -> str:
    """One line of ``open_summary``'s figures."""
    return (f"{name}: open {s['open_s'] * 1e3:.0f} ms, peak RSS {s['peak_mb']:.0f} MB "
            f"({s['peak_over_start_mb']:.0f} MB above the process before opening)")
