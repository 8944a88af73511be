"""Trigger tables in tiny random CLIP / BERT / T5 encoders: identity off-trigger, batching, adapter."""

import pytest
import torch

from engram.models.adapter import AdapterMismatch
from engram.models.encoder import (
    eject_triggers,
    inject_triggers,
    load_triggers,
    save_triggers,
    trigger_runtime,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of Zorblax", "a bold handwritten seven", "Zorblax cat on the dog !"]


def _perturb(rt, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in rt.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def _run(enc, tok, prompts, **kw):
    x = tok(prompts, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        return enc(input_ids=x["input_ids"], attention_mask=x["attention_mask"], **kw)


@pytest.mark.parametrize("kind", ["clip", "bert", "t5"])
@pytest.mark.parametrize("table", ["plain", "engram"])
@pytest.mark.parametrize("site", ["last", "layer:0"])
def test_non_trigger_rows_are_bit_identical(new_encoder, new_tokenizer, tiny_tok, kind, table, site):
    enc = new_encoder(kind)
    base = _run(enc, tiny_tok, PROMPTS).last_hidden_state
    rt = inject_triggers(enc, tiny_tok, ["Zorblax"], kind=table, site=site)
    _perturb(rt)
    out = _run(enc, tiny_tok, PROMPTS).last_hidden_state
    assert torch.equal(out[1], base[1])  # no trigger in that prompt: not a bit changes
    member = rt.last_member.any(-1)
    assert not torch.equal(out[0], base[0])
    if site == "last":  # only matched positions move
        assert torch.equal(out[~member], base[~member])
    eject_triggers(enc)
    assert torch.equal(_run(enc, tiny_tok, PROMPTS).last_hidden_state, base)


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_batch_padding_equals_one_by_one(new_encoder, new_tokenizer, tiny_tok, kind):
    """A trigger beside a batch's padding: every row as if it ran alone."""
    enc = new_encoder(kind)
    rt = inject_triggers(enc, tiny_tok, ["Zorblax", "Zorblax cat"], kind="engram", site="last")
    _perturb(rt)
    x = tiny_tok(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        batch = enc(**x).last_hidden_state
        for i, p in enumerate(PROMPTS):
            one = enc(**tiny_tok([p], return_tensors="pt")).last_hidden_state[0]
            n = one.shape[0]
            assert torch.allclose(batch[i, :n], one, atol=1e-5), p


def test_hidden_minus_two_site_leaves_the_rest(new_encoder, new_tokenizer, tiny_tok):
    enc = new_encoder("clip")
    base = _run(enc, tiny_tok, PROMPTS, output_hidden_states=True)
    rt = inject_triggers(enc, tiny_tok, ["Zorblax"], site="hidden:-2")
    _perturb(rt)
    out = _run(enc, tiny_tok, PROMPTS, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, base.last_hidden_state)
    assert torch.equal(out.pooler_output, base.pooler_output)  # pooled: untouched, as the paper
    assert not torch.equal(out.hidden_states[-2][0], base.hidden_states[-2][0])
    assert torch.equal(out.hidden_states[-2][1], base.hidden_states[-2][1])


def test_gradients_reach_only_the_tables(new_encoder, new_tokenizer, tiny_tok):
    enc = new_encoder("bert")
    rt = inject_triggers(enc, tiny_tok, ["Zorblax"], kind="engram")
    x = tiny_tok(PROMPTS, padding=True, return_tensors="pt")
    enc(**x).last_hidden_state.pow(2).sum().backward()
    assert all(p.grad is None for p in enc.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in rt.parameters())


def test_inject_twice_and_inputs_embeds_refused(new_encoder, new_tokenizer, tiny_tok):
    enc = new_encoder("bert")
    inject_triggers(enc, tiny_tok, ["Zorblax"])
    with pytest.raises(ValueError, match="already"):
        inject_triggers(enc, tiny_tok, ["Zorblax"])
    with pytest.raises(ValueError, match="input_ids"):
        enc(inputs_embeds=torch.zeros(1, 3, 16))


@pytest.mark.parametrize("table", ["plain", "engram"])
def test_adapter_round_trip(new_encoder, new_tokenizer, tiny_tok, tmp_path, table):
    enc = new_encoder("clip")
    rt = inject_triggers(enc, tiny_tok, ["Zorblax", "quib"], kind=table, site="layer:1")
    _perturb(rt)
    want = _run(enc, tiny_tok, PROMPTS).last_hidden_state
    save_triggers(enc, tmp_path)
    fresh = new_encoder("clip")
    rt2 = load_triggers(fresh, tiny_tok, tmp_path)
    assert rt2.triggers == ["Zorblax", "quib"] and rt2.options.kind == table
    assert torch.equal(_run(fresh, tiny_tok, PROMPTS).last_hidden_state, want)
    assert trigger_runtime(fresh) is rt2


def test_adapter_refuses_another_encoder_or_tokenizer(new_encoder, new_tokenizer, tiny_tok, tmp_path):
    enc = new_encoder("clip")
    inject_triggers(enc, tiny_tok, ["Zorblax"])
    save_triggers(enc, tmp_path)
    other = new_encoder("clip", seed=5)
    with pytest.raises(AdapterMismatch, match="different weights"):
        load_triggers(other, tiny_tok, tmp_path)
    with pytest.raises(AdapterMismatch, match="another base model"):
        load_triggers(new_encoder("bert"), tiny_tok, tmp_path)
    with pytest.raises(AdapterMismatch, match="tokenizer"):
        load_triggers(new_encoder("clip"), new_tokenizer(words=["zo", "##rb", "##lax", "x"]),
                      tmp_path)
    assert trigger_runtime(other, required=False) is None  # a refused load touches nothing
    with pytest.raises(FileNotFoundError):
        load_triggers(other, tiny_tok, tmp_path / "nothing")
