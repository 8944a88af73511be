"""A damaged ``engram export-hf`` folder and a damaged ``engram finetune`` adapter, as a user meets
them (issue 48 item 7; tests/artifacts/test_damaged_run.py does the run folder): each part
deleted, truncated (to half, to nothing), flipped and edited; ``engram.open`` either opens it and
generates what the intact folder generates (a part opening does not read) or refuses in one line,
a UserError naming the folder and the part and saying what to do; never a raw error of json,
safetensors, numpy or tokenizers."""

import shutil
from pathlib import Path

import pytest
from test_damaged_run import (ADVICE, DAMAGE, OPENS, TINY, _edit_json, _greedy,
                              generate_refuses_in_one_line)

import engram
from engram.errors import UserError
from engram.serving.loader import export_hf
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

EDITS = {
    "edit shape": _edit_json(lambda d: d.update(num_hidden_layers=3)),
    "edit vocab_size": _edit_json(lambda d: d.update(vocab_size=d["vocab_size"] + 1)),
    "edit model": _edit_json(lambda d: d["engram_model"].update(n_layer="two")),
    "edit tier": _edit_json(lambda d: d["engram_serving"].update(tier="file")),
    "edit format": _edit_json(lambda d: d.update(engram_format="engram-serving-0")),
    "edit digest": _edit_json(lambda d: d.update(engram_weights_sha256="0" * 64)),
    "edit header": _edit_json(lambda d: d["config"].update(max_ngram_size=2)),
}
DAMAGE = {**DAMAGE, **EDITS}


@pytest.fixture(scope="module")
def intact_export(tmp_path_factory):
    """A tiny run's export (its table files, row counts, tokenizer), and its greedy tokens."""
    root = tmp_path_factory.mktemp("damaged_export")
    train(TrainConfig(out_dir=str(root / "run"), **TINY), progress=False)
    out = export_hf(root / "run", root / "export")
    return out, _greedy(engram.open(out))


@pytest.fixture(scope="module")
def intact_adapter(tmp_path_factory, tok):
    """A self-contained adapter on a tiny llama (its base model beside it), and its greedy
    tokens."""
    from hf_models import make_adapter

    adapter = make_adapter(tmp_path_factory.mktemp("damaged_adapter"), "llama", tok)
    return adapter, _greedy(engram.open(adapter))


# (part, where it is, damage, expected: OPENS or what the one line names besides the folder)
EXPORT_CASES = [
    *[("config.json", "config.json", d, "config.json")
      for d in ("delete", "half", "zero", "flip", "edit shape", "edit vocab_size", "edit model",
                "edit format", "edit digest")],
    ("config.json", "config.json", "edit tier", OPENS),  # another tier serves the same rows
    *[("tokenizer.json", "tokenizer.json", d, "tokenizer.json")
      for d in ("delete", "half", "zero", "flip", "edit tokenizer")],
    # transformers' tokenizer settings: engram.open reads tokenizer.json alone
    *[("tokenizer_config.json", "tokenizer_config.json", d, OPENS)
      for d in ("delete", "half", "zero", "flip")],
    *[("model.safetensors", "model.safetensors", d, "model.safetensors")
      for d in ("delete", "half", "zero", "flip")],
    *[("table file", "tables/layer0.table", d, "layer0.table")
      for d in ("delete", "half", "zero", "flip")],
    ("tables/", "tables", "delete", "tables/layer0.table"),
    # row counts feed a hot cache only (cache_fraction > 0): the memory tier does not read them
    ("row counts", "tables/row_counts.safetensors", "delete", OPENS),
    *[("row counts", "tables/row_counts.safetensors", d, "row_counts.safetensors")
      for d in ("half", "zero")],
    *[(".engram", ".engram", d, OPENS) for d in ("delete", "half", "zero", "flip")],
]

ADAPTER_CASES = [
    *[("engram.safetensors", "engram.safetensors", d, "engram.safetensors")
      for d in ("delete", "half", "zero", "flip")],
    ("engram_config.json", "engram_config.json", "delete", OPENS),  # a copy of the header
    *[("engram_config.json", "engram_config.json", d, "engram_config.json")
      for d in ("half", "zero", "flip", "edit header")],
    *[("tokenizer.json", "tokenizer.json", d, "tokenizer.json")
      for d in ("delete", "half", "zero", "flip", "edit tokenizer")],
    *[("compression.npy", "compression.npy", d, "compression.npy")
      for d in ("delete", "half", "zero", "flip")],
]


def _damaged(folder: Path, tmp_path: Path, where: str, damage: str) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    DAMAGE[damage](copy / where)
    return copy


def _opens_or_one_line(intact, tmp_path, where, damage, expected):
    copy = _damaged(intact[0], tmp_path, where, damage)
    if expected is OPENS:
        assert _greedy(engram.open(copy)) == intact[1]
        return
    with pytest.raises(UserError) as e:
        engram.open(copy)
    line = str(e.value)
    assert "\n" not in line
    assert str(copy) in line and expected in line, line
    said = line.replace(str(copy), "FOLDER")  # the folder is named "copy"
    assert any(word in said for word in (*ADVICE, "re-export")), line


@pytest.mark.parametrize("part,where,damage,expected", EXPORT_CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in EXPORT_CASES])
def test_a_damaged_export_part_opens_or_is_refused_in_one_line(intact_export, tmp_path, part,
                                                               where, damage, expected):
    _opens_or_one_line(intact_export, tmp_path, where, damage, expected)


@pytest.mark.parametrize("part,where,damage,expected", ADAPTER_CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in ADAPTER_CASES])
def test_a_damaged_adapter_part_opens_or_is_refused_in_one_line(intact_adapter, tmp_path, part,
                                                                where, damage, expected):
    _opens_or_one_line(intact_adapter, tmp_path, where, damage, expected)


@pytest.mark.parametrize("kind,where,damage", [("export", "tokenizer.json", "delete"),
                                               ("export", "model.safetensors", "flip"),
                                               ("adapter", "engram.safetensors", "flip")])
def test_the_command_line_says_one_line_and_no_traceback(intact_export, intact_adapter, tmp_path,
                                                         kind, where, damage):
    intact = intact_export if kind == "export" else intact_adapter
    generate_refuses_in_one_line(_damaged(intact[0], tmp_path, where, damage), where)
