"""transformers on an `engram export-hf` directory: AutoModelForCausalLM loads it on every tier with
no trust_remote_code, generate() gives `engram generate`'s greedy tokens (one by one, and in
left-padded batches, beam search too), save_pretrained round-trips, and bad input is refused."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_hf_export import prompts, random_model, reference

from engram.artifacts.export import write as export_model

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from engram.serving.hf_model import EngramCache, EngramLMForCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 6
TIERS = [{}, {"tier": "file", "cache_fraction": 0.05, "prefetch": True}, {"tier": "pinned"},
         {"tier": "shared"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, deepseek):
    model, hasher, vocab, counts = random_model(deepseek)
    out = export_model(model, hasher, vocab, tmp_path_factory.mktemp("hf") / "m", counts=counts,
                       tag="test")
    ps = prompts(vocab, 8, seed=2, lo=1, hi=30)
    return out, ps, reference(model, hasher, vocab, ps, MAX_NEW), (model, hasher, vocab)


def left_padded(ps, pad=0):
    width = max(map(len, ps))
    ids = torch.full((len(ps), width), pad)
    mask = torch.zeros(len(ps), width, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def greedy(m, ps, max_new=MAX_NEW, **kw):
    """One left-padded batch through generate(); the new tokens of each row."""
    ids, mask = left_padded(ps)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                     eos_token_id=None, pad_token_id=0, **kw)
    return [r[ids.shape[1]:].tolist() for r in out]


@pytest.mark.parametrize("serving", TIERS, ids=["memory", "file-cache-prefetch", "pinned",
                                                "shared"])
def test_auto_model_on_every_tier_generates_engram_generate_s_tokens(exported, serving):
    out, ps, want, _ = exported
    m = AutoModelForCausalLM.from_pretrained(out, engram_serving=serving)
    assert isinstance(m, EngramLMForCausalLM)
    assert m.config.engram_serving["tier"] == serving.get("tier", "memory")
    assert [greedy(m, [p])[0] for p in ps] == want  # one by one
    assert greedy(m, ps) == want  # one left-padded batch
    assert len({tuple(w) for w in want}) > 3  # the tokens depend on the prompt


def test_generate_keeps_our_cache_and_beam_search_reorders_it(exported):
    out, ps, _, _ = exported
    m = AutoModelForCausalLM.from_pretrained(out)
    ids, mask = left_padded(ps[:3])
    res = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                     eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    cache = res["cache"] if "cache" in res else res["past_key_values"]
    assert isinstance(cache, EngramCache)
    assert cache.get_seq_length() == ids.shape[1] + 2  # the last token is not fed back
    beams = [m.generate(torch.tensor([p]), max_new_tokens=4, num_beams=3, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in ps[:3]]
    batch = m.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    assert [r[ids.shape[1]:].tolist() for r in batch] == beams


def test_forward_equals_the_model_s_full_forward(exported):
    """A padded forward (left or right, no cache): each row's logits are EngramLM's full forward
    of that row alone, scattered to the tokenizer's ids; the loss is the mean token NLL."""
    out, ps, _, (model, hasher, vocab) = exported
    m = AutoModelForCausalLM.from_pretrained(out)
    local = {int(r): i for i, r in enumerate(vocab)}
    ids, mask = left_padded(ps[:4])
    right_ids, right_mask = ids.clone(), mask.clone()
    for i, p in enumerate(ps[:4]):  # the same rows, padded on the right
        right_ids[i] = torch.cat([torch.tensor(p), torch.zeros(ids.shape[1] - len(p),
                                                               dtype=torch.long)])
        right_mask[i] = (torch.arange(ids.shape[1]) < len(p)).long()
    with torch.no_grad():
        left = m(ids, attention_mask=mask, use_cache=False).logits
        right = m(right_ids, attention_mask=right_mask, use_cache=False,
                  labels=torch.where(right_mask.bool(), right_ids, -100))
        for i, p in enumerate(ps[:4]):
            x = torch.tensor([p])
            full = model(torch.tensor([[local[t] for t in p]]), hasher.hash(x))
            want = full.logits[0]  # [s, V]
            assert torch.allclose(left[i, -len(p):][:, torch.as_tensor(vocab)], want, atol=1e-5)
            assert torch.allclose(right.logits[i, :len(p)][:, torch.as_tensor(vocab)], want,
                                  atol=1e-5)
            assert bool(torch.isinf(left[i, -1]).sum() == left.shape[-1] - len(vocab))
    nll, n = 0.0, 0
    with torch.no_grad():
        for p in [p for p in ps[:4] if len(p) > 1]:
            full = model(torch.tensor([[local[t] for t in p]]), hasher.hash(torch.tensor([p])))
            y = torch.tensor([[local[t] for t in p[1:]] + [-100]])
            nll += float(model.token_nll(full, y).sum())
            n += len(p) - 1
    assert float(right.loss) == pytest.approx(nll / n, rel=1e-5)


