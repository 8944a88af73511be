"""A damaged run folder, as a user meets one (issue 48 item 7): each part deleted, truncated (to
half, to nothing) and edited; ``engram.open`` either opens it and generates what the intact run
generates (a part opening does not need) or refuses in one line, a UserError naming the folder and
the part and saying what to do; never a raw error of json, safetensors, torch or tokenizers."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engram
from engram.errors import UserError
from engram.serving.loader import write_tables
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(steps=1, max_chars=20_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=1, ckpt_every=1)
PROMPT = "In the beginning"
OPENS = None  # the expected outcome of a damage that opening does not mind
# What a refusal must say besides the folder and the part: what to do.
ADVICE = ("copy", "resume", "train", "write", "delete", "undo")


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A tiny trained run with its table files (RUN/tables), and its greedy tokens."""
    run = tmp_path_factory.mktemp("damaged") / "run"
    train(TrainConfig(out_dir=str(run), **TINY), progress=False)
    write_tables(run)
    return run, _greedy(engram.open(run))


def _greedy(rt):
    cfg = engram.GenerationConfig(max_new_tokens=4)
    return engram.Generator(rt, config=cfg).generate([rt.encode(PROMPT)]).tokens


def _checkpoint(run: Path) -> Path:
    return next((run / "checkpoints").glob("step_*.safetensors"))


def _edit_json(change):
    def edit(path: Path) -> None:
        d = json.loads(path.read_text())
        change(d)
        path.write_text(json.dumps(d))
    return edit


def _flip(path: Path) -> None:
    """Eight bytes in the middle of the file, inverted."""
    b = bytearray(path.read_bytes())
    m = len(b) // 2
    b[m:m + 8] = bytes(x ^ 0xFF for x in b[m:m + 8])
    path.write_bytes(bytes(b))


def _add_token(d):
    d["added_tokens"].append({**d["added_tokens"][-1], "id": 10 ** 6, "content": "<edited>"})


DAMAGE = {
    "delete": lambda p: shutil.rmtree(p) if p.is_dir() else p.unlink(),
    "half": lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]),
    "zero": lambda p: p.write_bytes(b""),
    "flip": _flip,
    # JSON: a value that decides the model (or, for a record, any value)
    "edit config": _edit_json(lambda d: d.update(n_head_per_ngram=4, table_size=1009)),
    "edit bookkeeping": _edit_json(lambda d: d.update(out_dir="/elsewhere", steps=9, lr=1.0,
                                                      device="cuda", threads=3)),
    "edit model": _edit_json(lambda d: d["model"]["engram"].update(seed=5)),
    "edit shapes": _edit_json(lambda d: d["model"]["engram"].update(
        engram_vocab_size=[1009, 1009])),  # derived: only the checkpoint's shapes tell
    "edit data": _edit_json(lambda d: d["data"].update(fingerprint="0" * 32)),
    "edit eos": _edit_json(lambda d: d.pop("eos_id")),
    "edit pointer": _edit_json(lambda d: d.update(sha256="0" * 64)),
    "edit tokenizer": _edit_json(_add_token),
}

# (part, where it is, damage, tier, expected: OPENS or what the one line names besides the folder)
CASES = [
    *[("config.json", "config.json", d, "memory", "config.json")
      for d in ("half", "zero", "edit config")],
    ("config.json", "config.json", "delete", "memory", OPENS),  # the checkpoint holds a copy
    ("config.json", "config.json", "edit bookkeeping", "memory", OPENS),
    *[(part, part, d, "memory", OPENS) for part in ("settings.json", "metrics.jsonl", ".engram")
      for d in ("delete", "half", "zero", "flip")],
    ("checkpoints/latest.json", "checkpoints/latest.json", "delete", "memory", "checkpoints"),
    *[("checkpoints/latest.json", "checkpoints/latest.json", d, "memory", "latest.json")
      for d in ("half", "zero")],
    ("checkpoints/latest.json", "checkpoints/latest.json", "edit pointer", "memory",
     "checksum mismatch"),
    *[("checkpoint file", _checkpoint, d, "memory", "step_00000001.safetensors")
      for d in ("delete", "half", "zero", "flip")],
    ("checkpoints/", "checkpoints", "delete", "memory", "checkpoints"),
    *[("model/model.json", "model/model.json", d, "memory", "model/model.json")
      for d in ("delete", "half", "zero", "flip", "edit data", "edit eos")],
    ("model/model.json", "model/model.json", "edit model", "memory", "seed (5 vs 0)"),
    ("model/model.json", "model/model.json", "edit shapes", "memory", "model/model.json"),
    *[("model/tokenizer.json", "model/tokenizer.json", d, "memory", "model/tokenizer.json")
      for d in ("delete", "half", "zero", "flip", "edit tokenizer")],
    *[("model/maps.safetensors", "model/maps.safetensors", d, "memory", "model/maps.safetensors")
      for d in ("delete", "half", "zero", "flip")],
    ("model/", "model", "delete", "memory", "model/model.json"),
    # the memory tier reads the checkpoint's rows: RUN/tables is for the file tiers
    *[("tables/", "tables/layer0.table", d, "memory", OPENS) for d in ("half", "zero", "flip")],
    ("tables/", "tables", "delete", "memory", OPENS),
    ("tables/", "tables", "delete", "file", "tables"),
    *[("tables/", "tables/layer0.table", d, "file", "tables/layer0.table")
      for d in ("half", "zero", "flip")],
]


def _damaged(intact, tmp_path, where, damage) -> Path:
    run, _ = intact
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    DAMAGE[damage](where(copy) if callable(where) else copy / where)
    return copy


@pytest.mark.parametrize("part,where,damage,tier,expected", CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_a_damaged_part_opens_or_is_refused_in_one_line(intact, tmp_path, part, where, damage,
                                                        tier, expected):
    copy = _damaged(intact, tmp_path, where, damage)
    if expected is OPENS:
        assert _greedy(engram.open(copy, tier=tier)) == intact[1]
        return
    with pytest.raises(UserError) as e:
        engram.open(copy, tier=tier)
    line = str(e.value)
    assert "\n" not in line
    assert str(copy) in line and expected in line, line
    assert any(word in line for word in ADVICE), line


def test_an_edited_config_names_the_fields_that_differ(intact, tmp_path):
    copy = _damaged(intact, tmp_path, "config.json", "edit config")
    with pytest.raises(UserError, match=r"config.json disagrees with its checkpoint "
                       r"step_00000001.safetensors on table_size \(1009 vs 997\), "
                       r"n_head_per_ngram \(4 vs 2\)"):
        engram.open(copy)


@pytest.mark.parametrize("where,damage", [("config.json", "edit config"),
                                          ("model/tokenizer.json", "delete")])
def test_the_command_line_says_one_line_and_no_traceback(intact, tmp_path, where, damage):
    generate_refuses_in_one_line(_damaged(intact, tmp_path, where, damage), where)


def generate_refuses_in_one_line(folder: Path, part: str) -> None:
    """`engram generate FOLDER` exits 2 with one line naming ``part``, and no traceback."""
    done = subprocess.run([sys.executable, "-m", "engram", "generate", str(folder), "--prompt",
                           "hi", "--max_new_tokens", "2"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("engram generate: error: ") and part in lines[0]
