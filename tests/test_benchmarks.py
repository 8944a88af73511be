"""Every benchmark in benchmarks/ runs, at a tiny size, so one that stops importing (or whose API
calls went stale) fails here rather than on the day someone reruns it (issue 25: offload.py and
offload_tiers.py had not imported for months, and nothing noticed).

The convention (benchmarks/README.md): a benchmark script takes ``--smoke`` (tiny sizes, seconds,
figures meaningless) and ``--json PATH`` (where its results go). Scripts are found by glob, so a new
one is covered the day it lands; a file without ``if __name__ == "__main__"`` is a helper and is
imported instead. Shell scripts are syntax-checked; their dry runs live in the tests named in
ELSEWHERE. Everything runs in a temporary folder (TMPDIR), one process per benchmark, in about
1.5 minutes of CPU time altogether.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
# Run (on the CPU) by their own tests, not with --smoke here.
ELSEWHERE = {"gpu_check.py": "tests/test_gpu_check.py", "gpu_check.sh": "tests/test_gpu_check.py",
             "vllm_run.py": "tests/serving/test_vllm.py"}  # a tool that needs vLLM's venv
TIMEOUT_S = 240  # one benchmark's smoke run: seconds of CPU, more wall time on a loaded machine


def _is_script(path: Path) -> bool:
    return 'if __name__ == "__main__"' in path.read_text()


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if _is_script(p) and p.name not in ELSEWHERE)
HELPERS = sorted(p.name for p in BENCH.glob("*.py") if not _is_script(p))
SHELL = sorted(p.name for p in BENCH.glob("*.sh"))


def _runs(name: str, tmp_path: Path) -> list[str]:
    """``--runs`` in the test's folder for a script that reads finished runs back from one (its
    default, a fixed folder under /tmp, outlives the test): a run there left by another version of
    the code ("holds a finished run of another configuration") or by another torch is not read."""
    return ["--runs", str(tmp_path / "runs")] if '"--runs"' in (BENCH / name).read_text() else []


def _env(tmp_path: Path) -> dict[str, str]:
    path = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}


def test_benchmarks_are_found():
    assert {"train.py", "offload.py", "offload_tiers.py", "side_by_side.py"} <= set(SCRIPTS + HELPERS)
    assert "offload_tiers.py" in HELPERS and "gpu_steps.py" in HELPERS
    assert _runs("table_optimizer.py", ROOT) and _runs("dense_noise.py", ROOT)
    for name, test in ELSEWHERE.items():
        assert (BENCH / name).exists() and (ROOT / test).exists(), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_smoke(name, tmp_path):
    out = tmp_path / "result.json"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(BENCH / name), "--smoke", "--json", str(out),
                        *_runs(name, tmp_path)],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    took = time.perf_counter() - t0
    tail = (p.stdout[-1500:] + "\n" + p.stderr[-3000:]).strip()
    assert p.returncode == 0, (f"benchmarks/{name} --smoke --json PATH failed (exit {p.returncode}; "
                               f"every benchmark takes both, benchmarks/README.md):\n{tail}")
    assert out.exists(), f"benchmarks/{name} --smoke did not write its --json file"
    assert json.loads(out.read_text()), f"benchmarks/{name} wrote an empty result"
    print(f"{name}: {took:.1f} s")


@pytest.mark.parametrize("name", HELPERS)
def test_benchmark_helper_imports(name, tmp_path):
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import {Path(name).stem}"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"benchmarks/{name} does not import:\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("name", SHELL)
def test_benchmark_shell_script_parses(name):
    p = subprocess.run(["bash", "-n", str(BENCH / name)], capture_output=True, text=True)
    assert p.returncode == 0, f"benchmarks/{name}: {p.stderr}"
