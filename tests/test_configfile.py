"""Config files: `--config FILE` (YAML or JSON) fills a command's options and the command line
overrides it; `--print_config` prints the effective options as a file `--config` reads back, for
every command that takes configs. A run's own config.json as `--config` trains the same run:
tests/test_cli.py (test_train_spellings_and_a_config_file_run_the_same); bad files are one line:
tests/test_bad_input.py."""

import json

import pytest

from engram.commandline import configfile
from engram.cli import COMMANDS, main
from engram.errors import UserError

# What each command needs besides options to get as far as building its configs.
POSITIONALS = {"eval": ["RUN"], "analyze": ["RUN"], "generate": ["RUN"], "export-tables": ["RUN"],
               "export-hf": ["RUN", "OUT"], "finetune": ["MODEL"]}
REQUIRED = {"generate": ["--prompt", "hi"], "prepare": ["--out", "corpus", "--source", "kjv"],
            "finetune": ["--data", "corpus"]}


def printed(capsys, name: str, *argv: str) -> str:
    """What `engram NAME ... ARGV --print_config...` prints (it must exit 0 and do nothing else)."""
    assert main([name, *POSITIONALS.get(name, []), *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if c.configs))
def test_printed_config_reads_back_the_same(capsys, tmp_path, monkeypatch, name, fmt):
    monkeypatch.chdir(tmp_path)  # where the default (relative) outputs would go
    first = printed(capsys, name, *REQUIRED.get(name, []), f"--print_config={fmt}")
    path = tmp_path / f"config.{fmt}"
    path.write_text(first)
    # The file alone (a required option too) gives the same effective options.
    assert printed(capsys, name, "--config", str(path), f"--print_config={fmt}") == first
    assert list(tmp_path.iterdir()) == [path]  # printing did no work: no output folder


def test_file_fills_and_the_command_line_overrides(capsys, tmp_path):
    # YAML 1.1 reads 1e-3 as a string: a string value is read as the command line reads it.
    (tmp_path / "c.yaml").write_text("steps: 40\nlr: 1e-3\nsources: kjv\nengram_layers: [0, 2]\n"
                                     "engram: no\nd_ff: null\nresume: false\n")
    out = json.loads(printed(capsys, "train", "--config", str(tmp_path / "c.yaml"), "--steps=7",
                             "--print_config", "json"))
    assert out["steps"] == 7 and out["lr"] == 0.001 and out["sources"] == ["kjv"]
    assert out["engram_layers"] == [0, 2] and out["engram"] is False and out["d_ff"] is None
    assert out["resume"] is False  # the second config's (Launch) option, from the same file
    assert out["seq_len"] == 128  # neither: the dataclass's default


def test_a_torchrun_run_s_records_are_passed_over(capsys, tmp_path):
    # training/distributed.py adds world_size and table_init to TrainConfig's fields
    (tmp_path / "config.json").write_text(json.dumps({"steps": 5, "world_size": 2,
                                                      "table_init": "sharded"}))
    out = json.loads(printed(capsys, "train", f"--config={tmp_path / 'config.json'}",
                             "--print_config=json"))
    assert out["steps"] == 5 and out["table_init"] == "sharded" and "world_size" not in out
    out = json.loads(printed(capsys, "compare", f"--config={tmp_path / 'config.json'}",
                             "--print_config=json"))
    assert "table_init" not in out and "world_size" not in out


def test_a_run_s_config_given_to_a_study_passes_over_what_the_study_sets(capsys, tmp_path):
    # a run's config.json holds every TrainConfig field: its warmup (the study's budget sets it)
    # and its tier (a study's runs keep tables in memory) are passed over, and said
    (tmp_path / "config.json").write_text(json.dumps({"steps": 5, "lr": 0.002, "warmup": 3,
                                                      "table_tier": "file"}))
    out = json.loads(printed(capsys, "compare", f"--config={tmp_path / 'config.json'}",
                             "--print_config=json"))
    assert out["lr"] == 0.002 and "warmup" not in out and "table_tier" not in out
    (tmp_path / "c.yaml").write_text("warmupp: 3\n")  # a typo is still an error
    assert main(["compare", "--config", str(tmp_path / "c.yaml"), "--print_config"]) == 2
    assert "unknown option 'warmupp'" in capsys.readouterr().err


