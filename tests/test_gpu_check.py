"""benchmarks/gpu_check.py without a GPU: it parses its options and fails clearly, writing JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole check")
def test_without_cuda_exits_2_and_says_so(tmp_path):
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no CUDA" in p.stderr
    res = json.loads(out.read_text())
    assert res["cuda"] is False and res["steps"] == {} and "no CUDA" in res["error"]


def test_bad_options_are_refused(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "x.json"),
                        "--only", "module,warp_drive"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown steps ['warp_drive']" in p.stderr
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--json" in p.stderr


def _run_on_cpu(tmp_path, steps: str) -> dict:
    out = tmp_path / "cpu.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--quick", "--device",
                        "cpu", "--only", steps], capture_output=True, text=True, timeout=900)
    res = json.loads(out.read_text())
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert res["ok"] and set(res["steps"]) == set(steps.split(","))
    return res


def test_steps_run_on_cpu(tmp_path):
    """The script's own logic (hashing equality, tiers vs in-memory, sharded skip) without a GPU."""
    res = _run_on_cpu(tmp_path, "hashing,tiers,sharded")
    assert res["steps"]["hashing"]["demo-v1"]["equal"]
    assert "skipped" in res["steps"]["sharded"]


@pytest.mark.slow
def test_module_and_train_steps_run_on_cpu(tmp_path):
    res = _run_on_cpu(tmp_path, "module,train")
    assert res["steps"]["module"]["float32"]["rel_err_y"] < 1e-5
    assert res["steps"]["train"]["engram"]["last_loss"] < res["steps"]["train"]["engram"]["first_loss"]
