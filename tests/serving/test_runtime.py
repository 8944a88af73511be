"""The one runtime (serving/runtime.py, serving/loader.py): a run trained on the user's own text
opens with its data deleted, copied elsewhere, from another working directory, and opening writes
nothing; a prompt with a token the run never saw gets the same greedy tokens through every front
door (the runtime's Generator, transformers, the paged engine model, vLLM where installed); a
request longer than the context is refused in one line through transformers as through
`engram generate`."""

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_sim import MiniEngine
from test_hf_export import random_model

from engram.cli import main
from engram.errors import UserError
from engram.serving.generate import GenerationConfig, Generator
from engram.artifacts.export import write as export_model
from engram.serving.hf_export import open_export
from engram.serving.loader import open_model
from engram.serving.paged import PagedLM
from engram.training.prepare import PrepareConfig, prepare
from engram.training.sources import load_documents
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4, table_size=997,
            n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,), warmup=1,
            eval_batches=1, log_every=1, eval_every=2, ckpt_every=2, steps=2)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_an_own_data_run_opens_with_its_data_gone(tmp_path, monkeypatch, capsys):
    text = tmp_path / "work" / "text"
    text.mkdir(parents=True)
    for i, d in enumerate(load_documents("kjv", max_chars=40_000)):
        (text / f"{i:03d}.txt").write_text(d.text)
    monkeypatch.chdir(tmp_path / "work")  # training stores --data as given: a relative path
    prepare(PrepareConfig(out="data", input=["text"], workers=0, val_fraction=0.3),
            progress=False)
    train(TrainConfig(out_dir="run", data="data", **TINY), progress=False)
    before = open_model("run")
    prompt = before.encode("And God said")
    want = Generator(before, config=GenerationConfig(max_new_tokens=5)).generate([prompt]).tokens

    # the run copied elsewhere, the data and the original deleted, opened from another folder
    shutil.copytree(tmp_path / "work" / "run", tmp_path / "copy" / "run")
    shutil.rmtree(tmp_path / "work")
    (tmp_path / "else").mkdir()
    monkeypatch.chdir(tmp_path / "else")
    run = tmp_path / "copy" / "run"
    tree = snapshot(run)
    rt = open_model(run)
    assert Generator(rt, config=GenerationConfig(max_new_tokens=5)).generate([prompt]).tokens \
        == want
    assert main(["generate", str(run), "--prompt", "And God said", "--max-new-tokens", "5",
                 "--no-stop", "--json", "gen.json"]) == 0
    assert json.loads(Path("gen.json").read_text())["tokens"] == want
    (tmp_path / "else" / "doc.txt").write_text("In the beginning God created the heaven.\n\n"
                                               "And the earth was without form.")
    assert main(["eval", str(run), "--text", "doc.txt", "--json", "eval.json"]) == 0
    assert np.isfinite(json.loads(Path("eval.json").read_text())["loss"])
    assert main(["export-hf", str(run), "hf"]) == 0
    assert snapshot(run) == tree  # opening, generating, scoring and exporting wrote nothing
    capsys.readouterr()

    # the export: same greedy tokens, and the run's own tokenizer and compression travel with it
    exp = open_model("hf")
    assert Generator(exp, config=GenerationConfig(max_new_tokens=5)).generate([prompt]).tokens \
        == want
    assert np.array_equal(exp.hasher.compression.lookup, rt.hasher.compression.lookup)
    from engram.studies.harness import EngramHarnessLM

    lm = EngramHarnessLM(pretrained="hf")
    ll = lm.loglikelihood_rolling([SimpleNamespace(args=("In the beginning God created",))])
    per_doc = rt.score_documents([rt.encode("In the beginning God created")], rt.eos_id, 32)
    assert ll[0] == pytest.approx(per_doc[0]["loglikelihood"], rel=1e-5)

    # a file tier needs table files: the library refuses, the explicit step writes them
    with pytest.raises(UserError, match="engram export-tables"):
        open_model(run, tier="file")
    assert main(["export-tables", str(run)]) == 0
    assert main(["generate", str(run), "--prompt", "And God said", "--max-new-tokens", "5",
                 "--no-stop", "--tier", "file", "--json", "file.json"]) == 0
    assert json.loads(Path("file.json").read_text())["tokens"] == want


