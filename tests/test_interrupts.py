"""Ctrl-C and SIGTERM in every long command (issue 35), one table, beside tests/test_faults.py.

Each row starts the real command (``python -m engram``, tiny sizes, made long the honest way: a
longer text, a bigger table, more steps), waits until its work is demonstrably under way (a line it
prints, or a file it publishes; never a fixed sleep), sends the signal and checks: exit status 130
(SIGTERM takes Ctrl-C's path, engram/cli), a stop within a bound a loaded 2-core machine keeps (the
goal is about a second: benchmarks record it, ``ENGRAM_INTERRUPTS_JSON``), one last line saying
what was kept, no traceback, no temporary or writer lock left and the files there before intact;
then, where the command resumes, the same command finishes to what an uninterrupted run gives.

Seconds from signal to exit on this machine, per row, are recorded with
``ENGRAM_INTERRUPTS_JSON=benchmarks/results/interrupts.json python -m pytest -m "slow or not slow"
tests/test_interrupts.py``.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import engram
from engram.cli import main
from engram.files import is_temporary
from engram.outputs import LOCK

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(engram.__file__).parents[1]
TASKS = Path(__file__).parent / "data" / "lm_eval"
TINY = ["--n_layer=2", "--d_model=32", "--n_head=2", "--seq_len=32", "--batch_size=2",
        "--table_size=500", "--max_chars=20000", "--eval_every=2", "--eval_batches=1",
        "--warmup=1", "--log_every=1", "--threads=1"]
# A study's runs (each a worker process): tiny, and enough steps that one is caught in progress.
STUDY = ["--n_layer=2", "--d_model=32", "--n_head=2", "--table_size=997",
         "--n_embed_per_ngram=32", "--n_head_per_ngram=2", "--engram_layers=0",
         "--max_chars=30000", "--steps=40", "--batch_size=2", "--seq_len=16", "--eval_every=20",
         "--eval_batches=1", "--workers=1"]
LIMIT_S = 15  # not a speed check (benchmarks' job): a bound a loaded machine keeps
TIMES: dict[str, float] = {}  # row id -> seconds from signal to exit, for ENGRAM_INTERRUPTS_JSON


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/: run (tiny, 2 steps, a checkpoint), big (2048 positions, 200K-row tables: long
    generations, windows and files), text/ (two ~0.75 MB files of this package's sources),
    export/ (big's export, uninterrupted), v41/ (a DeepSeek-V4.1 checkpoint, ~150 MB)."""
    root = tmp_path_factory.mktemp("interrupts")
    assert main(["train", f"--out_dir={root / 'run'}", "--steps=2", "--ckpt_every=2", *TINY]) == 0
    assert main(["train", f"--out_dir={root / 'big'}", "--steps=1", "--n_layer=2", "--d_model=32",
                 "--n_head=2", "--seq_len=2048", "--batch_size=1", "--table_size=200000",
                 "--max_chars=400000", "--eval_every=1", "--eval_batches=1", "--warmup=1",
                 "--threads=1"]) == 0
    text = root / "text"
    text.mkdir()
    sources = "".join(p.read_text() for p in sorted((SRC / "engram").rglob("*.py")))
    for i in range(2):
        (text / f"{i}.txt").write_text(f"# copy {i}\n" + sources[: 3 << 18])
    return root


