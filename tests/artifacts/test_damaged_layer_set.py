"""A damaged DeepSeek-V4.1 layer set (``engram import-v41``'s folder, artifacts/layer_set.py), as
a user meets it (issue 48 item 7; test_damaged_run.py and test_damaged_export.py do the other
kinds): each part deleted, truncated (to half, to nothing), flipped and edited; a run opened with
it either generates what the intact layer set gives or refuses in one line naming the folder and
the part; never a raw error of json or safetensors."""

import shutil
from pathlib import Path

import pytest
from test_damaged_run import DAMAGE, _edit_json, _greedy
from v41_ckpt import make_checkpoint

import engram
from engram.artifacts.layer_set import import_v41
from engram.errors import UserError
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
# tests/v41_ckpt.py TINY's shape (as tests/serving/test_v41_serving.py trains it)
RUN = dict(max_chars=20_000, n_layer=3, d_model=64, n_head=1, seq_len=32, batch_size=4,
           hc_mult=2, engram_profile="v4.1", engram_layers=(1, 2), table_size=97,
           max_ngram_size=3, n_head_per_ngram=2, n_embed_per_ngram=64, warmup=1, eval_batches=1,
           log_every=1, eval_every=1, ckpt_every=1, steps=1)
DAMAGE = {**DAMAGE,
          "edit format": _edit_json(lambda d: d.update(format="engram-v41-layers-0")),
          "edit gate": _edit_json(lambda d: d.pop("gate")),
          "edit config": _edit_json(lambda d: d["v41_config"].update(bogus=1))}
CASES = [("engram_layers.json", d) for d in ("delete", "half", "zero", "flip", "edit format",
                                            "edit gate", "edit config")] + \
        [("engram_layers.safetensors", d) for d in ("delete", "half", "zero", "flip")] + \
        [("tables/layer1.table", d) for d in ("delete", "half", "zero", "flip")]


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A tiny v4.1 run, a layer set imported from a random V4.1-layout checkpoint, and the run's
    greedy tokens with it."""
    root = tmp_path_factory.mktemp("damaged_layers")
    train(TrainConfig(out_dir=str(root / "run"), **RUN), progress=False)
    make_checkpoint(root / "ckpt", seed=3)
    import_v41(root / "ckpt", root / "layers")
    rt = engram.open(root / "run", engram_layers=root / "layers")
    return root, _greedy(rt)


@pytest.mark.parametrize("where,damage", CASES, ids=[f"{w}-{d}" for w, d in CASES])
@pytest.mark.parametrize("tier", ["memory", "file"])
def test_a_damaged_layer_set_opens_or_is_refused_in_one_line(intact, tmp_path, where, damage,
                                                             tier):
    root, tokens = intact
    copy = tmp_path / "layers"
    shutil.copytree(root / "layers", copy)
    DAMAGE[damage](copy / where)
    try:
        rt = engram.open(root / "run", engram_layers=copy, tier=tier)
    except UserError as e:
        line = str(e)
        assert "\n" not in line and str(copy) in line, line
        assert Path(where).name in line or "table" in line, line
        return
    assert _greedy(rt) == tokens, (where, damage)  # opened: what it serves is the intact rows
