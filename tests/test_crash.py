"""Crash consistency, the way SQLite tests its journal (issue 35): ``train``, ``prepare`` and
``export-hf`` are stopped at every point where they publish bytes, and every folder left behind
must then either resume to the uninterrupted run's final state or be refused in one line.

A point is a call that writes bytes under the output folder: a write(2)-family call or fsync on a
regular file there, or a rename into a folder there (tests/faults/shim.c, preloaded with
LD_PRELOAD: Python, numpy and safetensors' Rust all go through those libc calls). At point k the
command is either SIGKILLed (``kill``: a power cut as a process sees it) or the disk fills
(``enospc``: that call and every later one fail with ENOSPC; the command must end in one line,
exit 1). Then the same command runs again with the disk back, and its folder must equal the
uninterrupted run's: the newest checkpoint's tensors and every logged loss (train), every shard
file byte for byte (prepare), every file byte for byte (export-hf) -- or it refuses in one line.

The default run tries one point per command (the reference and the rerun in this process); the
slow run tries every point, killed and with the disk full, and with
``ENGRAM_CRASH_JSON=benchmarks/results/crash.json``, records the counts there (each command's as it
ends; ``ENGRAM_CRASH_COMMANDS=train`` and ``=prepare,export-hf`` split it over two processes):

    ENGRAM_CRASH_JSON=benchmarks/results/crash.json python -m pytest -m slow tests/test_crash.py

Linux with a C compiler only (skipped elsewhere).
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engram

SHIM = Path(__file__).parent / "faults" / "shim.c"
SRC = Path(engram.__file__).parents[1]
TINY = ["--n_layer=2", "--d_model=32", "--n_head=2", "--seq_len=32", "--batch_size=2",
        "--table_size=500", "--max_chars=20000", "--eval_every=2", "--eval_batches=1",
        "--warmup=1", "--log_every=1", "--threads=1"]
TIMEOUT = 600  # one command, on a loaded machine


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if sys.platform != "linux" or cc is None:
        pytest.skip("the fault injector needs Linux and a C compiler")
    out = tmp_path_factory.mktemp("shim") / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"], check=True)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A trained tiny run (export-hf's input) and a few text files (prepare's)."""
    root = Path(os.path.realpath(tmp_path_factory.mktemp("crash_inputs")))
    code, err = _main(["train", f"--out_dir={root / 'run'}", "--steps=2", "--ckpt_every=2", *TINY])
    assert code == 0, err[-2000:]
    (root / "text").mkdir()
    for p in sorted((SRC / "engram" / "training").glob("*.py"))[:6]:  # ~70 KB of real text
        shutil.copyfile(p, root / "text" / (p.stem + ".txt"))
    return root


# command -> (argv with {w} for the work folder and {i} for the inputs, the output under {w})
COMMANDS = {
    "train": (["train", "--out_dir={w}/run", "--steps=4", "--ckpt_every=2", *TINY], "run"),
    "prepare": (["prepare", "--input={i}/text", "--out={w}/corpus", "--shard_mb=0.03",
                 "--workers=0"], "corpus"),
    "export-hf": (["export-hf", "{i}/run", "{w}/export"], "export"),
}


def _engram(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engram", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "PYTHONPATH": str(SRC),
                                                **(env or {})})


