"""Memory-only fine-tuning vs LoRA, end to end on a tiny random Llama with a real BPE tokenizer."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from engram.cli import main  # noqa: E402
from engram.models.hf import engram_runtime  # noqa: E402
from engram.training.corpus import load_documents  # noqa: E402
from engram.studies.finetune import (  # noqa: E402
    FinetuneStudyConfig,
    eval_windows,
    lora_params_per_rank,
    run_finetune,
    run_study,
    token_streams,
)


def tiny_llama(vocab):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_token_streams_split_and_windows(tok):
    s = token_streams(tok, "kjv", 60_000, 0.2)
    eos = tok.eos_token_id
    # Every document ends with EOS, and the held-out documents are exactly the ones not trained on.
    assert s["train"][-1] == eos and s["val"][-1] == eos
    assert (s["train"] == eos).sum() + (s["val"] == eos).sum() == (s["all"] == eos).sum()
    w = eval_windows(s["val"], 5, 16)
    assert w.shape == (5, 17) and w.dtype == torch.int64
    assert torch.equal(w[0], torch.from_numpy(s["val"][:17]))
    assert torch.equal(w[-1], torch.from_numpy(s["val"][-17:]))  # spread to the very end


def test_memory_only_finetune_vs_lora(tok, tmp_path):
    model = tiny_llama(len(tok))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = FinetuneStudyConfig(
        out_dir=str(tmp_path), forget_sources=("peoples-daily",), max_chars=40_000, steps=10,
        warmup=2, seq_len=32, batch_size=4, eval_windows=6, engram_layers=(0, 1), table_size=300,
        n_embed_per_ngram=16, n_head_per_ngram=2, engram_lr=1e-2, lora_lr=1e-2, log_every=4)
    summary = run_finetune(cfg, model, tok)

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["before"] == summary["before"]
    assert (tmp_path / "finetune.png").stat().st_size > 10_000
    sets = ["finetune:kjv", "forget:peoples-daily"]
    assert list(summary["before"]) == sets
    eng, lora = summary["methods"]["engram"], summary["methods"]["lora"]
    # Trainable counts: Engram's are its tables plus dense parts; LoRA's rank matches that count.
    assert eng["trainable_params"] == eng["table_params"] + eng["dense_params"]
    assert 0 < eng["touched_rows"] <= eng["table_rows"]
    per_rank = lora_params_per_rank(model, cfg.lora_targets)
    assert lora["trainable_params"] == lora["rank"] * per_rank
    assert abs(lora["trainable_params"] - eng["trainable_params"]) <= per_rank / 2
    for m in (eng, lora):
        assert len(m["curve"]) == cfg.steps and m["train_seconds"] > 0
        assert set(m["after"]) == set(sets)
        assert m["after"]["finetune:kjv"] < summary["before"]["finetune:kjv"]  # both learn
        assert m["delta"]["finetune:kjv"] == pytest.approx(
            m["after"]["finetune:kjv"] - summary["before"]["finetune:kjv"])
    # The base comes back untouched, with neither Engram nor LoRA left in it.
    assert engram_runtime(model, required=False) is None
    assert not any("lora" in n or "engram" in n for n, _ in model.named_modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())


def test_same_batches_for_every_method():
    from engram.studies.finetune import train_batch

    cfg = FinetuneStudyConfig(seq_len=8, batch_size=3)
    stream = np.arange(1000)
    assert torch.equal(train_batch(stream, 5, cfg, 0), train_batch(stream, 5, cfg, 0))
    assert not torch.equal(train_batch(stream, 5, cfg, 0), train_batch(stream, 6, cfg, 0))
    assert not torch.equal(train_batch(stream, 5, cfg, 0), train_batch(stream, 5, cfg, 1))


def test_both_methods_follow_train_s_schedule():
    """One schedule: finetune's rates are engram train's for the same steps, warmup and floor."""
    from engram.studies.finetune import MIN_LR_RATIO, loop_config
    from engram.training.loop import lr_at
    from engram.training.train import TrainConfig

    cfg = FinetuneStudyConfig(steps=40, warmup=5)
    for lr in (cfg.engram_lr, cfg.lora_lr):
        train = TrainConfig(steps=40, warmup=5, lr=lr, min_lr_ratio=MIN_LR_RATIO)
        assert [lr_at(s, loop_config(cfg, lr)) for s in range(41)] == \
            [lr_at(s, train) for s in range(41)]
    assert lr_at(39, loop_config(cfg, 1.0)) == pytest.approx(MIN_LR_RATIO, abs=2e-3)


def test_cli_errors_and_help(capsys):
    for argv in (["--no_such_option=1"], ["--lora_rnak", "8"]):
        with pytest.raises(SystemExit) as e:  # argparse's usage error
            main(["finetune-study", *argv])
        assert e.value.code == 2
    assert "did you mean --lora_rank" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # not one of the valid values: argparse, one line
        main(["finetune-study", "--methods=engram,full"])
    assert e.value.code == 2 and "(choose from engram, lora)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["finetune-study", "--help"])
    assert e.value.code == 0
    assert "lora_rank" in capsys.readouterr().out


def test_study_over_seeds_on_a_prepared_corpus(tok, tmp_path):
    """--data (a folder prepared with the model's tokenizer) and two seeds: each seed's run kept in
    seedN/, the spread and the verdicts over them; a rerun reads the finished seeds back."""
    from hf_models import model_and_corpus

    model_and_corpus(tmp_path, "llama", tok)
    cfg = FinetuneStudyConfig(
        out_dir=str(tmp_path / "study"), model=str(tmp_path / "model"), data=str(tmp_path / "corpus"),
        seeds=(0, 1), forget_sources=("peoples-daily",), max_chars=20_000, steps=4, warmup=1,
        seq_len=16, batch_size=2, eval_windows=4, engram_layers=(0, 1), table_size=300,
        n_embed_per_ngram=16, n_head_per_ngram=2, engram_lr=1e-2, lora_lr=1e-2)
    study = run_study(cfg)
    assert study["seeds"] == [0, 1] and study["finetune_set"] == "finetune:corpus"
    for m in ("engram", "lora"):
        g = study["methods"][m]["gain"]
        assert len(g["per_seed"]) == 2 and g["spread"] == pytest.approx(
            max(g["per_seed"]) - min(g["per_seed"]))
        assert g["per_seed"][0] != g["per_seed"][1]  # the seed changes batches and inits
    v = study["verdicts"]["gain"]
    assert v["engram_minus_lora"] == pytest.approx(
        study["methods"]["engram"]["gain"]["mean"] - study["methods"]["lora"]["gain"]["mean"])
    assert v["verdict"].startswith(("resolved", "not resolved"))
    assert set(study["verdicts"]) == {"gain", "forgetting:forget:peoples-daily",
                                      "tokens_per_cpu_second"}
    assert (tmp_path / "study" / "finetune.png").stat().st_size > 10_000
    seed0 = (tmp_path / "study" / "seed0" / "results.json").read_text()
    again = run_study(cfg)  # finished seeds are read back, not trained again
    assert (tmp_path / "study" / "seed0" / "results.json").read_text() == seed0
    assert again["methods"] == study["methods"]


def test_study_refuses_a_corpus_of_another_tokenizer(tok, tmp_path):
    from engram.errors import UserError
    from engram.training.prepare import PrepareConfig, prepare

    tiny_llama(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "text").mkdir()
    for i, d in enumerate(load_documents("kjv", max_chars=20_000)[:20]):
        (tmp_path / "text" / f"{i}.txt").write_text(d.text)
    prepare(PrepareConfig(out=str(tmp_path / "corpus"), input=[str(tmp_path / "text")],
                          workers=0, val_fraction=0.5), progress=False)  # DeepSeek's tokenizer
    cfg = FinetuneStudyConfig(out_dir=str(tmp_path / "study"), model=str(tmp_path / "model"),
                              data=str(tmp_path / "corpus"))
    with pytest.raises(UserError, match="another tokenizer"):
        run_study(cfg)
