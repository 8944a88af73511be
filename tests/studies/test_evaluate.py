"""`engram eval`: the loss of a trained run on any text, unseen tokens as context only."""

import json

import numpy as np
import pytest
import torch

from engram.cli import main
from engram.serving.loader import open_model
from engram.serving.runtime import windows
from engram.training.batches import val_batches
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=2, ckpt_every=2)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    train(TrainConfig(out_dir=str(out), steps=2, **TINY), progress=False)
    return out


def test_windows_cover_every_target_once():
    for n, t in ((2, 5), (33, 32), (100, 32), (65, 32)):
        spans = windows(n, t)
        assert sum(length for _, length in spans) == n - 1
        assert all(s + length <= n - 1 for s, length in spans) and max(x for _, x in spans) <= t


def test_known_text_equals_the_validation_loss(run_dir):
    """On text the run knows, eval is the training code's own validation sweep."""
    served = open_model(run_dir)
    from engram.training.corpus import build_corpus

    corpus = build_corpus(TrainConfig(**TINY).data_config())
    seq = TINY["seq_len"]
    raw = corpus.val[: 9 * seq + 1].astype(np.int64)  # whole windows: the sweeps coincide
    res = served.score(raw, seq, batch_size=4)
    total = n = 0
    with torch.no_grad():
        for b in val_batches(raw, 4, seq, corpus, served.hasher):
            total += float(served.model.token_nll(served.model(b.inputs, b.hash_ids),
                                                  b.targets).sum())
            n += b.targets.numel()
    assert res["left_out"] == 0 and res["scored"] == n == 9 * seq
    assert res["loss"] == pytest.approx(total / n, rel=1e-5)


def test_unseen_tokens_are_context_not_targets(run_dir, tmp_path):
    served = open_model(run_dir)
    text = tmp_path / "t.txt"
    text.write_text("In the beginning ᚠᛇᚻ God created ☃ the heaven.\n\nAnd the earth 🜁 was void.")
    js = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--text", str(text), "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    raw = served.tokenizer.encode("In the beginning ᚠᛇᚻ God created ☃ the heaven.").ids
    unseen = served.ids.to_local(torch.tensor(raw)).numpy() < 0
    assert unseen.any()  # the runes and the snowman are not in the run's vocabulary
    assert res["left_out"] >= int(unseen.sum()) and res["scored"] + res["left_out"] == \
        res["targets"] == res["tokens"] - 1 and res["documents"] == 2
    assert np.isfinite(res["loss"]) and res["unseen_ids"] >= 1
    # An unseen token leaves the loss of the targets before it untouched (causal context only).
    first = int(np.argmax(unseen))
    prefix = np.asarray(raw[:first + 1])
    a = served.score(prefix, 32)
    b = served.score(np.asarray(raw[:first]), 32)
    assert a["left_out"] == 1 and a["scored"] == b["scored"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_bad_input_is_a_clear_error(run_dir, tmp_path, capsys):
    assert main(["eval", str(run_dir)]) == 2
    assert "exactly one of --text" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "norun"), "--source", "kjv"]) == 2
