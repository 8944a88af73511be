"""benchmarks/gpu_check.py and gpu_check.sh without a GPU: options, the no-CUDA exit, the steps'
logic on the CPU, per-step time limits, and the device script's install path."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _check(*args, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole check")
def test_without_cuda_exits_2_and_says_so(tmp_path):
    out = tmp_path / "gpu.json"
    p = _check("--json", out, "--quick")
    assert p.returncode == 2
    assert "no CUDA" in p.stderr
    res = json.loads(out.read_text())
    assert res["cuda"] is False and res["steps"] == {} and "no CUDA" in res["error"]


def test_bad_options_are_refused(tmp_path):
    p = _check("--json", tmp_path / "x.json", "--only", "module,warp_drive")
    assert p.returncode == 2 and "unknown steps ['warp_drive']" in p.stderr
    p = _check()
    assert p.returncode == 2 and "--json" in p.stderr


def _run_on_cpu(tmp_path, steps: str, *extra) -> dict:
    out = tmp_path / "cpu.json"
    p = _check("--json", out, "--quick", "--device", "cpu", "--only", steps, *extra, timeout=900)
    res = json.loads(out.read_text())
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert res["ok"] and set(res["steps"]) == set(steps.split(","))
    return res


def test_steps_run_on_cpu(tmp_path):
    """The script's own logic (hashing equality, tiers vs in-memory, sharded skip) without a GPU."""
    res = _run_on_cpu(tmp_path, "hashing,tiers,sharded")
    assert res["steps"]["hashing"]["demo-v1"]["equal"]
    assert "skipped" in res["steps"]["sharded"]
    assert res["steps"]["tiers"]["prefetch_stats"]["prefetch_cached"]["used"] > 0
    env = res["environment"]
    assert env["torch"] == torch.__version__ and env["cpu_count"] >= 1
    assert env["code"]["from"] in ("git", ".whl/COMMIT.json") or env["code"]["commit"] is None


def test_isolated_steps_record_results_timeouts_and_the_budget(tmp_path):
    res = _run_on_cpu(tmp_path, "sharded", "--isolate")
    assert "skipped" in res["steps"]["sharded"] and "environment" in res
    out = tmp_path / "limits.json"
    t0 = time.perf_counter()
    # importing torch alone takes longer than a second: the step is killed, the next never starts
    p = _check("--json", out, "--quick", "--device", "cpu", "--only", "train,hashing", "--isolate",
               "--step-limit", 1, "--budget", 1.5)
    assert p.returncode == 1 and time.perf_counter() - t0 < 60
    steps = json.loads(out.read_text())["steps"]
    assert not steps["train"]["ok"] and "timed out after 1 s" in steps["train"]["error"]
    assert not steps["hashing"]["ok"] and "of the budget left" in steps["hashing"]["error"]
    table = _check("--summary", out).stdout
    assert "train      FAILED" in table and "timed out" in table and "overall: FAILED" in table


def test_sigterm_kills_the_running_step_and_keeps_the_results(tmp_path):
    """The shell's outer timeout sends SIGTERM: the step's process group dies with the parent,
    and the JSON says where it stopped."""
    out = tmp_path / "term.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--json", str(out), "--quick", "--device",
                          "cpu", "--only", "sharded,train", "--isolate"], stdout=subprocess.PIPE,
                         text=True)
    assert "sharded: ok" in p.stdout.readline()  # the first step is done: train is running
    time.sleep(1)
    p.terminate()
    assert p.wait(timeout=30) == 1
    res = json.loads(out.read_text())
    assert res["steps"]["sharded"]["ok"] and "stopped by SIGTERM during train" in res["error"]


def _wheel(path: Path, name: str) -> Path:
    """A minimal pure wheel holding one empty package ``name``."""
    whl = path / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
             "Version: 0.1\n", f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
             "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return whl


@pytest.mark.parametrize("with_wheel", [False, True])
def test_device_script_installs_the_wheels_logs_and_summarises(tmp_path, with_wheel):
    """gpu_check.sh as the device runs it, from a copy of the tree whose .whl/ is empty or holds a
    wheel: the wheel lands in SITE, our code comes from src/, the log and the JSON reach OUT."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    for f in ("gpu_check.sh", "gpu_check.py", "gpu_steps.py"):
        shutil.copy(ROOT / "benchmarks" / f, tree / "benchmarks" / f)
    (tree / "src").symlink_to(ROOT / "src")
    (tree / ".whl").mkdir()
    if with_wheel:
        _wheel(tree / ".whl", "engram_fake_wheel")
    out, site = tmp_path / "out", tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "SITE": str(site),
           "ENGRAM_CACHE": str(tmp_path / "cache")}
    p = subprocess.run(["bash", str(tree / "benchmarks" / "gpu_check.sh"), "--device", "cpu",
                        "--quick", "--only", "sharded"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    assert log == p.stdout and "overall: ok" in log and "exit status 0" in log
    assert str(tree / "src" / "engram" / "__init__.py") in log  # not an installed copy
    assert ("no wheels in .whl/" in log) != with_wheel
    assert (site / "engram_fake_wheel" / "__init__.py").exists() == with_wheel
    assert json.loads((out / "check.json").read_text())["ok"]


@pytest.mark.slow
def test_module_and_train_steps_run_on_cpu(tmp_path):
    res = _run_on_cpu(tmp_path, "module,train,cuda_tests")
    assert res["steps"]["module"]["float32"]["rel_err_y"] < 1e-5
    assert res["steps"]["module"]["float32"]["rel_err_grad_max"] < 1e-4
    train = res["steps"]["train"]
    assert all(train[v]["last_loss"] < train[v]["first_loss"] for v in ("dense", "engram", "moe"))
    assert train["engram"]["row_adam_kernel_steps"] > 0  # on the CPU the kernels run
    assert res["steps"]["cuda_tests"]["tests"] > 30


@pytest.mark.slow
def test_precision_and_ddp_steps_run_on_cpu(tmp_path):
    """The new options' steps: bf16 and bf16 + compile against fp32, and `engram train` under
    torchrun (2 ranks over gloo on the CPU)."""
    res = _run_on_cpu(tmp_path, "precision,ddp")
    prec = res["steps"]["precision"]
    assert prec["bf16_val_gap"] < 0.05 and prec["bf16_compiled_val_gap"] < 0.05
    assert all(prec[v]["last_loss"] < prec[v]["first_loss"] for v in ("fp32", "bf16"))
    ddp = res["steps"]["ddp"]
    assert ddp["world"] == 2 and ddp["backend"] == "gloo"
