"""Bad input over every command: exit status 2, one line on stderr, no traceback, and the file tree
byte for byte as it was (issue 27). One tiny trained run, its export and the input files are shared
by every case (a module fixture); each case hashes the whole tree before and after.

Then what cannot be a one-line refusal before the work: a diverging run stops naming the step and
keeps its last good checkpoint (metrics stay JSON); files are published with the umask's
permissions; SIGINT / SIGTERM save a checkpoint and exit 130, and the rerun resumes (subprocesses:
signals need a process of their own).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engram
from engram.cli import COMMANDS, main
from engram.outputs import MARKER

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--n_layer=2", "--d_model=32", "--n_head=2", "--seq_len=32", "--batch_size=2",
        "--table_size=500", "--max_chars=20000", "--eval_every=2", "--eval_batches=1",
        "--warmup=1", "--log_every=1", "--threads=1"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/: run (2 steps), other (a copy of it elsewhere), export (of run), text.txt, binary.bin,
    prior.json (a JSON file of the user's), plain.txt, foreign/ (config.json and metrics.jsonl
    that are not a run's), analysis-free; bad config files (--config)."""
    root = tmp_path_factory.mktemp("bad_input")
    assert main(["train", f"--out_dir={root / 'run'}", "--steps=2", "--ckpt_every=2", *TINY]) == 0
    assert main(["export-hf", str(root / "run"), str(root / "export")]) == 0
    shutil.copytree(root / "run", root / "other")
    (root / "text.txt").write_text("In the beginning God created the heaven and the earth.\n")
    (root / "binary.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    (root / "prior.json").write_text('{"mine": true}\n')
    (root / "plain.txt").write_text("a file, not a folder\n")
    (root / "foreign").mkdir()
    (root / "foreign" / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "foreign" / "metrics.jsonl").write_text('{"accuracy": 0.9}\n')
    (root / "bad.yaml").write_text("steps: [1, 2\n")
    (root / "bad.json").write_text('{"steps": 3,}\n')
    (root / "list.yaml").write_text("- steps\n- 3\n")
    (root / "typo.yaml").write_text("stepz: 3\n")
    (root / "types.yaml").write_text("steps: three\n")
    (root / "nulls.yaml").write_text("table_size: null\n")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: a file's SHA-256 and mode, a folder's mode."""
    out = {}
    for p in sorted(root.rglob("*")):
        mode = oct(p.lstat().st_mode)
        out[str(p.relative_to(root))] = (mode + " " + hashlib.sha256(p.read_bytes()).hexdigest()
                                         if p.is_file() else mode)
    return out


# (argv with {root} for the tree, what stderr must say); every case is bad input
CASES = [
    # overwrites: a command writes only into its own kind of folder
    ("export-hf {root}/run {root}/run", "holds an engram run (from `engram train`), not an export"),
    ("export-hf {root}/run {root}/foreign", "not an export folder"),
    ("export-hf {root}/other {root}/export", "holds an export of"),
    ("export-hf {root}/run {root}/export/config.json", "config.json is a file, not a folder"),
    ("export-hf {root}/run {root}/export/config.json/x", "config.json is a file, so nothing can"),
    ("train --out_dir {root}/foreign --steps 1 " + " ".join(TINY), "not a run folder"),
    ("train --out_dir {root}/export --steps 1", "holds an engram export"),
    # tables that cannot fit in memory: refused before any allocation (issue 48), naming the way out
    ("train --out_dir {root}/huge --table_size 4000000000",
     "or keep them in files with --table_tier file"),
    ("train --out_dir {root}/run --steps 1 " + " ".join(TINY), "past steps=1: pass --steps 2"),
    ("train --out_dir {root}/plain.txt", "is a file, not a folder"),
    ("train --out_dir {root}/plain.txt/sub", "plain.txt is a file, so nothing can be written"),
    ("analyze {root}/run --out_dir {root}/run", "holds an engram run (from `engram train`), not an "
     "analysis"),
    ("analyze {root}/run --baseline {root}/nope", "--baseline {root}/nope: no such file"),
    ("compare --out_dir {root}/foreign", "not a compare folder"),
    ("sweep-slots --out_dir {root}/plain.txt", "is a file, not a folder"),
    ("sweep-allocation --out_dir {root}/run", "holds an engram run"),
    ("ablate --out_dir {root}/export", "holds an engram export"),
    ("study-nine --out_dir {root}/foreign", "not a study-nine folder"),
    ("study-vision --out_dir {root}/plain.txt", "is a file, not a folder"),
    ("finetune-study --out_dir {root}/foreign", "not a finetune folder"),
    ("finetune smollm2 --data {root}/run --out_dir {root}/foreign", "not an adapter folder"),
    ("finetune smollm2 --data {root}/nope", "--data {root}/nope: no such file"),
    # finetune: a model of a family Engram does not inject into, data that is no corpus
    ("finetune {root}/run --data {root}/run", "Engram injects into llama, mistral"),
    ("finetune {root}/export --data {root}/run", "Engram injects into llama, mistral"),
    ("finetune {root}/nope --data {root}/run", "model {root}/nope: no such folder"),
    ("finetune smollm2 --data {root}/run", "{root}/run"),
    ("pool-budget {root}/run --out_dir {root}/foreign", "not a pool-budget folder"),
    ("pool-budget {root}/run --table_dir {root}/run", "holds an engram run"),
    ("pool-budget {root}/nope", "RUN_DIR {root}/nope: no such file"),
    ("import-v41 {root}/nope {root}/v41", "SRC {root}/nope: no such file"),
    ("import-v41 {root}/run {root}/foreign", "foreign exists and is not empty"),
    ("export-v41 {root}/run {root}/plain.txt", "is a file, not a folder"),
    # file outputs: new, or this command's own earlier output
    ("demo --json {root}", "is a folder; name a file"),
    ("demo --json {root}/prior.json", "exists and was not written by `engram demo`"),
    ("eval {root}/run --source kjv --json {root}/run/config.json", "was not written by `engram "
     "eval`"),
    ("generate {root}/run --prompt God --json {root}/export", "is a folder"),
    ("generate {root}/run --prompt God --json {root}/plain.txt/x.json", "plain.txt is a file"),
    # inputs
    ("eval {root}/run --text /bin/ls", "--text /bin/ls is not UTF-8 text"),
    ("eval {root}/run --text {root}/binary.bin", "binary.bin is not UTF-8 text"),
    ("eval {root}/run --text {root}/nope.txt", "--text {root}/nope.txt: no such file"),
    ("eval {root}/nope --source kjv", "RUN_DIR {root}/nope: no such file"),
    ("eval {root}/run", "give exactly one of --text FILE, --source NAME or --data DIR"),
    ("eval {root}/run --data {root}/export", "is not a prepared corpus"),
    ("train --data {root}/run --steps 1", "is not a prepared corpus"),
    # prepare: inputs that hold nothing to read, and where it may write
    ("prepare --input {root}/nope/*.md --out {root}/late", "matches nothing"),
    ("prepare --input {root}/nope.txt --out {root}/late", "--input {root}/nope.txt: no such file"),
    ("prepare --input {root}/binary.bin --out {root}/late", "no documents to prepare"),
    ("prepare --out {root}/late", "nothing to prepare: give --input PATH"),
    ("prepare --input {root}/text.txt --out {root}/run", "holds an engram run"),
    ("prepare --input {root}/text.txt --out {root}/foreign", "not a corpus folder"),
    ("prepare --input {root}/text.txt --out {root}/plain.txt", "is a file, not a folder"),
    ("prepare --input {root}/text.txt --out {root}/late --shard_mb 0", "shard_mb must be > 0"),
    ("prepare --input {root}/text.txt --out {root}/late --workers -1", "workers must be >= 0"),
    ("prepare --input {root}/text.txt --out {root}/late --non_utf8 drop", "bad value for "
     "--non_utf8: drop"),
    ("generate {root}/nope --prompt God", "RUN_DIR {root}/nope: no such file"),
    # config files (--config): missing, not a file, not text, bad syntax, keys and values
    ("train --config {root}/nope.yaml", "--config {root}/nope.yaml: no such file"),
    ("train --config {root}/run", "is a folder; name a YAML or JSON file (a run's options: "
     "{root}/run/config.json)"),
    ("train --config {root}/binary.bin", "binary.bin is not UTF-8 text"),
    ("train --config {root}/bad.yaml", "bad.yaml is not valid YAML (line 2, column 1"),
    ("eval {root}/run --config {root}/bad.json", "bad.json is not valid JSON (line 1, column 13"),
    ("generate {root}/run --config {root}/list.yaml", "holds a list, not a mapping"),
    ("train --config {root}/prior.json", "prior.json: unknown option 'mine'"),
    ("compare --config {root}/typo.yaml", "unknown option 'stepz'; did you mean 'steps'"),
    ("train --config {root}/types.yaml", "bad value for --steps: 'three' (expected int)"),
    ("demo --config {root}/nulls.yaml", "bad value for --table_size: null (expected int)"),
    ("train --print_config xml", "invalid choice: 'xml' (choose from 'yaml', 'json')"),
    # a run's own config.json is a config file: its out_dir, so this resumes that run
    ("train --config {root}/run/config.json --steps 1", "past steps=1: pass --steps 2"),
    # numbers: range and finiteness, checked by each config
    ("train --lr inf", "lr must be a finite number, got inf"),
    ("train --grad_clip nan", "grad_clip must be a finite number, got nan"),
    ("train --weight_decay nan", "weight_decay must be a finite number, got nan"),
    ("train --grad_clip 0", "grad_clip must be > 0, got 0.0"),
    ("train --max_chars -10", "max_chars must be >= 1, got -10"),
    ("train --seq_len 0", "seq_len must be >= 1, got 0"),
    ("train --batch_size 0", "batch_size must be >= 1, got 0"),
    ("train --threads 0", "threads must be >= 1, got 0"),
    ("train --steps 0", "steps must be >= 1, got 0"),
    ("train --val_fraction 1", "val_fraction must be in (0, 1), got 1.0"),
    ("train --timeout nan", "timeout must be"),
    ("eval {root}/run --source kjv --max_chars -10", "max_chars must be >= 1, got -10"),
    ("eval {root}/run --source kjv --seq_len 0", "seq_len must be >= 1, got 0"),
    ("eval {root}/run --source kjv --batch_size 0", "batch_size must be >= 1, got 0"),
    ("generate {root}/run --prompt God --temperature nan", "temperature must be a finite number"),
    ("generate {root}/run --prompt God --cache_fraction 2", "cache_fraction must be in [0, 1)"),
    ("generate {root}/run --prompt God --cache_fraction 0.1", "on the memory tier they would do "
     "nothing"),
    ("generate {root}/run --prompt God --max_new_tokens 100", "max_new_tokens=100 leaves no room "
     "for a prompt"),
    ("export-tables {root}/run --table_dir {root}/foreign", "not a tables folder"),
    ("export-tables {root}/nope", "RUN_DIR {root}/nope: no such file"),
    ("generate {root}/run --prompt God --cache_fraction -1", "cache_fraction must be in [0, 1)"),
    ("generate {root}/run --prompt God --threads 0", "threads must be >= 1"),
    ("generate {root}/run --prompt ''", "every --prompt must hold text"),
    ("export-hf {root}/run {root}/new --cache_fraction 2", "cache_fraction must be in [0, 1)"),
    ("demo --text ''", "text must hold at least one character"),
    ("demo --table_size 1", "table_size must be >= 2, got 1"),
    ("compare --seeds ''", "seeds must be non-empty"),
    ("compare --workers 0", "workers must be >= 1, got 0"),
    ("sweep-allocation --rhos 0,2", "each of rhos must be in [0, 1], got 0.0,2.0"),
    ("ablate --ckpt_every 0", "ckpt_every must be >= 1"),
    ("study-nine --hot_rows 0", "each of hot_rows must be >= 1"),
    ("study-vision --lr nan", "lr must be a finite number"),
    ("finetune-study --threads 0", "threads must be >= 1, got 0"),
    ("finetune smollm2 --data {root}/run --steps 0", "steps must be >= 1, got 0"),
    ("analyze {root}/run --batches 0", "batches must be >= 1, got 0"),
    ("analyze {root}/run --out_dir {root}/an", "the probes need 36 (--context=32 + a 4-gram)"),
    ("pool-budget --threads 0", "threads must be >= 1, got 0"),
    ("pool-budget --inject_us nan", "inject_us must be a finite number"),
    # valid values (argparse: one line too)
    ("train --sources kjv,nope", "bad value for --sources: nope (choose from kjv, peoples-daily"),
    ("train --engram_gate nope", "bad value for --engram_gate: nope (choose from paper, demo)"),
    ("train --head nope", "(choose from full, adaptive)"),
    ("train --hot_index nope", "(choose from mphf, exact)"),
    ("train --mphf_engine nope", "(choose from torch, bbhash)"),
    ("train --engram_profile v5", "(choose from demo-v1, v4.1)"),
    ("ablate --variants nope", "bad value for --variants: nope"),
    ("eval {root}/run --source nope", "bad value for --source: nope (choose from kjv"),
    ("finetune-study --forget_sources kjv,nope", "bad value for --forget_sources: nope"),
    ("pool-budget --modes train", "bad value for --modes: train (choose from prefill, decode)"),
    ("train --stepz 3", "did you mean --steps?"),
    # device, precision, compile (issue 25): what this machine cannot run, before any work
    ("train --device cuda:99 --out_dir {root}/late", "device 'cuda:99'"),
    ("train --device gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("train --precision fp8", "bad value for --precision: fp8 (choose from fp32, bf16, fp16)"),
    ("eval {root}/run --source kjv --precision int8", "bad value for --precision: int8"),
    ("eval {root}/run --source kjv --device cuda:99", "device 'cuda:99'"),
    ("generate {root}/run --prompt God --device cuda:99", "device 'cuda:99'"),
    ("generate {root}/run --prompt God --precision fp8", "bad value for --precision: fp8"),
    ("compare --device cuda:99 --out_dir {root}/late", "device 'cuda:99'"),
    ("sweep-slots --precision fp64", "bad value for --precision: fp64"),
    ("ablate --device cuda:99 --out_dir {root}/late", "device 'cuda:99'"),
    ("finetune-study --device cuda:99 --out_dir {root}/late", "device 'cuda:99'"),
    ("finetune smollm2 --data {root}/run --device cuda:99 --out_dir {root}/late",
     "device 'cuda:99'"),
    ("CXX=/nonexistent/c++ train --compile --out_dir {root}/late", "--compile on the CPU needs a C++ compiler"),
    ("CXX=/nonexistent/c++ compare --compile --out_dir {root}/late", "--compile on the CPU needs a C++ compiler"),
    # found only once the work started: the folder it made is removed again
    ("train --out_dir {root}/late --n_layer 2 --engram_layers 5 --max_chars 20000",
     "Engram layer ids [5] are out of range"),
    ("study-nine --out_dir {root}/late --only nope --steps 1 --seeds 0 --max_chars 20000",
     "unknown configurations ['nope']"),
    # lm-eval's own command line, our model type: a tier the registry does not know
    ("lm-eval --model_args pretrained={root}/export,tier=nvme --tasks engram_docs --include_path "
     + str(Path(__file__).parent / "data" / "lm_eval"), "engram_serving.tier must be one of"),
]
if not torch.cuda.is_available():  # on a machine with a GPU these run (the GPU check covers them)
    CASES += [(f"{cmd} --device cuda", "torch sees no CUDA device here") for cmd in (
        "train --out_dir {root}/late", "compare --out_dir {root}/late",
        "eval {root}/run --source kjv", "generate {root}/run --prompt God",
        "finetune-study --out_dir {root}/late", "study-nine --out_dir {root}/late",
        "finetune smollm2 --data {root}/run --out_dir {root}/late")]
# Machines without a precision's autocast cannot be made here (this torch has bf16 and fp16 on
# the CPU): tests/training/test_precision.py refuses one on the meta device instead.


def _command(argv: str) -> str:
    """The command of a case (after any leading VAR=value: the case's environment)."""
    return next(w for w in argv.split() if "=" not in w)


def test_cases_cover_every_command():
    used = {_command(argv) for argv, _ in CASES}
    assert used == set(COMMANDS), set(COMMANDS) - used


@pytest.mark.parametrize("argv,says", CASES, ids=[c[0].split(" --")[0][:40] + f"-{i}"
                                                  for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(tree, capsys, monkeypatch, argv, says):
    import shlex

    before = snapshot(tree)
    args = shlex.split(argv.format(root=tree))
    while "=" in args[0]:  # VAR=value before the command: the case's environment
        monkeypatch.setenv(*args.pop(0).split("=", 1))
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if not x.startswith("engram: resuming")]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"engram {args[0]}"), err
    assert says.format(root=tree) in lines[0], lines[0]
    assert snapshot(tree) == before


# -- what is kept when training goes wrong -----------------------------------------------------------

def test_a_diverging_run_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "nan"
    code = main(["train", f"--out_dir={out}", "--steps=6", "--ckpt_every=1", "--lr=1e30", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    line = err.splitlines()[-1]
    assert "engram train: error: step 2: the loss is nan" in line, line
    assert "the newest checkpoint is step 1" in line
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 1 and [p.name for p in (out / "checkpoints").glob("step_*")] == [
        "step_00000001.safetensors"]  # the NaN step was never saved

    def strict(x):
        raise ValueError(f"not JSON: {x}")
    for row in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(row, parse_constant=strict)


def test_metrics_stay_json_when_a_value_is_not_finite(tmp_path):
    from engram.training.hooks import _line

    row = json.loads(_line({"step": 3, "loss": float("nan"), "val_loss": float("inf")}))
    assert row == {"step": 3, "loss": None, "val_loss": None}


def test_published_files_have_the_umask_s_permissions(tree):
    umask = os.umask(0)
    os.umask(umask)
    want = 0o666 & ~umask
    files = [*(tree / "run" / "checkpoints").iterdir(), tree / "export" / "model.safetensors",
             *(tree / "export" / "tables").iterdir(), tree / "export" / "config.json",
             tree / "run" / MARKER]
    assert files and {p.name: oct(p.stat().st_mode & 0o777) for p in files} == \
        {p.name: oct(want) for p in files}


def test_a_file_output_may_replace_its_own_command_s_output(tree, tmp_path, capsys):
    js = tmp_path / "e.json"
    for _ in range(2):
        assert main(["eval", str(tree / "run"), "--source", "kjv", "--max_chars", "3000",
                     "--json", str(js)]) == 0
    assert json.loads(js.read_text())["written_by"] == "engram eval"
    assert main(["demo", "--json", str(js)]) == 2  # another command's file
    assert "was not written by `engram demo`" in capsys.readouterr().err


# -- interrupts -----------------------------------------------------------------------------------

def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engram", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(engram.__file__).parents[1])})


def _once_training(p: subprocess.Popen, metrics: Path, timeout: float = 120,
                   after: int = 0) -> None:
    """Wait until the run has logged two records, the last past step ``after`` (a resumed run
    may log before its first new step)."""
    def logged() -> bool:
        lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # whole lines
        return len(lines) >= 2 and json.loads(lines[-1]).get("step", 0) > after

    t0 = time.time()
    while not logged():
        assert p.poll() is None, p.communicate()
        assert time.time() - t0 < timeout, "training never started"
        time.sleep(0.05)


def _interrupted(p: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Send ``sig``; the step the command says it stopped at, and its stderr."""
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("engram train: interrupted; stopped at step "), last
    step = int(last.split("stopped at step ")[1].split()[0])
    assert f"the newest checkpoint is step {step} in" in last
    return step, err


def test_a_signal_saves_a_checkpoint_exits_130_and_the_rerun_resumes(tmp_path):
    """SIGINT, then (on the resumed run) SIGTERM: each saves the step reached, exits 130."""
    out = tmp_path / "run"
    argv = ["train", f"--out_dir={out}", "--steps=100000", "--ckpt_every=100000",
            "--eval_every=100000", *TINY]
    p = _start(argv)
    _once_training(p, out / "metrics.jsonl")
    first, _ = _interrupted(p, signal.SIGINT)
    assert first >= 2 and json.loads((out / "checkpoints" / "latest.json").read_text())["step"] \
        == first
    (out / "metrics.jsonl").write_text("")  # to see the resumed run's records start
    p = _start(argv)
    _once_training(p, out / "metrics.jsonl", after=first)
    second, err = _interrupted(p, signal.SIGTERM)
    assert f"engram: resuming {out} from step {first} (of 100000)" in err
    assert second > first
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == second


def test_more_steps_extend_a_finished_run(tree, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tree / "run", run)
    assert main(["train", f"--out_dir={run}", "--steps=3", *TINY]) == 0
    out = capsys.readouterr()
    assert f"engram: resuming {run} from step 2 (of 3)" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["step"] == 3
    assert json.loads((run / "config.json").read_text())["steps"] == 3


@pytest.mark.slow
def test_a_signal_stops_a_study_s_runs_at_a_checkpoint(tmp_path):
    """compare's runs in worker processes: the parent forwards the signal, each run in progress
    saves a checkpoint, the study exits 130 saying so."""
    out = tmp_path / "cmp"
    p = _start(["compare", f"--out_dir={out}", "--seeds=0", "--workers=1", "--steps=100000",
                "--eval_every=100000", "--ckpt_every=100000", "--batch_size=2", "--seq_len=32",
                "--n_layer=2", "--d_model=32", "--n_head=2", "--table_size=500",
                "--max_chars=20000"])
    t0 = time.time()
    while not any(m.read_text().count("\n") >= 2 for m in out.glob("runs/*/metrics.jsonl")):
        assert p.poll() is None and time.time() - t0 < 300, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)  # to the parent only: it forwards to the workers
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(
        "engram compare: interrupted; 0 of 3 runs finished and are kept; the runs in progress "
        "saved a checkpoint"), err[-1000:]
    saved = [json.loads(f.read_text())["step"] for f in out.glob("runs/*/checkpoints/latest.json")]
    assert len(saved) == 1 and saved[0] >= 2


def test_an_export_without_its_tokenizer_is_one_line(tree, tmp_path, capsys):
    """Issue 48's damaged export: tokenizer.json deleted (or torn) ends generate in one line naming
    the folder, the part and what to do, where it ended in the tokenizers library's traceback."""
    for damage, says in (("delete", "tokenizer.json is missing"),
                         ("tear", "tokenizer.json is unreadable")):
        copy = tmp_path / damage
        shutil.copytree(tree / "export", copy)
        if damage == "delete":
            (copy / "tokenizer.json").unlink()
        else:
            (copy / "tokenizer.json").write_text('{"version": ')
        code = main(["generate", str(copy), "--prompt", "God", "--max-new-tokens", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "engram export-hf" in lines[0], err