def test_a_run_without_model_files_is_refused_in_one_line(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="no checkpoint under"):
        open_model(tmp_path / "run")
    train(TrainConfig(out_dir=str(tmp_path / "old"), max_chars=20_000, **TINY), progress=False)
    maps = tmp_path / "old" / "model" / "maps.safetensors"
    written = maps.stat().st_mtime_ns
    train(TrainConfig(out_dir=str(tmp_path / "old"), max_chars=20_000, **{**TINY, "steps": 4}),
          progress=False)
    assert maps.stat().st_mtime_ns == written  # a resume keeps the files (no second count)
    assert open_model(tmp_path / "old").checkpoint == "step_00000004.safetensors"
    shutil.rmtree(tmp_path / "old" / "model")  # as a run trained before runs kept them
    with pytest.raises(UserError, match="no model/model.json.*resume it once"):
        open_model(tmp_path / "old")


@pytest.fixture(scope="module")
def export(tmp_path_factory, deepseek):
    model, hasher, vocab, counts = random_model(deepseek)
    out = export_model(model, hasher, vocab, tmp_path_factory.mktemp("rt") / "m", counts=counts)
    unseen = int(np.setdiff1d(np.arange(1000, 60000), vocab)[7])
    prompt = [int(vocab[3]), int(vocab[40]), unseen, int(vocab[9]), int(vocab[100])]
    return out, prompt


def test_a_token_the_run_never_saw_gets_one_answer_through_every_front_door(export):
    out, prompt = export
    rt = open_export(out)
    with pytest.warns(UserWarning, match="never occurred in training"):
        want = Generator(rt, config=GenerationConfig(max_new_tokens=6)).generate([prompt]).tokens[0]
    # the paged engine model (vLLM's, on a minimal engine)
    eng = MiniEngine(PagedLM(open_export(out)), block_size=4, chunk=3)
    eng.add(prompt, 6)
    with pytest.warns(UserWarning, match="never occurred in training"):
        while eng.step():
            pass
    assert eng.reqs[0]["out"] == want
    # transformers
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from engram.serving.hf_model import EngramLMForCausalLM

    hf = EngramLMForCausalLM.from_pretrained(out)
    with pytest.warns(UserWarning, match="never occurred in training"):
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert got[0, len(prompt):].tolist() == want
    # vLLM, where its venv is present
    import test_vllm

    if test_vllm.VLLM_PYTHON is not None:
        res = test_vllm.run_vllm(out, [prompt], out.parent, "unseen", max_new=6)
        assert res["tokens"][0] == want


def test_a_request_longer_than_the_context_is_one_line_everywhere(export):
    out, prompt = export
    rt = open_export(out)
    n = rt.max_seq_len
    with pytest.raises(UserError, match=f"a prompt of 100 tokens with max_new_tokens=11 needs "
                                        f"110 positions; the model has max_seq_len={n}"):
        Generator(rt, config=GenerationConfig(max_new_tokens=11)).generate([prompt * 20])
    assert rt.fit_prompts([prompt * 20], 11, cut=True) == [(prompt * 20)[-(n - 10):]]
    with pytest.raises(UserError, match=f"max_new_tokens={n + 1} leaves no room"):
        rt.fit_prompts([prompt], n + 1)
    pytest.importorskip("transformers")
    from engram.serving.hf_model import EngramLMForCausalLM

    hf = EngramLMForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=f"max_seq_len={n}"):
        hf.generate(torch.tensor([prompt]), max_new_tokens=n + 5, do_sample=False)


def test_options_that_would_do_nothing_are_refused(export):
    out, _ = export
    for kw in ({"cache_fraction": 0.1}, {"prefetch": True}):
        with pytest.raises(UserError, match="on the memory tier they would do nothing"):
            open_model(out, **kw)
    assert os.path.isdir(out)
