"""A self-contained adapter (base model named + Engram + tokenizer) served by the one runtime:
engram.open / Generator / score give what transformers gives on base + injected Engram, for each
family; another base model, and a file tier, are refused in one line."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import engram  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.errors import UserError  # noqa: E402
from engram.artifacts.adapter import from_pretrained  # noqa: E402
from engram.models.adapter import AdapterMismatch  # noqa: E402
from engram.serving.generate import GenerationConfig, Generator  # noqa: E402
from hf_models import make_adapter, tiny_model  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt2")
PROMPTS = ["In the beginning God created the heaven", "And the earth was", "Let there be light"]
NEW = 10


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_equals_transformers(family, tok, tmp_path):
    adapter = make_adapter(tmp_path, family, tok)
    rt = engram.open(adapter)
    hf, hf_tok = from_pretrained(adapter)
    prompts = [rt.encode(p) for p in PROMPTS]  # three lengths: the Generator merges groups
    assert prompts[0] == hf_tok(PROMPTS[0], add_special_tokens=False).input_ids
    # Scoring: the runtime's logits are transformers' logits.
    raw = torch.tensor([prompts[0]])
    with torch.no_grad():
        ours = rt.raw_logits(rt.forward(raw).hidden)
        theirs = hf(raw).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # Greedy decoding, batched with merging groups: the same tokens as transformers' generate.
    out = Generator(rt, config=GenerationConfig(max_new_tokens=NEW)).generate(prompts)
    for p, got in zip(prompts, out.tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
        assert got == ref[0, len(p):].tolist()
    # A row that stops early leaves the batch (the KV cache and conv states drop its row): the
    # others go on exactly as before.
    stop = out.tokens[1][2]
    cut = Generator(rt, config=GenerationConfig(max_new_tokens=NEW, stop_ids=(stop,)))
    for full, got in zip(out.tokens, cut.generate(prompts).tokens):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:end]


def test_engram_generate_command_equals_transformers(tok, tmp_path, capsys):
    adapter = make_adapter(tmp_path, "llama", tok)
    out = tmp_path / "gen.json"
    assert main(["generate", str(adapter), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                 "--max_new_tokens", str(NEW), "--no-stop", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["tokens"]
    hf, hf_tok = from_pretrained(adapter)
    for text, tokens in zip(PROMPTS, got):
        ids = hf_tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
        assert tokens == ref[0, ids.shape[1]:].tolist()


def test_another_base_and_file_tier_are_refused(tok, tmp_path):
    adapter = make_adapter(tmp_path, "llama", tok)
    other = tiny_model("llama", len(tok), seed=5)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterMismatch, match="another base model"):
        from_pretrained(adapter, base=str(tmp_path / "other"))
    with pytest.raises(UserError, match="holds no current table files of the adapter .* write "
                       "them with `engram export-tables"):
        engram.open(adapter, tier="file")
    # The base folder the adapter names now holds other weights: refused, not served wrongly.
    other.save_pretrained(tmp_path / "base")
    with pytest.raises(AdapterMismatch, match="another base model"):
        engram.open(adapter)
    assert "\n" not in str(AdapterMismatch)  # one line: the CLI prints UserError as is
