"""The command line: every config field in --help with its default, both option spellings, closest
names for typos, --version, and the same run from `--key value` and `--key=value`; the registry
(help without torch, what the source says == what the class does); bad input is one line and exit
status 2, a bug keeps its traceback."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import engram
from engram.artifacts.checkpoint import CheckpointError
from engram.cli import COMMANDS, main
from engram.cli.registry import STUDY_SKIP
from engram.errors import InputNotFound, OutputExists, UserError
from engram.commandline.options import field_comments, parse_overrides
from engram.commandline.schema import MISSING, fields_of, resolve
from engram.studies.compare import CompareConfig
from engram.studies.sweep import SweepConfig
from engram.training.train import TrainConfig


def help_text(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command,configs", [("compare", (CompareConfig, TrainConfig)),
                                             ("sweep-slots", (SweepConfig, TrainConfig)),
                                             ("train", (TrainConfig,))])
def test_help_lists_every_field_with_default(capsys, command, configs):
    text = " ".join(help_text(capsys, command).split())  # argparse wraps lines
    skip = STUDY_SKIP if command != "train" else ()  # tiers, and what the study's budget sets
    for cls in configs:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                assert f"--{f.name} " not in text, f"{command} --help offers --{f.name}"
                continue
            assert f"--{f.name}" in text, f"{command} --help lacks --{f.name}"
    assert "default: 480" in text or command == "train"  # the studies' steps
    assert "the noise estimate; rounding alone moves a run" in text or command != "compare"


def test_field_comments_come_from_the_source():
    c = field_comments(TrainConfig)
    assert c["seed"] == "model init and batch order"
    assert c["table_init_std"].startswith("Small table init")  # comment block above the field
    assert field_comments(SweepConfig)["workers"].startswith("parallel training")  # inherited


def test_generate_and_finetune_help(capsys):
    text = help_text(capsys, "generate")
    assert "--max_new_tokens" in text and "--max-new-tokens" in text and "default: 32" in text
    pytest.importorskip("peft")
    text = " ".join(help_text(capsys, "finetune-study").split())
    assert "--lora_lr" in text and "default: 0.001" in text
    text = " ".join(help_text(capsys, "finetune").split())
    assert "MODEL" in text and "--data" in text and "--table_lr_mult" in text


def test_both_spellings_and_flags():
    a = parse_overrides(TrainConfig, ["--steps", "5", "--out_dir", "x", "--engram", "false"])
    b = parse_overrides(TrainConfig, ["--steps=5", "--out-dir=x", "--no-engram"])
    c = parse_overrides(TrainConfig, ["--steps=5", "--out_dir=x", "--engram=false"])
    assert a == b == c and a.steps == 5 and a.out_dir == "x" and a.engram is False
    assert parse_overrides(TrainConfig, ["--moe"]).moe is True
    assert parse_overrides(SweepConfig, ["--rhos=0,0.5"]).rhos == (0.0, 0.5)
    with pytest.raises(ValueError, match="did you mean --steps"):
        parse_overrides(TrainConfig, ["--stepz=3"])
    with pytest.raises(ValueError, match="bad value for --steps"):
        parse_overrides(TrainConfig, ["--steps", "three"])


def test_unknown_option_and_command_name_the_closest(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--n_layers=2"])
    assert e.value.code == 2 and "did you mean --n_layer" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("engram ")


def test_train_spellings_and_a_config_file_run_the_same(tmp_path, capsys, one_thread):
    """`--key value`, `--key=value`, and the first run's own config.json as --config (its out_dir
    overridden) train the same run."""
    common = ["--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32",
              "--batch_size", "2", "--table_size", "500", "--max_chars", "20000",
              "--eval_every", "5", "--eval_batches", "1", "--warmup", "1", "--log_every", "1"]
    equals = [f"{k}={v}" for k, v in zip(common[::2], common[1::2])]
    outs = []
    for args in (["--steps", "5", "--out_dir", str(tmp_path / "a"), *common],
                 ["--steps=5", f"--out_dir={tmp_path / 'b'}", *equals],
                 ["--config", str(tmp_path / "a" / "config.json"), f"--out_dir={tmp_path / 'c'}"]):
        assert main(["train", *args]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["step"] == outs[1]["step"] == outs[2]["step"] == 5
    assert outs[0]["loss"] == outs[1]["loss"] == outs[2]["loss"]
    assert outs[0]["val_loss"] == outs[1]["val_loss"] == outs[2]["val_loss"]
    a, c = (json.loads((tmp_path / x / "config.json").read_text()) for x in "ac")
    assert {**a, "out_dir": None} == {**c, "out_dir": None}


# -- the registry ----------------------------------------------------------------------------------

def _run(*code_or_args: str, module: bool = False) -> subprocess.CompletedProcess:
    """A fresh interpreter on this checkout's source: ``python -c CODE`` or
    ``python -m engram ARGS``."""
    argv = ["-m", "engram", *code_or_args] if module else ["-c", *code_or_args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(engram.__file__).parents[1])})


def test_help_of_every_command_imports_no_torch():
    code = ("import sys\nfrom engram.cli import COMMANDS, main\n"
            "for argv in [['--help']] + [[c, '--help'] for c in COMMANDS]:\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, (argv, e.code)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')\n"
            "               or m.startswith(('engram.training.', 'engram.studies.',\n"
            "                                'engram.serving.')))\n"
            "heavy.remove('engram.serving.hf_auto')  # import engram's hook for transformers: stdlib\n"
            "assert not heavy, heavy\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr
    for argv in (["--help"], ["train", "--help"]):  # the installed entry point's way in
        r = _run(*argv, module=True)
        assert r.returncode == 0 and "usage: engram" in r.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_shows_a_default_or_required(capsys, name):
    text = " ".join(help_text(capsys, name).split())
    cmd = COMMANDS[name]
    for c in cmd.configs:
        for f in fields_of(c.ref):
            if f.name in c.skip:
                continue
            assert f"--{c.prefix}{f.name}" in text
    for a in cmd.parser()._actions:
        if not a.option_strings or a.help in (None, "==SUPPRESS==") or a.dest == "help":
            continue
        shown = a.help.replace("%%", "%")
        assert re.search(r"\[[^\[]*; (default: [^\]]*|required)\]$", shown), shown
        assert ("; required]" in shown) == a.required, a.option_strings
    assert "RUN_DIR" in text or not any(x.name == "run_dir" for x in cmd.args)


def test_the_source_reader_agrees_with_every_command_config():
    """What --help shows (read from the source) is what the imported dataclass does."""
    seen = set()
    for cmd in COMMANDS.values():
        for c in cmd.configs:
            cls = resolve(c.ref)
            if cls in seen:
                continue
            seen.add(cls)
            real = [f for f in dataclasses.fields(cls) if f.init]
            read = fields_of(c.ref)
            assert [f.name for f in real] == [f.name for f in read], cls
            for r, s in zip(real, read):
                default = r.default
                if r.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    default = r.default_factory()  # type: ignore[misc]
                elif default is dataclasses.MISSING:
                    default = MISSING
                assert s.default == default and type(s.default) is type(default), (cls, r.name)
                assert s.type == str(r.type), (cls, r.name)
                if s.choices and not s.required:
                    values = default if isinstance(default, tuple) else (default,)
                    assert all(v in s.choices for v in values if v is not None), (cls, r.name)


def test_reads_and_writes_name_real_options():
    for cmd in COMMANDS.values():
        assert {p.name for p in cmd.reads + cmd.writes} <= cmd.options(), cmd.name
        assert {w.of for w in cmd.writes if w.of} <= cmd.options(), cmd.name
        assert len(cmd.help.splitlines()) == 1
    # every option naming a place to write is declared, so the registry checks it first
    for cmd in COMMANDS.values():
        shown = {a.name for a in cmd.args} | {f.name for c in cmd.configs for f in fields_of(c.ref)
                                               if f.name not in c.skip}
        named = shown & {"out_dir", "out", "json", "table_dir"}
        declared = {w.name for w in cmd.writes} | {r.name for r in cmd.reads}
        assert named <= declared, (cmd.name, named - declared)


def test_a_user_error_is_one_line_and_exit_2(capsys, tmp_path):
    r = _run("train", "--steps=0", module=True)  # the real exit status and stderr
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "engram train: error: steps must be >= 1, got 0\n"
    # a check deep in the library (the model's config, built once the corpus is loaded)
    assert main(["train", "--n_layer=2", "--engram_layers=5", "--max_chars=20000",
                 f"--out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram train: error: Engram layer ids [5] are out of range")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as e:  # a value outside the valid ones: argparse, one line
        main(["export-hf", "a", "b", "--tier", "nvme"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "choose from memory, file, pinned, shared" in err


def test_a_bug_keeps_its_traceback():
    r = _run("from engram.cli import command, main\n"
             "command('boom', 'a command with a bug')(lambda: {}['missing'])\n"
             "raise SystemExit(main(['boom']))")
    assert r.returncode == 1 and "Traceback" in r.stderr and "KeyError: 'missing'" in r.stderr


def test_user_errors_are_value_errors_and_the_os_errors_they_replace():
    assert issubclass(UserError, ValueError)
    assert issubclass(InputNotFound, FileNotFoundError) and issubclass(InputNotFound, UserError)
    assert issubclass(OutputExists, FileExistsError) and issubclass(CheckpointError, RuntimeError)
    assert issubclass(CheckpointError, UserError)
    with pytest.raises(UserError, match="did you mean --steps"):
        parse_overrides(TrainConfig, ["--stepz=3"])


@pytest.mark.slow
def test_torchrun_takes_the_same_train_options(tmp_path):
    """`torchrun -m engram train`: the registry's train entry, sharded tables, rank 0 prints."""
    tiny = ["--n_layer=2", "--d_model=32", "--n_head=2", "--seq_len=32", "--batch_size=4",
            "--table_size=500", "--max_chars=20000", "--eval_every=2", "--eval_batches=1",
            "--warmup=1", "--log_every=1", "--steps=2", "--threads=1"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        "-m", "engram", "train", f"--out_dir={tmp_path / 'run'}",
                        "--table-init=sharded", "--timeout=120", *tiny],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(Path(engram.__file__).parents[1])})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["world_size"] == 2 and out["step"] == 2


def test_the_last_line_follows_every_open_progress_bar():
    """The command line closes the progress bars still open before its one line: a bar that a
    reference cycle keeps alive past the exception would otherwise share it ("analyze: 0/8
    ...engram analyze: interrupted; ...", seen once under load)."""
    import io

    from tqdm import tqdm

    from engram.cli import _close_bars

    out = io.StringIO()
    held = [tqdm(total=8, desc="analyze", file=out)]
    held.append(held)  # a cycle: nothing closes the bar until the collector runs
    assert not out.getvalue().endswith("\n")
    _close_bars()
    assert out.getvalue().endswith("\n")
