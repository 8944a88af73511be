"""`engram lm-eval`: lm-evaluation-harness's own command line scores an export through the model type
`engram`, on local task files (tests/data/lm_eval: no hub). Per document its rolling
log-likelihoods equal `engram eval --per_document`'s on the same run; multiple-choice scores equal
the transformers model's logits; generations equal `engram generate`'s greedy tokens."""

import json

import numpy as np
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from engram.cli import main  # noqa: E402
from lm_eval_run import TASKS, lm_eval_samples  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    from engram.training.train import TrainConfig, train

    root = tmp_path_factory.mktemp("lm_eval")
    train(TrainConfig(out_dir=str(root / "run"), steps=2, n_layer=2, d_model=32, n_head=2,
                      seq_len=32, batch_size=2, table_size=500, max_chars=200_000, eval_every=2,
                      eval_batches=1, warmup=1), progress=False)
    assert main(["export-hf", str(root / "run"), str(root / "hf")]) == 0
    return root / "run", root / "hf"


def test_rolling_loglikelihoods_equal_engram_eval(run_and_export, tmp_path, monkeypatch,
                                                   capsys):
    run, out = run_and_export
    samples, results = lm_eval_samples(f"pretrained={out},tier=file", tmp_path, monkeypatch,
                                         "engram_docs")
    got = [float(s["resps"][0][0]) for s in samples["engram_docs"]]  # logged as text
    docs = [json.loads(line)["text"] for line in open(TASKS / "docs.jsonl")]
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(docs))  # paragraphs are engram eval's documents
    capsys.readouterr()
    assert main(["eval", str(run), "--text", str(text), "--per_document", "--batch_size", "4",
                 "--json", str(tmp_path / "eval.json")]) == 0
    want = [d["loglikelihood"] for d in json.load(open(tmp_path / "eval.json"))["per_document"]]
    assert len(got) == len(docs) == 6
    assert got == want  # the same windows, batches and arithmetic: equal to the bit
    assert all(np.isfinite(got)) and len(set(got)) == len(got)
    ppl = results["results"]["engram_docs"]["word_perplexity,none"]
    words = sum(len(d.split()) for d in docs)
    assert ppl == pytest.approx(np.exp(-sum(want) / words), rel=1e-9)


def test_choices_and_generations(run_and_export, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from engram.serving.generate import GenerationConfig, Generator
    from engram.serving.loader import open_model

    run, out = run_and_export
    samples, _ = lm_eval_samples(f"pretrained={out},tier=file", tmp_path, monkeypatch,
                                 "engram_choice,engram_gen")
    m = AutoModelForCausalLM.from_pretrained(out)
    served = open_model(run)
    tok = served.tokenizer
    for s in samples["engram_choice"]:  # loglikelihood requests: context, continuation
        for args, resp in zip(s["arguments"].values(), s["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx = tok.encode(context, add_special_tokens=False).ids
            whole = tok.encode(context + continuation, add_special_tokens=False).ids
            with torch.no_grad():
                logp = m(torch.tensor([whole])).logits[0].log_softmax(-1)  # [s, W]
            want = sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
            assert float(resp[0][0]) == pytest.approx(want, rel=1e-5, abs=1e-4)
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    gen = Generator(served.model, served.hasher, served.vocab,
                    GenerationConfig(max_new_tokens=6, stop_ids=(eos,)))
    for s in samples["engram_gen"]:
        prompt = tok.encode(s["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False).ids
        text = tok.decode(gen.generate([prompt]).tokens[0], skip_special_tokens=True)
        for stop in ("\n", ".", ":"):
            text = text.split(stop)[0]
        assert s["resps"][0][0] == text


def test_unknown_tier_is_a_clear_error(run_and_export, capsys):
    _, out = run_and_export
    rc = main(["lm-eval", "--model_args", f"pretrained={out},tier=nvme", "--tasks", "engram_docs",
               "--include_path", str(TASKS)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "engram lm-eval: error: engram_serving.tier must be one of" in err and "'nvme'" in err


def test_rolling_windows_score_each_target_once():
    from engram.serving.runtime import rolling_windows

    for n in range(2, 40):
        for seq_len in (1, 3, 8):
            covered = []
            for start, t, k in rolling_windows(n, seq_len):
                assert t <= seq_len and k <= t and (start == 0 or t == seq_len)
                covered += list(range(start + t - k + 1, start + t + 1))  # targets scored
            assert covered == list(range(1, n))


def test_a_finetuned_adapter_scores_as_engram_eval(tok, tmp_path, monkeypatch, capsys):
    """`engram finetune`'s folder (here: random memory on a tiny llama) through lm-eval: the same
    rolling log-likelihoods as `engram eval` on it."""
    from hf_models import make_adapter

    adapter = make_adapter(tmp_path, "llama", tok)
    samples, _ = lm_eval_samples(f"pretrained={adapter},max_length=64", tmp_path, monkeypatch,
                                 "engram_docs")
    got = [float(r["resps"][0][0]) for r in samples["engram_docs"]]
    docs = [json.loads(line)["text"] for line in open(TASKS / "docs.jsonl")]
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(docs))
    capsys.readouterr()
    assert main(["eval", str(adapter), "--text", str(text), "--per_document", "--batch_size", "4",
                 "--seq_len", "64", "--json", str(tmp_path / "eval.json")]) == 0
    want = [d["loglikelihood"] for d in json.load(open(tmp_path / "eval.json"))["per_document"]]
    assert got == want and len(got) == 6 and all(np.isfinite(got))
    rc = main(["lm-eval", "--model_args", f"pretrained={adapter},tier=file", "--tasks",
               "engram_docs", "--include_path", str(TASKS)])
    assert rc == 2 and "without table files for tier=file: write them with `engram " \
        "export-tables" in capsys.readouterr().err