def _main(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``engram ARGV`` run in this process: no second import of torch."""
    import contextlib
    import io

    from engram.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _argv(name: str, work: Path, inputs: Path) -> list[str]:
    return [a.format(w=work, i=inputs) for a in COMMANDS[name][0]]


def state(name: str, out: Path) -> dict:
    """What must come out the same after any crash and a rerun: the folder's content less what
    is timing (a run's tok/s, a corpus's seconds) or the writer's lock."""
    if name == "train":
        from safetensors.torch import load_file

        latest = json.loads((out / "checkpoints" / "latest.json").read_text())
        tensors = load_file(out / "checkpoints" / latest["file"])
        losses = [(r["step"], r["loss"], r.get("val_loss"))
                  for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
        return {"step": latest["step"], "losses": losses,  # and no file left over:
                "files": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                if p.name != ".engram.lock"),
                "tensors": {k: hashlib.sha256(v.numpy().tobytes()).hexdigest()
                            for k, v in tensors.items()}}
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != ".engram.lock":
            data = p.read_bytes()
            if p.name == "manifest.json":  # prepare's: its summary holds the seconds taken
                m = json.loads(data)
                m.pop("summary")
                data = json.dumps(m).encode()
            files[str(p.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return files


def _one_line(err: str) -> str:
    lines = [ln for ln in err.replace("\r", "\n").splitlines()
             if ln.strip() and not ln.lstrip().startswith(("prepare:", "r:", "run:"))
             and "it/s" not in ln and "B/s" not in ln and "s/it" not in ln]
    assert "Traceback" not in err, err[-3000:]
    return lines[-1] if lines else ""


def reference(name: str, shim: Path | None, inputs: Path, tmp: Path) -> tuple[int, dict]:
    """(points the uninterrupted command passes, its final state); without ``shim``, in this
    process and the points uncounted (0)."""
    work = Path(os.path.realpath(tmp / f"{name}-ref"))
    work.mkdir()
    if shim is None:
        code, err = _main(_argv(name, work, inputs))
        assert code == 0, err[-3000:]
        return 0, state(name, work / COMMANDS[name][1])
    count = tmp / f"{name}.count"
    r = _engram(_argv(name, work, inputs), {"LD_PRELOAD": str(shim), "FAULT_DIR": str(work),
                                             "FAULT_COUNT": str(count)})
    assert r.returncode == 0, r.stderr[-3000:]
    return int(count.read_text()), state(name, work / COMMANDS[name][1])


def crash(name: str, action: str, k: int, shim: Path, inputs: Path, tmp: Path,
          want: dict, here: bool = False) -> str:
    """Stop ``name`` at point ``k`` by ``action``, rerun it (``here``: in this process); "resumed"
    or "refused" (one line). Anything else fails the test."""
    work = Path(os.path.realpath(tmp / f"{name}-{action}-{k}"))
    work.mkdir()
    argv = _argv(name, work, inputs)
    r = _engram(argv, {"LD_PRELOAD": str(shim), "FAULT_DIR": str(work), "FAULT_AT": str(k),
                       "FAULT_ACTION": action})
    if action == "kill":
        assert r.returncode == -9, (k, r.returncode, r.stderr[-3000:])
    else:
        assert r.returncode == 1, (k, r.returncode, r.stderr[-3000:])
        line = _one_line(r.stderr)
        assert line.startswith(f"engram {name}: error: no space left on device writing {work}"), \
            (k, line)
    if here:
        code, err = _main(argv)
    else:
        again = _engram(argv)
        code, err = again.returncode, again.stderr
    if code == 2:
        assert _one_line(err).startswith(f"engram {name}: error: ")
        return "refused"
    assert code == 0, (k, err[-3000:])
    got = state(name, work / COMMANDS[name][1])
    assert got == want, (name, action, k)
    shutil.rmtree(work)
    return "resumed"


# The default run's points: one per command, inside its publishing (train: the second checkpoint's
# file; prepare: a middle shard; export-hf: a table file), by kill or a full disk.
POINTS = [("train", "kill", 14), ("prepare", "enospc", 30), ("export-hf", "kill", 12)]


@pytest.mark.parametrize("name,action,k", POINTS)
def test_a_crash_or_a_full_disk_resumes_or_refuses(name, action, k, shim, inputs, tmp_path):
    _, want = reference(name, None, inputs, tmp_path)
    assert crash(name, action, k, shim, inputs, tmp_path, want, here=True) in ("resumed",
                                                                               "refused")


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.machine()
    info = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    flags = info.get("Flags", "")
    return (f"{info.get('Model name', '?').strip()} (family {info.get('CPU family', '?').strip()}"
            f" model {info.get('Model', '?').strip()}), {info.get('CPU(s)', '?').strip()} CPUs, "
            f"{'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}")


SWEEP = 36  # points tried per command and action in the slow run: every one, or this many spread


@pytest.mark.slow
def test_every_point_of_every_command(shim, inputs, tmp_path):
    """Every point of train, prepare and export-hf (at most SWEEP, spread evenly from the first to
    the last), killed and with the disk full there."""
    record = {"what": "tests/test_crash.py: each command stopped at every point where it publishes "
              "bytes (write, fsync, rename under its output folder; all of them, or SWEEP spread "
              "evenly), by SIGKILL and by a full disk (ENOSPC from that call on), then run again; "
              "'resumed': the rerun's folder equals the uninterrupted run's (train: tensors and "
              "losses; prepare, export-hf: every file's bytes), 'refused': one line, exit 2",
              "rerun": "ENGRAM_CRASH_JSON=benchmarks/results/crash.json python -m pytest -m slow "
              "tests/test_crash.py", "cpu": _cpu(), "commands": {}}
    names = os.environ.get("ENGRAM_CRASH_COMMANDS", ",".join(COMMANDS)).split(",")
    path = os.environ.get("ENGRAM_CRASH_JSON")
    for name in names:
        t1 = time.time()
        n, want = reference(name, shim, inputs, tmp_path)
        row = {"points": n}
        points = sorted({1 + round(i * (n - 1) / (SWEEP - 1)) for i in range(SWEEP)})
        row["tried"] = len(points)
        for action in ("kill", "enospc"):
            outcomes = [crash(name, action, k, shim, inputs, tmp_path, want, here=True)
                        for k in points]
            row[action] = {o: outcomes.count(o) for o in ("resumed", "refused")}
        row["wall_s"] = round(time.time() - t1, 1)
        if path:  # after each command: merged with what is there (commands split over processes)
            old = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
            record["commands"] = {**old.get("commands", {}), name: row}
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(record, indent=2) + "\n")
