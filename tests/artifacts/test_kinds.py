"""Each kind of model folder is told apart by its own module's ``detect`` (artifacts/run.py,
export.py, adapter.py) and ``engram.artifacts.kind_of``, from real tiny folders; a path that is no
model folder is refused in one line naming it and what it lacks (issue 48)."""

import shutil

import pytest

import engram
from engram.artifacts import adapter, export, kind_of, run
from engram.artifacts.run import read_run_files
from engram.errors import UserError
from engram.serving.loader import export_hf
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(steps=1, max_chars=20_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=1, ckpt_every=1)
DETECT = {"run": run.detect, "export": export.detect, "adapter": adapter.detect}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok):
    from hf_models import make_adapter

    root = tmp_path_factory.mktemp("kinds")
    train(TrainConfig(out_dir=str(root / "run"), **TINY), progress=False)
    export_hf(root / "run", root / "export")
    return {"run": root / "run", "export": root / "export",
            "adapter": make_adapter(root / "hf", "llama", tok)}


@pytest.mark.parametrize("kind", sorted(DETECT))
def test_each_kind_is_detected_by_its_own_module_alone(folders, kind):
    assert kind_of(folders[kind]) == kind
    assert {k: d(folders[kind]) for k, d in DETECT.items()} == {k: k == kind for k in DETECT}


def test_each_kind_reads_its_parts(folders):
    files = read_run_files(folders["run"])
    parts = export.read(folders["export"])
    assert parts.model == files.config and parts.vocab.tolist() == files.vocab.tolist()
    assert parts.hasher is not None and parts.table_dir == folders["export"] / "tables"
    assert parts.serving["tier"] == "memory"
    assert parts.raw_vocab_size == len(files.compression.lookup)
    a = adapter.read(folders["adapter"])
    assert a.base_model and a.tokenizer is not None and a.compression is not None
    assert sorted(a.tensors) and all(k.startswith("layers.") for k in a.tensors)


@pytest.mark.parametrize("lose", ["checkpoints", "model"])
def test_a_run_that_lost_a_part_is_still_a_run(folders, tmp_path, lose):
    copy = tmp_path / "run"
    shutil.copytree(folders["run"], copy)
    shutil.rmtree(copy / lose)
    assert kind_of(copy) == "run"
    with pytest.raises(UserError) as e:  # opening names what is gone, not "not an export"
        engram.open(copy)
    assert "\n" not in str(e.value) and str(copy) in str(e.value)


def test_an_adapter_with_finetune_checkpoints_is_an_adapter(folders, tmp_path):
    copy = tmp_path / "adapter"
    shutil.copytree(folders["adapter"], copy)
    (copy / "checkpoints").mkdir()  # `engram finetune` keeps its resume state there
    assert kind_of(copy) == "adapter" and not run.detect(copy)


def _stray(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    return tmp_path / "notes"


def _a_file(tmp_path):
    (tmp_path / "f.json").write_text("{}")
    return tmp_path / "f.json"


@pytest.mark.parametrize("make,says", [
    (lambda t: t / "missing", "no such folder"),
    (_a_file, "is a file"),
    (lambda t: t, "it has no model/ or checkpoints/ (a run), no config.json"),
    (_stray, "engram.safetensors"),
], ids=["missing", "file", "empty", "other files"])
def test_a_path_of_no_kind_is_refused_in_one_line(tmp_path, make, says):
    path = make(tmp_path)
    for call in (kind_of, engram.open):
        with pytest.raises(UserError) as e:
            call(path)
        line = str(e.value)
        assert "\n" not in line and str(path) in line and says in line, line
