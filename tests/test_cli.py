"""The command line: every config field in --help with its default, both option spellings, closest
names for typos, --version, and the same run from `--key value` and `--key=value`."""

import dataclasses
import json

import pytest

from engram.cli import main
from engram.options import field_comments, parse_overrides
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
    for cls in configs:
        for f in dataclasses.fields(cls):
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
    text = " ".join(help_text(capsys, "finetune").split())
    assert "--lora_lr" in text and "default: 0.001" in text


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


def test_train_space_and_equals_spellings_run_the_same(tmp_path, capsys, one_thread):
    common = ["--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32",
              "--batch_size", "2", "--table_size", "500", "--max_chars", "20000",
              "--eval_every", "5", "--eval_batches", "1", "--warmup", "1", "--log_every", "1"]
    equals = [f"{k}={v}" for k, v in zip(common[::2], common[1::2])]
    outs = []
    for args in (["--steps", "5", "--out_dir", str(tmp_path / "a"), *common],
                 ["--steps=5", f"--out_dir={tmp_path / 'b'}", *equals]):
        assert main(["train", *args]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["step"] == outs[1]["step"] == 5
    assert outs[0]["loss"] == outs[1]["loss"] and outs[0]["val_loss"] == outs[1]["val_loss"]