@pytest.fixture(scope="module")
def export(tree):
    out = tree / "export"
    if not out.exists():
        assert main(["export-hf", str(tree / "big"), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def v41(tree):
    from v41_ckpt import make_checkpoint

    src = tree / "v41"
    if not src.exists():
        make_checkpoint(src, vocab_size=600_000)
        assert main(["import-v41", str(src), str(tree / "v41-layers")]) == 0
    return src


@pytest.fixture(scope="module")
def lm_tasks(tree):
    """engram_docs over ~200 documents of real text (tests/data/lm_eval's task, more rows)."""
    folder = tree / "tasks"
    if not folder.exists():
        folder.mkdir()
        (folder / "engram_docs.yaml").write_text((TASKS / "engram_docs.yaml").read_text())
        text = (tree / "text" / "0.txt").read_text()
        with open(folder / "docs.jsonl", "w") as f:
            for i in range(200):
                f.write(json.dumps({"text": text[i * 3000:(i + 1) * 3000]}) + "\n")
    return folder


@pytest.fixture(scope="module")
def hf(tree, tok):
    """root/hf/model (a tiny random Llama and a real BPE tokenizer), root/hf/corpus (KJV text
    prepared with it), as tests/training/test_memory_finetune.py makes them."""
    from hf_models import tiny_model

    from engram.training.corpus import load_documents

    root = tree / "hf"
    if not root.exists():
        tiny_model("llama", len(tok)).save_pretrained(root / "model")
        tok.save_pretrained(root / "model")
        (root / "text").mkdir()
        docs = [d.text for d in load_documents("kjv", max_chars=40_000)][:40]
        for i, d in enumerate(docs):
            (root / "text" / f"{i}.txt").write_text(d)
        assert main(["prepare", f"--input={root / 'text'}", f"--tokenizer={root / 'model'}",
                     f"--out={root / 'corpus'}", "--workers=0", "--val_fraction=0.2"]) == 0
    return root


# -- running a command and stopping it --------------------------------------------------------------

@dataclass
class Stopped:
    code: int
    seconds: float  # from the signal to the exit
    text: str  # stdout and stderr, as they came


def ctrl_c_heard() -> None:
    """In the child before it starts: SIGINT's default action, as a terminal's foreground command
    has. A suite started in the background of a shell without job control (`pytest &`, nohup)
    hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt: those
    commands rightly keep running, and a Ctrl-C test would measure the shell, not engram."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(args: list[str], working: Callable[[str], bool], sig: int = signal.SIGINT,
              cwd: Path | None = None, env: dict[str, str] | None = None) -> Stopped:
    """Start ``engram ARGS``, wait until ``working(output so far)`` holds, send ``sig``."""
    p = subprocess.Popen([sys.executable, "-m", "engram", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})},
                         preexec_fn=ctrl_c_heard)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: p.stdout.read(1), "")),
                              daemon=True)
    reader.start()
    t0 = time.monotonic()
    try:
        while not working("".join(out)):  # its work is under way (a line, a file)
            assert p.poll() is None, f"it ended ({p.returncode}) before: " + "".join(out)[-3000:]
            assert time.monotonic() - t0 < 600, "it never started: " + "".join(out)[-3000:]
            time.sleep(0.02)
        t_sig = time.monotonic()
        p.send_signal(sig)
        code = p.wait(timeout=300)
        seconds = time.monotonic() - t_sig
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=60)
    return Stopped(code, seconds, "".join(out))


def said(line: str) -> Callable[[str], bool]:
    return lambda text: line in text


def appears(path: Path) -> Callable[[str], bool]:
    return lambda text: path.exists()


def left_behind(folder: Path) -> list[Path]:
    """Temporaries and writer locks under ``folder`` (none may outlive a command)."""
    return [p for p in folder.rglob("*") if is_temporary(p.name) or p.name.endswith(LOCK)
            or (p.name.startswith(".") and p.name.endswith(".tmp"))]


def files(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: (inode, bytes), by relative path."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def stats(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``folder``: (inode, size, mtime), by relative path."""
    return {str(p.relative_to(folder)): (s.st_ino, s.st_size, s.st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() for s in [p.stat()]}


def check_stopped(s: Stopped, command: str, kept: str, row: str) -> None:
    assert s.code == 130, s.text[-3000:]
    assert "Traceback" not in s.text, s.text[-3000:]
    lines = s.text.replace("\r", "\n").strip().splitlines()
    assert lines[-1].startswith(f"engram {command}: interrupted; ") and kept in lines[-1], lines[-1]
    assert sum("interrupted;" in line for line in lines) == 1, lines[-5:]
    TIMES[row] = round(s.seconds, 2)
    assert s.seconds < LIMIT_S, f"{s.seconds:.1f} s from the signal to the exit"


# -- the table ------------------------------------------------------------------------------------

NOTHING = "nothing was kept"
RUNS_KEPT = "runs finished and are kept"
PROMPT = "In the beginning God created the heaven and the earth. " * 200  # cut: a line on stderr


def _generate(tree, tmp):
    return (["generate", str(tree / "big"), "--prompt", PROMPT, "--max_new_tokens=2000",
             "--no-stop", "--threads=1", f"--json={tmp / 'gen.json'}"], said("keeping the last"))


def _eval(tree, tmp):
    return (["eval", str(tree / "big"), "--text", str(tree / "text" / "0.txt"),
             f"--json={tmp / 'eval.json'}"], said("eval windows:"))


def _analyze(tree, tmp):
    return (["analyze", str(tree / "big"), f"--out_dir={tmp / 'analysis'}"], said("analyze:"))


def _pool_budget(tree, tmp):
    return (["pool-budget", str(tree / "run"), f"--out_dir={tmp / 'budget'}",
             "--tiers=memory,file", "--reps=300", "--prefill_len=16", "--decode_context=8"],
            said("prefill: tiers:"))


def _export_hf(tree, tmp):
    return (["export-hf", str(tree / "big"), str(tmp / "export")],
            appears(tmp / "export" / "model.safetensors"))


def _import_v41(tree, tmp):
    return (["import-v41", str(tree / "v41"), str(tmp / "layers")], said("layer1.table:"))


def _export_v41(tree, tmp):
    return (["export-v41", str(tree / "v41-layers"), str(tmp / "ckpt")],  # OUT is staged beside
            lambda text: any(tmp.glob(".ckpt.*.tmp/model-00001-of-*")))  # it, shard by shard


def _prepare(tree, tmp):
    return (["prepare", f"--input={tree / 'text'}", f"--out={tmp / 'corpus'}", "--shard_mb=0.5"],
            appears(tmp / "corpus" / "shards"))


STEPS = 60  # train's row: long enough to be caught between steps 2 and 60


def _train(tree, tmp):
    import shutil

    shutil.copytree(tree / "run", tmp / "run")  # a run with a checkpoint at step 2
    return (["train", f"--out_dir={tmp / 'run'}", f"--steps={STEPS}", "--ckpt_every=50", *TINY],
            said("loss="))  # a step done (the progress bar's loss)


def _lm_eval(tree, tmp):
    return (["lm-eval", "--model_args", f"pretrained={tree / 'export'},tier=file", "--tasks",
             "engram_docs", "--include_path", str(tree / "tasks"), "--output_path",
             str(tmp / "res"), "--batch_size=4"], said("Running loglikelihood_rolling"))


def _finetune(tree, tmp):
    hf = tree / "hf"
    return (["finetune", str(hf / "model"), f"--data={hf / 'corpus'}", f"--out_dir={tmp / 'ft'}",
             "--layers=0,1", "--steps=40", "--seq_len=32", "--batch_size=2", "--table_size=101",
             "--n_embed_per_ngram=16", "--n_head_per_ngram=2", "--ckpt_every=20",
             "--eval_batches=1", "--log_every=1", "--threads=1"], said("loss="))


def _finetune_study(tree, tmp):
    hf, out = tree / "hf", tmp / "study"
    return (["finetune-study", f"--model={hf / 'model'}", f"--data={hf / 'corpus'}",
             f"--out_dir={out}", "--seeds=0,1", "--forget_sources=peoples-daily",
             "--max_chars=40000", "--steps=30", "--warmup=2", "--seq_len=32", "--batch_size=4",
             "--eval_windows=6", "--engram_layers=0,1", "--table_size=300",
             "--n_embed_per_ngram=16", "--n_head_per_ngram=2", "--log_every=4", "--threads=1"],
            lambda text: _methods(out / "seed0") == 2)  # seed 0 finished: seed 1 is caught


def _methods(seed: Path) -> int:
    """How many methods a finetune-study seed has finished (its results.json, published whole
    after each)."""
    try:
        return len(json.loads((seed / "results.json").read_text())["methods"])
    except (OSError, ValueError, KeyError):
        return 0


def _study(command, *extra, only_base=False):
    """A study's row; ``only_base``: its own options are ``extra``, STUDY gives the base model."""
    base = STUDY if not only_base else [a for a in STUDY if a.split("=")[0] in (
        "--n_layer", "--d_model", "--n_head", "--max_chars", "--workers")]

    def make(tree, tmp):
        out = tmp / "study"
        return ([command, f"--out_dir={out}", *base, *extra],
                lambda text: any(out.glob("runs/**/checkpoints/step_*.safetensors")))
    return make


# id -> (fixtures it needs, argv and readiness, what the last line says was kept, marks)
CASES = {
    "generate": (("tree",), _generate, NOTHING, ()),
    "eval": (("tree",), _eval, NOTHING, ()),
    "analyze": (("tree",), _analyze, NOTHING, ()),
    "pool-budget": (("tree",), _pool_budget, NOTHING, ()),
    "export-hf": (("tree",), _export_hf, "the files written whole so far are kept", ()),
    "import-v41": (("v41",), _import_v41, NOTHING, (pytest.mark.slow,)),
    "export-v41": (("v41",), _export_v41, NOTHING, (pytest.mark.slow,)),
    "prepare": (("tree",), _prepare, "the shards finished so far are kept", ()),
    "train": (("tree",), _train, "the same command resumes from it", ()),
    "lm-eval": (("export", "lm_tasks"), _lm_eval, NOTHING, (pytest.mark.slow,)),
    "sweep-slots": ((), _study("sweep-slots", "--table_sizes=500,997"), RUNS_KEPT,
                    (pytest.mark.slow,)),
    "sweep-allocation": ((), _study("sweep-allocation", "--rhos=0,1", "--n_routed_max=2"),
                         RUNS_KEPT, (pytest.mark.slow,)),
    "ablate": ((), _study("ablate", "--variants=gate1"), RUNS_KEPT, (pytest.mark.slow,)),
    "compare": ((), _study("compare"), RUNS_KEPT, (pytest.mark.slow,)),
    "study-nine": ((), _study("study-nine", "--seeds=0", "--steps=40", "--batch_size=4",
                              "--seq_len=32", "--eval_every=20", "--eval_batches=1",
                              "--total_rows=500", "--hot_rows=100", "--small_rows=300",
                              "--large_rows=800", "--ref_hot_rows=100", "--engram_layers=0,1",
                              "--n_embed_per_ngram=32", only_base=True), RUNS_KEPT,
                   (pytest.mark.slow,)),
    "finetune": (("hf",), _finetune, "the same command resumes from it", (pytest.mark.slow,)),
    "finetune-study": (("hf",), _finetune_study, "the seeds finished", (pytest.mark.slow,)),
}
SIGTERM_TOO = {"eval", "train", "export-hf", "sweep-slots", "generate"}  # SIGTERM: the same path
PARAMS = [pytest.param(name, sig, id=f"{name}:{sig.name}",
                       marks=CASES[name][3] if sig == signal.SIGINT else (pytest.mark.slow,))
          for name in CASES for sig in (signal.SIGINT, signal.SIGTERM)
          if sig == signal.SIGINT or name in SIGTERM_TOO]


@pytest.mark.parametrize("name,sig", PARAMS)
def test_a_long_command_stops_on_a_signal_in_one_line_and_the_rerun_finishes(
        request, tmp_path, name, sig):
    needs, make, kept, _ = CASES[name]
    tree = request.getfixturevalue("tree")
    for fixture in needs:
        request.getfixturevalue(fixture)
    args, working = make(tree, tmp_path)
    before = stats(tree)
    s = interrupt(args, working, sig, cwd=tree / "tasks" if name == "lm-eval" else None,
                  env={"HF_DATASETS_CACHE": str(tmp_path / "datasets"),
                       "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    check_stopped(s, args[0], kept, f"{name}:{sig.name}")
    assert not left_behind(tmp_path), left_behind(tmp_path)
    after = stats(tree)
    assert {k: v for k, v in after.items() if k in before} == before, "an input was changed"
    RERUN.get(name, lambda *a: None)(tree, tmp_path, args, request)


# -- the reruns -------------------------------------------------------------------------------------

def _rerun(args: list[str], cwd: Path | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "engram", *args], capture_output=True, text=True,
                       cwd=cwd, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


def _rerun_train(tree, tmp, args, request):
    """The step-2 checkpoint is as it was (the newest two are kept); the step reached was saved;
    the rerun resumes and ends where an uninterrupted run from step 2 ends, bit for bit."""
    import shutil

    from safetensors.torch import load_file

    ckpts = tmp / "run" / "checkpoints"
    assert (ckpts / "step_00000002.safetensors").read_bytes() == \
        (tree / "run" / "checkpoints" / "step_00000002.safetensors").read_bytes()
    step = json.loads((ckpts / "latest.json").read_text())["step"]
    assert 2 < step < STEPS, step  # the step reached was saved, and it did not finish
    _rerun(args)
    shutil.copytree(tree / "run", tmp / "whole")
    assert main(["train", f"--out_dir={tmp / 'whole'}", *args[2:]]) == 0
    last = f"step_{STEPS:08d}.safetensors"
    a, b = load_file(ckpts / last), load_file(tmp / "whole" / "checkpoints" / last)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _rerun_prepare(tree, tmp, args, request):
    assert not (tmp / "corpus" / "manifest.json").exists()  # unfinished: train --data refuses it
    _rerun(args)
    summary = json.loads((tmp / "corpus" / "manifest.json").read_text())["summary"]
    assert summary["shards_made"] + summary["shards_kept"] == summary["shards"] == 2
    whole = tmp / "whole"
    assert main(["prepare", f"--input={tree / 'text'}", f"--out={whole}", "--shard_mb=0.5"]) == 0
    got, want = files(tmp / "corpus"), files(whole)
    shards = [k for k in want if k.startswith("shards/")]
    assert shards and all(got[k][1] == want[k][1] for k in shards)


def _rerun_export_hf(tree, tmp, args, request):
    """The files published before the signal are kept (the same inode: not written again); the
    rest is written; the folder equals an uninterrupted export byte for byte."""
    out = tmp / "export"
    had = files(out)
    assert "config.json" not in had  # published last: the export is not marked complete
    err = _rerun(args)
    got, want = files(out), files(request.getfixturevalue("export"))
    assert {k: v[1] for k, v in got.items()} == {k: v[1] for k, v in want.items()}
    for k, (inode, _) in had.items():
        if k != ".engram":
            assert got[k][0] == inode, f"{k} was written again"
    names = [k for k in had if k != ".engram"]
    assert names and f"kept {len(names)} file" in err, err


def _rerun_study(tree, tmp, args, request):
    """The rerun finishes; runs finished before the signal are not trained again."""
    out = tmp / "study"
    done = {p.parent.name: p.read_bytes() for p in out.glob("runs/*/result.json")}
    _rerun(args)
    for name, data in done.items():
        assert (out / "runs" / name / "result.json").read_bytes() == data


def _rerun_finetune(tree, tmp, args, request):
    """The checkpoint of the step reached is the newest; the rerun resumes from it and finishes."""
    step = json.loads((tmp / "ft" / "checkpoints" / "latest.json").read_text())["step"]
    assert 0 < step < 40, step
    _rerun(args)
    assert json.loads((tmp / "ft" / "finetune.json").read_text())


def _rerun_finetune_study(tree, tmp, args, request):
    """Seed 0 (finished before the signal) is not trained again; the rerun finishes."""
    seed0 = (tmp / "study" / "seed0" / "results.json").read_bytes()
    assert _methods(tmp / "study" / "seed1") < 2  # caught in progress
    _rerun(args)
    assert (tmp / "study" / "seed0" / "results.json").read_bytes() == seed0
    assert (tmp / "study" / "results.json").is_file()


RERUN = {"finetune": _rerun_finetune, "finetune-study": _rerun_finetune_study,
         "train": _rerun_train, "prepare": _rerun_prepare, "export-hf": _rerun_export_hf,
         **{k: _rerun_study for k in ("sweep-slots", "sweep-allocation", "ablate", "compare",
                                      "study-nine")}}


def test_every_long_command_has_a_row():
    """A new long command gets a row here (or a reason in this list)."""
    from engram.cli import COMMANDS

    quick = {"demo": "~3 s, writes one file at the end", "export-tables": "as export-hf's tables",
             "study-vision": "its runs go through the studies' runner (studies/common.py), "
                             "as compare's; a tiny size is still minutes",
             }
    assert set(COMMANDS) - set(CASES) - set(quick) == set()


@pytest.fixture(scope="module", autouse=True)
def record_times():
    """With ENGRAM_INTERRUPTS_JSON, the seconds from signal to exit per row are written there."""
    yield
    path = os.environ.get("ENGRAM_INTERRUPTS_JSON")
    if path and TIMES:
        sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
        from record import write_json

        from engram.compute import machine

        old = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        write_json(path, {
            "what": "tests/test_interrupts.py: each long command started at tiny size, signalled "
                    "once its work was under way; seconds from the signal to its exit (status "
                    "130, one line saying what was kept)",
            "cpu": machine.cpu_id(), "cpus": os.cpu_count(),
            "rerun": "ENGRAM_INTERRUPTS_JSON=benchmarks/results/interrupts.json python -m pytest "
                     "-m 'slow or not slow' tests/test_interrupts.py",
            "seconds": {**old.get("seconds", {}), **TIMES}})


def test_a_line_on_stderr_is_one_write(monkeypatch):
    """``print`` writes a line's text and its newline apart: a Ctrl-C between the two glued the
    command's last line onto the one before ("...max_new_tokens=2000)engram generate:
    interrupted; ..."). The command line's lines go through ``stderr_line``, one write each, and
    nothing under src/ prints to stderr another way."""
    import io

    from engram.interrupts import stderr_line

    class Writes(io.StringIO):
        calls: list[str] = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stderr", Writes())
    stderr_line("engram generate: a line")
    assert Writes.calls == ["engram generate: a line\n"]
    printing = [f"{p.relative_to(SRC)}:{n}" for p in (SRC / "engram").rglob("*.py")
                for n, line in enumerate(p.read_text().splitlines(), 1)
                if "file=sys.stderr" in line and "tqdm(" not in line]
    assert not printing, printing