def test_save_pretrained_round_trips(exported, tmp_path):
    out, ps, want, _ = exported
    m = AutoModelForCausalLM.from_pretrained(out, engram_serving={"tier": "file",
                                                                  "cache_fraction": 0.05})
    m.save_pretrained(tmp_path / "again")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert back.config.engram_serving["tier"] == "file"  # saved as it was loaded
    assert back.config.engram_serving["cache_fraction"] == 0.05  # the row counts came along
    ids, mask = left_padded(ps)
    with torch.no_grad():
        a = m(ids, attention_mask=mask, use_cache=False).logits
        b = back(ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(a, b)
    assert greedy(back, ps) == want
    with pytest.raises(ValueError, match="loaded from"):
        back.save_pretrained(tmp_path / "again")


def test_from_config_builds_a_fresh_model(exported):
    config = AutoConfig.from_pretrained(exported[0])
    m = AutoModelForCausalLM.from_config(config)
    assert isinstance(m, EngramLMForCausalLM)
    with torch.no_grad():
        logits = m(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, config.vocab_size) and torch.isfinite(logits[..., :10]).all()


def test_import_engram_registers_without_importing_transformers(exported):
    """`import engram` leaves transformers alone; the Auto classes learn engram_lm when
    transformers loads them, in either order."""
    out = exported[0]
    code = ("import sys, engram; assert 'transformers' not in sys.modules, 'eager import'\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
            "print(type(m).__name__)")
    reverse = ("from transformers import AutoConfig, AutoModelForCausalLM\n"
               f"AutoConfig.from_pretrained  # loaded before engram\nimport engram\n"
               f"print(type(AutoModelForCausalLM.from_pretrained({str(out)!r})).__name__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for src in (code, reverse):
        done = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "EngramLMForCausalLM"


def test_bad_input_is_refused_with_a_clear_error(exported, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(exported[0], out)
    with pytest.raises(ValueError, match="tier must be one of"):
        AutoModelForCausalLM.from_pretrained(out, engram_serving={"tier": "nvme"})
    (out / "tables" / "layer1.table").unlink()
    for tier in ("memory", "file", "shared"):
        with pytest.raises(FileNotFoundError, match="missing a table file.*layer1"):
            EngramLMForCausalLM.from_pretrained(out, engram_serving={"tier": tier})
    # a tier whose files cannot be opened here: the table path is a directory
    (out / "tables" / "layer1.table").mkdir()
    with pytest.raises(RuntimeError, match="tier='file'.*could not be opened on this machine"):
        EngramLMForCausalLM.from_pretrained(out, engram_serving={"tier": "file"})
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="'llama' model, not an engram export"):
        EngramLMForCausalLM.from_pretrained(other)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        EngramLMForCausalLM.from_pretrained(tmp_path / "nowhere")
    m = AutoModelForCausalLM.from_pretrained(exported[0])
    with pytest.raises(ValueError, match="left padding"):
        m.generate(torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]),
                   max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="input_ids"):
        m(inputs_embeds=torch.zeros(1, 2, m.config.hidden_size))


def test_a_trained_run_generates_engram_generate_s_tokens(tmp_path, capsys):
    """`engram export-hf` of a real (tiny) run, loaded with AutoTokenizer and
    AutoModelForCausalLM: greedy text continuations (stopping at EOS) equal `engram generate`'s,
    in one left-padded batch and through a text-generation pipeline."""
    from transformers import AutoTokenizer, pipeline

    from engram.cli import main
    from engram.training.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=2, n_layer=2, d_model=32, n_head=2, seq_len=32,
                      batch_size=2, table_size=500, max_chars=200_000, eval_every=2,
                      eval_batches=1, warmup=1), progress=False)
    assert main(["export-hf", str(run), str(tmp_path / "hf"), "--tier", "file"]) == 0
    texts = ["In the beginning God created the heaven and the earth.", "And God said", "And"]
    args = ["generate", "--run", str(run), "--max_new_tokens", "5", "--json",
            str(tmp_path / "gen.json")]
    assert main(args + [a for t in texts for a in ("--prompt", t)]) == 0
    want = json.loads((tmp_path / "gen.json").read_text())["tokens"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    tok.padding_side = "left"
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    out = m.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    eos = m.config.eos_token_id
    for row, w in zip(out[:, batch["input_ids"].shape[1]:].tolist(), want):
        assert row[:len(w)] == w and all(t == eos for t in row[len(w):])
    pipe = pipeline("text-generation", model=m, tokenizer=tok)
    got = pipe(texts[1], max_new_tokens=5, do_sample=False, return_full_text=False,
               add_special_tokens=False)
    assert got[0]["generated_text"] == tok.decode(want[1], skip_special_tokens=True)


def test_peft_lora_trains_on_top(exported):
    """LoRA (PEFT) on the attention projections of the loaded model: labels give a loss that
    training lowers, through padded rows, while the model's own weights stay as loaded."""
    peft = pytest.importorskip("peft")
    out, ps, _, _ = exported
    m = AutoModelForCausalLM.from_pretrained(out)
    before = {k: v.clone() for k, v in m.lm.state_dict().items()}
    lora = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = left_padded(ps[:4])
    labels = torch.where(mask.bool(), ids, -100)
    losses = []
    for _ in range(4):
        loss = lora(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    merged = lora.merge_and_unload()
    assert not torch.equal(merged.lm.blocks[0].attn.qkv.weight, before["blocks.0.attn.qkv.weight"])
    assert torch.equal(merged.lm.embed.weight, before["embed.weight"])
