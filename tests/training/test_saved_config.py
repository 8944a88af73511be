"""TrainConfig.from_record / saved_config: the one reader of the options a run recorded (issue 48:
four readers, one strict and one dropping unknown keys)."""

import json

import pytest

from engram.artifacts import RUN_RECORDS
from engram.errors import UserError
from engram.training.train import TrainConfig, saved_config


def test_a_recorded_config_reads_back_as_written(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path), seed=3, steps=7, table_size=1009)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))  # JSON: tuples become lists
    assert saved_config(tmp_path) == cfg


def test_torchruns_records_are_passed_over_and_unknown_options_refused(tmp_path):
    rec = {**TrainConfig().to_dict(), **{k: 1 for k in RUN_RECORDS}}
    assert TrainConfig.from_record(rec, "x") == TrainConfig()
    with pytest.raises(UserError) as e:
        TrainConfig.from_record({**rec, "zeta_option": 1, "alpha_option": 2}, tmp_path / "c.json")
    msg = str(e.value)
    assert "\n" not in msg and "alpha_option, zeta_option" in msg and "c.json" in msg


@pytest.mark.parametrize("text, what", [(None, "is missing"), ("{not json", "cannot be read"),
                                        ("[1, 2]", "is not a run's options")])
def test_a_missing_or_damaged_config_is_one_line(tmp_path, text, what):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(UserError) as e:
        saved_config(tmp_path)
    assert what in str(e.value) and "\n" not in str(e.value)
