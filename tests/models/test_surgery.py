"""Interventions for ablations and analyses: forced gates, zeroed output, fixed gate, shared key,
hidden-state capture. Real tiny models, compared against what the intervention must equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import engram
from engram.models.model import EngramLM, ModelConfig
from engram.models.surgery import captured_hidden, engram_zeroed, forced_gate

pytestmark = pytest.mark.usefixtures("one_thread")
V, B, T = 97, 2, 12


def make(trained: bool = True, **kw) -> tuple[EngramLM, dict]:
    ecfg = engram.EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3,
                               n_embed_per_ngram=16, n_head_per_ngram=4, layer_ids=[1], pad_id=0)
    torch.manual_seed(0)
    model = EngramLM(ModelConfig(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=64,
                                 engram=ecfg, table_init_std=1.0, **kw)).eval()
    if trained:  # nonzero conv and biases, as after training
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, V, (B, T))
    ids = engram.NgramHasher(ecfg, np.arange(300) % 250).hash(tokens)
    return model, {"tokens": tokens, "ids": ids}


def run(model, x, gates=False):
    return model(x["tokens"], x["ids"], return_gates=gates)


def test_gate_forced_to_zero_equals_the_zeroed_output_and_restores():
    model, x = make()
    full = run(model, x).hidden
    with engram_zeroed(model):
        zeroed = run(model, x, gates=True)
    with forced_gate(model, 0.0):
        g0 = run(model, x, gates=True)
    assert torch.equal(g0.gates[1], torch.zeros_like(g0.gates[1]))
    torch.testing.assert_close(g0.hidden, zeroed.hidden, rtol=0, atol=1e-6)
    assert not torch.allclose(zeroed.hidden, full)  # the memory did something
    assert torch.equal(run(model, x).hidden, full)  # both contexts undo themselves


def test_zeroed_equals_no_engram_and_zero_table_equals_zeroed_at_init():
    model, x = make(trained=False)  # at init the biases are zero: a zero row adds exactly nothing
    with engram_zeroed(model):
        zeroed = run(model, x).hidden
    with torch.no_grad():
        model.blocks[1].engram.table.weight.zero_()
    torch.testing.assert_close(run(model, x).hidden, zeroed, rtol=0, atol=1e-6)
    # ... and the suppressed model is the backbone alone (the block skips nothing else).
    eng = model.blocks[1].engram
    model.blocks[1].engram = None
    try:
        torch.testing.assert_close(run(model, x).hidden, zeroed, rtol=0, atol=1e-6)
    finally:
        model.blocks[1].engram = eng


def test_gate_forced_to_one_for_both_gate_kinds():
    for gate in ("demo", "paper"):
        model, x = make(engram_gate=gate)
        with forced_gate(model, 1.0):
            out = run(model, x, gates=True)
        assert torch.equal(out.gates[1], torch.ones_like(out.gates[1])), gate
    with pytest.raises(ValueError, match="0 or 1"):
        with forced_gate(model, 0.5):
            pass


def test_fixed_gate_model_has_no_keys_and_gate_one(tmp_path):
    model, x = make(engram_fixed_gate=True)
    out = run(model, x, gates=True)
    assert torch.equal(out.gates[1], torch.ones_like(out.gates[1]))
    names = [n for n, _ in model.named_parameters()]
    assert not any("key_projs" in n or "norm1" in n or "norm2" in n for n in names)
    ref, _ = make()
    with forced_gate(ref, 1.0):  # same weights where they exist: same output as forcing the gate
        ref.load_state_dict(model.state_dict(), strict=False)
        torch.testing.assert_close(run(ref, x).hidden, out.hidden, rtol=0, atol=1e-6)


def test_shared_key_uses_branch_zero_everywhere_and_saves(tmp_path):
    model, x = make(hc_mult=2, engram_shared_key=True)
    e = model.blocks[1].engram
    k = torch.randn(B, T, e.d_mem)
    assert torch.equal(e.key_projs[1](k), e.key_projs[0](k))
    per_branch, _ = make(hc_mult=2)
    n_shared = sum(p.numel() for p in model.parameters())
    n_own = sum(p.numel() for p in per_branch.parameters())
    assert n_own - n_shared == e.d_mem * 32 + 32 + 32  # one key projection (+bias), one norm
    save_file(model.state_dict(), tmp_path / "m.safetensors")  # no aliased storage
    again, _ = make(hc_mult=2, engram_shared_key=True)
    again.load_state_dict(load_file(tmp_path / "m.safetensors"))
    torch.testing.assert_close(run(again, x).hidden, run(model, x).hidden, rtol=0, atol=0)


def test_captured_hidden_last_state_is_the_output_before_the_norm():
    for kw in ({}, {"hc_mult": 2}):
        model, x = make(**kw)
        with captured_hidden(model) as states:
            out = run(model, x)
        assert len(states) == 4 and all(s.shape == (B, T, 32) for s in states)
        torch.testing.assert_close(model.norm(states[-1]), out.hidden, rtol=0, atol=1e-6)
        torch.testing.assert_close(states[0], model.embed(x["tokens"]))