def test_a_shared_option_is_the_first_config_s(capsys, tmp_path):
    """compare's --steps is CompareConfig's (the study's budget), in a file as on the command
    line."""
    (tmp_path / "c.yaml").write_text("steps: 11\n")
    yaml_text = printed(capsys, "compare", "--config", str(tmp_path / "c.yaml"), "--print_config")
    assert yaml_text.count("\nsteps: ") == 1 and "\nsteps: 11\n" in yaml_text
    assert yaml_text.index("steps: 11") < yaml_text.index("# TrainConfig options")


def test_read_and_dump():
    text = configfile.dump([("A options", {"a": (1, 2), "b": None}), ("B", {"c": "x y"})], "yaml",
                           header="h")
    assert text.splitlines() == ["# h", "# A options", "a: [1, 2]", "b: null", "# B", "c: x y"]
    assert json.loads(configfile.dump([("A", {"a": (1,)}), ("B", {"c": 1.5})], "json")) == \
        {"a": [1], "c": 1.5}


def test_read_refuses_in_one_line(tmp_path):
    cases = {"list.yaml": ("- 1\n", "holds a list, not a mapping"),
             "bad.yaml": ("a: [1\n", "is not valid YAML (line 2, column 1"),
             "bad.json": ('{"a": 1,}', "is not valid JSON (line 1, column 9"),
             "bin.yaml": (b"\xff\xfe", "is not UTF-8 text")}
    for name, (content, says) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(UserError, match="^--config .*" + says.replace("(", r"\(")):
            configfile.read(path)
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert configfile.read(tmp_path / "empty.yaml") == {}


@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if c.presets))
def test_a_preset_fills_and_the_file_and_command_line_override_it(capsys, tmp_path, name):
    for preset, values in COMMANDS[name].presets.items():
        out = json.loads(printed(capsys, name, *REQUIRED.get(name, []), "--preset", preset,
                                 "--print_config=json"))
        assert {k: out[k] for k in values} == {k: (list(v) if isinstance(v, tuple) else v)
                                               for k, v in values.items()}
        key = next(iter(values))
        (tmp_path / "c.yaml").write_text(f"{key}: 3\n")
        assert json.loads(printed(capsys, name, *REQUIRED.get(name, []), "--preset", preset,
                                  "--config", str(tmp_path / "c.yaml"),
                                  "--print_config=json"))[key] == 3
        assert json.loads(printed(capsys, name, *REQUIRED.get(name, []), "--preset", preset,
                                  "--config", str(tmp_path / "c.yaml"), f"--{key}=2",
                                  "--print_config=json"))[key] == 2
    with pytest.raises(SystemExit) as bad:  # argparse's one line, exit 2
        main([name, *POSITIONALS.get(name, []), "--preset", "no-such", "--print_config"])
    assert bad.value.code == 2 and "invalid choice: 'no-such'" in capsys.readouterr().err


def test_resolved_defaults_keep_their_meaning(capsys, tmp_path, monkeypatch):
    """Every command's resolved options equal tests/data/print_config/configs.json (issue 48: a
    recorded run's config.json keeps its meaning). An intended change of a default or an option
    reruns tests/data/print_config/record.py and says so in its commit."""
    from pathlib import Path

    golden = json.loads((Path(__file__).parent / "data" / "print_config" / "configs.json")
                        .read_text())
    monkeypatch.chdir(tmp_path)
    names = sorted(n for n, c in COMMANDS.items() if c.configs)
    assert names == sorted(golden), "a command was added or removed: rerun record.py"
    for name in names:
        got = json.loads(printed(capsys, name, *REQUIRED.get(name, []), "--print_config=json"))
        changed = sorted(k for k in set(got) | set(golden[name]) if got.get(k, "?") !=
                         golden[name].get(k, "?"))
        assert not changed, f"engram {name}: {changed} differ from the recorded defaults"
