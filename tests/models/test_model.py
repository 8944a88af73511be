"""The reference LM: shapes, causality, cached decode == full forward, zero Engram == backbone,
parameter accounting, a few training steps, and config / input errors. Tiny shapes, CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engram
from engram.models.layers import MoE, engram_memory
from engram.models.cache import DecodeCache
from engram.models.model import EngramLM, ModelConfig, ModelOutput

V, B, T = 97, 2, 12


def engram_cfg(**overrides) -> engram.EngramConfig:
    base = dict(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                n_head_per_ngram=4, layer_ids=[1], pad_id=0)
    return engram.EngramConfig(**{**base, **overrides})


def hasher_for(cfg: engram.EngramConfig) -> engram.NgramHasher:
    return engram.NgramHasher(cfg, np.arange(300) % 250)


def model_cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


MOE = dict(moe=True, n_routed_experts=4, n_shared_experts=1, top_k=2, d_expert=16)
VARIANTS = {
    "dense": {},
    "moe": MOE,
    "hc": dict(hc_mult=3),
    "engram": dict(engram=engram_cfg()),
    "engram_moe_hc": dict(engram=engram_cfg(layer_ids=[1, 2]), hc_mult=2, **MOE),
    "engram_v41": dict(engram=engram_cfg(profile="v4.1", engram_vocab_size=101)),
    "moe_top1_tied": dict(moe=True, n_routed_experts=3, n_shared_experts=0, top_k=1, d_expert=16,
                          tie_embeddings=True, first_dense_layers=1),
    "engram_adaptive": dict(engram=engram_cfg(), head="adaptive", head_cutoffs=(8, 40)),
}


def make(name: str, seed: int = 0) -> EngramLM:
    torch.manual_seed(seed)
    model = EngramLM(model_cfg(**VARIANTS[name])).eval()
    # Give the zero-initialised pieces (Engram conv, HC) non-trivial values so that the
    # equivalence tests exercise them.
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if "short_conv.conv" in p_name or "_hc." in p_name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def raw_batch(seed: int = 1, b: int = B, t: int = T) -> torch.Tensor:
    # Raw ids < V double as model-vocabulary ids; the hasher's raw vocabulary is 300.
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def hash_ids(model: EngramLM, raw: torch.Tensor):
    return hasher_for(model.config.engram).hash(raw) if model.config.engram else None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_shapes(name):
    model = make(name)
    raw = raw_batch()
    out = model(raw, hash_ids(model, raw), return_gates=True)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (B, T, V)
    assert out.aux_loss.shape == ()
    if model.config.moe:
        assert out.aux_loss.item() > 0
    else:
        assert out.aux_loss.item() == 0
    assert sorted(out.gates) == model.config.engram_layers
    for alpha in out.gates.values():
        assert alpha.shape == (B, T, model.config.hc_mult)
        assert bool(((alpha > 0) & (alpha < 1)).all())
    assert model(raw, hash_ids(model, raw)).gates is None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causal(name):
    model = make(name)
    raw = raw_batch()
    changed = raw.clone()
    changed[:, 7] = (changed[:, 7] + 5) % V
    a = model(raw, hash_ids(model, raw)).logits
    b = model(changed, hash_ids(model, changed)).logits
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decode_matches_full_forward(name):
    model = make(name)
    raw = raw_batch(t=11)
    full = model(raw, hash_ids(model, raw)).logits
    cache = model.new_cache(B, max_len=16)
    stream = hasher_for(model.config.engram).stream(B) if model.config.engram else None
    pieces, start = [], 0
    with torch.no_grad():
        for size in (5, 1, 2, 1, 2):  # prefill, then steps of 1 or more tokens
            new = raw[:, start:start + size]
            ids = stream.step(new) if stream is not None else None
            pieces.append(model(new, ids, cache=cache).logits)
            start += size
    assert cache.pos == 11
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_reorder_follows_rows():
    model = make("engram_moe_hc")
    raw = raw_batch(t=6)
    cache = model.new_cache(B, max_len=8)
    stream = hasher_for(model.config.engram).stream(B)
    with torch.no_grad():
        model(raw[:, :5], stream.step(raw[:, :5]), cache=cache)
        flip = torch.tensor([1, 0])
        cache.reorder(flip)
        stream.reorder(flip)
        last = model(raw[flip, 5:], stream.step(raw[flip, 5:]), cache=cache).logits
        full = model(raw[flip], hash_ids(model, raw[flip])).logits
    torch.testing.assert_close(last, full[:, 5:], atol=1e-5, rtol=1e-5)


def reference_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(e)) v from its definition: q, k, v [b, t, h, e] -> same."""
    t, e = q.shape[1], q.shape[-1]
    scores = torch.einsum("bthe,bshe->bhts", q, k) / e ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhts,bshe->bthe", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("name", ["engram_moe_hc", "engram_v41", "dense"])
def test_blocks_run_the_attention_they_are_given(name):
    """The attention proper is an argument of the one block forward (what a paged engine swaps)."""
    model = make(name)
    raw = raw_batch()
    ids = hash_ids(model, raw)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]

    def memory(i):
        return engram_memory(ids[i])

    with torch.no_grad():
        full = model(raw, ids).hidden
        ref, _, _ = model.trunk(raw, cos, sin, lambda i: reference_attention, memory)
        # Each position attending to itself alone: position 0 does so in causal attention anyway.
        own, _, _ = model.trunk(raw, cos, sin, lambda i: lambda q, k, v: v, memory)
    torch.testing.assert_close(ref, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own[:, 0], full[:, 0], atol=1e-6, rtol=0)
    assert not torch.allclose(own[:, 1:], full[:, 1:], atol=1e-3)


def test_engram_block_needs_its_memory():
    model = make("engram")
    raw = raw_batch()
    h = model.embed(raw)
    with pytest.raises(ValueError, match="memory="):
        model.blocks[1](h, model.rope_cos[:T], model.rope_sin[:T])


@pytest.mark.parametrize("hc_mult", [1, 2])
def test_zero_engram_equals_backbone(hc_mult):
    torch.manual_seed(0)
    with_engram = EngramLM(model_cfg(engram=engram_cfg(layer_ids=[0, 2]), hc_mult=hc_mult, **MOE))
    backbone = EngramLM(model_cfg(hc_mult=hc_mult, **MOE))
    missing, unexpected = backbone.load_state_dict(with_engram.state_dict(), strict=False)
    assert not missing and all(".engram." in k for k in unexpected)
    with torch.no_grad():
        for e in with_engram.engrams().values():  # v = 0 -> Y = 0 + SiLU(conv(RMSNorm(0))) = 0
            e.value_proj.weight.zero_()
            e.value_proj.bias.zero_()
            e.short_conv.conv.weight.normal_()
    raw = raw_batch()
    torch.testing.assert_close(with_engram(raw, hash_ids(with_engram, raw)).logits,
                               backbone(raw).logits, atol=1e-6, rtol=0)


def test_hyper_connections_start_as_plain_residual():
    torch.manual_seed(0)
    plain = EngramLM(model_cfg(**MOE))
    hc = EngramLM(model_cfg(hc_mult=4, **MOE))
    missing, unexpected = hc.load_state_dict(plain.state_dict(), strict=False)
    assert all("_hc." in k for k in missing) and not unexpected
    raw = raw_batch()
    torch.testing.assert_close(hc(raw).logits, plain(raw).logits, atol=1e-6, rtol=1e-5)


def test_moe_matches_per_token_reference():
    torch.manual_seed(0)
    moe = MoE(dim=8, n_routed=5, n_shared=1, top_k=2, d_expert=6, aux_loss_coef=0.1)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 4, 8)
    y, aux = moe(x)

    def expert(i, v):
        return F.linear(F.silu(F.linear(v, moe.w1[i])) * F.linear(v, moe.w3[i]), moe.w2[i])

    ref, counts = [], torch.zeros(5)
    probs = torch.softmax(x.reshape(-1, 8) @ moe.router.weight.T, dim=-1)
    for tok, p in zip(x.reshape(-1, 8), probs):
        w, idx = p.topk(2)
        w = w / w.sum()
        counts[idx] += 1
        ref.append(moe.shared(tok) + sum(wi * expert(int(i), tok) for wi, i in zip(w, idx)))
    torch.testing.assert_close(y.reshape(-1, 8), torch.stack(ref), atol=1e-6, rtol=1e-5)
    f = counts * 5 / (12 * 2)
    torch.testing.assert_close(aux, 0.1 * (f * probs.mean(0)).sum())


def test_param_counts():
    dense, with_engram = EngramLM(model_cfg()), EngramLM(model_cfg(engram=engram_cfg()))
    cd, ce = dense.param_counts(), with_engram.param_counts()
    engram_params = sum(p.numel() for e in with_engram.engrams().values() for p in e.parameters())
    assert ce["total"] == cd["total"] + engram_params
    assert ce["total"] == sum(p.numel() for p in with_engram.parameters())
    rows = hasher_for(engram_cfg()).num_rows(1)
    assert ce["table"] == rows * engram_cfg().head_dim
    assert ce["active"] == cd["active"] + engram_params - ce["table"]
    assert cd["active"] == cd["total"] - V * 32 and cd["table"] == 0  # input embedding not active
    assert ce["sparse"] == ce["table"]

    moe = EngramLM(model_cfg(**MOE)).param_counts()
    assert moe["routed_inactive"] == 3 * (4 - 2) * 3 * 32 * 16
    assert moe["active"] < moe["total"]
    assert moe["total"] - moe["active"] == moe["routed_inactive"] + V * 32

    tied = EngramLM(model_cfg(tie_embeddings=True)).param_counts()
    assert tied["total"] == cd["total"] - V * 32 and tied["active"] == cd["active"]
    assert tied["active_non_embedding"] == cd["active_non_embedding"]
    assert tied["total_non_embedding"] == cd["total_non_embedding"]


def test_default_widths_match_activated_ffn():
    cfg = model_cfg(d_model=48, n_head=4, moe=True, n_routed_experts=8, n_shared_experts=1,
                    top_k=3)
    assert cfg.d_ff == 128  # 8/3 * 48 = 128, already a multiple of 32
    assert model_cfg().d_ff == 96  # 85.3 rounded up to a multiple of 32
    assert cfg.d_expert == 128 // 4


def test_table_dense_split_and_training_reduces_loss():
    torch.manual_seed(0)
    model = EngramLM(model_cfg(engram=engram_cfg(layer_ids=[0, 1]), hc_mult=2, **MOE)).train()
    tables, dense = list(model.table_parameters()), list(model.dense_parameters())
    assert len(tables) == 2
    assert {id(p) for p in tables}.isdisjoint(id(p) for p in dense)
    assert len(tables) + len(dense) == len(list(model.parameters()))
    opt_dense = torch.optim.Adam(dense, lr=3e-3)
    opt_tables = torch.optim.SparseAdam(tables, lr=1.5e-2)  # paper: tables take 5x the LR
    raw = raw_batch(t=16)
    ids = hash_ids(model, raw)
    inputs, targets = raw[:, :-1], raw[:, 1:]
    ids = {k: v[:, :-1] for k, v in ids.items()}
    losses = []
    for _ in range(8):
        out = model(inputs, ids)
        loss = model.loss(out, targets)
        opt_dense.zero_grad()
        opt_tables.zero_grad()
        loss.backward()
        assert all(p.grad.is_sparse for p in tables)
        opt_dense.step()
        opt_tables.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_loss_is_cross_entropy_plus_aux():
    model = make("moe")
    raw = raw_batch()
    out = model(raw)
    targets = raw.roll(-1, dims=1)
    targets[:, -1] = -100
    ce = F.cross_entropy(out.logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(model.loss(out, targets), ce + out.aux_loss)


def test_adaptive_head_is_an_exact_distribution():
    """Full log-probs normalise over every id, the training NLL equals them, the frequency ranks
    only permute ids, and ignore_index works as in cross_entropy."""
    model = make("engram_adaptive")
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(3))
    model.head.set_frequencies(counts)
    assert sorted(model.head.rank.tolist()) == list(range(V))
    assert model.head.rank[counts.argmax()] == 0  # the most frequent id is in the shortlist
    raw = raw_batch()
    out = model(raw, hash_ids(model, raw))
    lp = out.logits  # [B, T, V] log-probabilities
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(B, T), atol=1e-5, rtol=0)
    targets = raw.roll(-1, dims=1)
    nll = model.token_nll(out, targets)
    torch.testing.assert_close(nll, -lp.gather(-1, targets[..., None])[..., 0])
    targets[:, -1] = -100
    torch.testing.assert_close(model.loss(out, targets),
                               F.nll_loss(lp.reshape(-1, V), targets.reshape(-1)))
    assert model.token_nll(out, targets)[:, -1].eq(0).all()
    with pytest.raises(ValueError, match="counts"):
        model.head.set_frequencies(counts[:-1])


def test_adaptive_head_state_round_trip():
    """The frequency ranks travel with the state dict, so a reloaded model scores identically."""
    a = make("engram_adaptive")
    a.head.set_frequencies(torch.arange(V).flip(0))
    b = make("engram_adaptive", seed=5)
    b.load_state_dict(a.state_dict())
    raw = raw_batch()
    torch.testing.assert_close(a(raw, hash_ids(a, raw)).logits, b(raw, hash_ids(b, raw)).logits)


@pytest.mark.parametrize("overrides, match", [
    (dict(head="adaptive", head_cutoffs=(40, 8)), "head_cutoffs"),
    (dict(head="adaptive", head_cutoffs=(8, V)), "head_cutoffs"),
    (dict(head="adaptive", head_cutoffs=()), "head_cutoffs"),
    (dict(head="adaptive", head_cutoffs=(8,), tie_embeddings=True), "tie_embeddings"),
    (dict(head="sampled"), "head must be"),
    (dict(engram=engram_cfg(layer_ids=[3])), "out of range"),
    (dict(n_head=0), "n_head"),
    (dict(d_model=30), "divisible"),
    (dict(d_model=24, n_head=8), "even"),
    (dict(moe=True, n_routed_experts=2, top_k=3), "top_k"),
    (dict(moe=True, n_routed_experts=0), "n_routed_experts"),
    (dict(moe=True, first_dense_layers=5), "first_dense_layers"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(engram_gate="tanh"), "engram_gate"),
    (dict(d_ff=-4), "d_ff"),
])
def test_bad_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        model_cfg(**overrides)


def test_config_round_trip():
    cfg = model_cfg(**VARIANTS["engram_moe_hc"])
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layers": 2})


def test_bad_inputs_raise():
    model = make("engram_moe_hc")
    raw = raw_batch()
    ids = hash_ids(model, raw)
    with pytest.raises(ValueError, match="pass hash_ids"):
        model(raw)
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        model(raw, {1: ids[1]})
    with pytest.raises(ValueError, match=r"unexpected \[0\]"):
        model(raw, {**ids, 0: ids[1]})
    with pytest.raises(ValueError, match="expected"):
        model(raw, {k: v[:, :-1] for k, v in ids.items()})
    with pytest.raises(ValueError, match="pass hash_ids|unexpected"):
        make("dense")(raw, ids)
    with pytest.raises(ValueError, match="token ids"):
        model(raw + V, ids)
    with pytest.raises(ValueError, match="max_seq_len"):
        make("dense")(torch.zeros(1, 65, dtype=torch.long))
    cache = model.new_cache(B, max_len=4)
    assert isinstance(cache, DecodeCache)
    with pytest.raises(ValueError, match="cache full"):
        model(raw[:, :5], {k: v[:, :5] for k, v in ids.items()}, cache=cache)
    with pytest.raises(ValueError, match="batch"):
        model(raw[:1, :2], {k: v[:1, :2] for k, v in ids.items()}, cache=cache)


def test_external_table_is_kept():
    cfg = model_cfg(engram=engram_cfg())
    rows = hasher_for(cfg.engram).num_rows(1)
    table = engram.MemoryTable(rows, cfg.engram.head_dim)
    with torch.no_grad():
        table.weight.fill_(0.5)
    model = EngramLM(cfg, tables={1: table})
    assert model.engrams()[1].table is table and bool((table.weight == 0.5).all())
    with pytest.raises(ValueError, match="without Engram"):
        EngramLM(cfg, tables={0: table})
    assert dataclasses.is_dataclass(model.config)


def test_v41_config_records_its_gate_and_an_old_one_keeps_its_own():
    """v4.1 now runs the engine's gate (signed sqrt, eps 1e-6) and a saved config says so; a
    config saved before (no engram_norm_eps, gate None) rebuilds the model it trained: the plain
    sigmoid at float32's eps, output bit for bit that of a module built that way by hand."""
    new = model_cfg(**VARIANTS["engram_v41"])
    assert (new.engram_gate, new.engram_norm_eps) == ("demo", 1e-6)
    assert ModelConfig.from_dict(new.to_dict()) == new
    old = {k: v for k, v in new.to_dict().items() if k != "engram_norm_eps"}
    old["engram_gate"] = None
    legacy = ModelConfig.from_dict(old)
    assert legacy.engram_gate == "paper"
    assert legacy.engram_norm_eps == torch.finfo(torch.float32).eps
    assert ModelConfig.from_dict(legacy.to_dict()) == legacy  # and stays so once re-saved
    demo = {k: v for k, v in model_cfg(**VARIANTS["engram"]).to_dict().items()
            if k != "engram_norm_eps"}
    assert ModelConfig.from_dict({**demo, "engram_gate": None}).engram_norm_eps is None
    torch.manual_seed(0)
    model = EngramLM(legacy).eval()
    eng = model.engrams()[1]
    by_hand = engram.Engram(None, None, eng.d_mem, 32, gate="paper", kernel_size=0, fused=True)
    by_hand.load_state_dict({k: v for k, v in eng.state_dict().items() if "table" not in k})
    e, h = torch.randn(2, 5, eng.d_mem), torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(eng(h, memory=e), by_hand(h, memory=e))


def test_engram_mask_passes_masked_positions_through_untouched():
    """DeepSeek-V4.1's token mask (image tokens): no Engram residual at a masked position."""
    model = make("engram_v41")
    x = torch.randint(0, V, (B, T))
    ids = hasher_for(model.config.engram).hash(x)
    mask = torch.rand(B, T) > 0.3
    seen = []
    model.engrams()[1].register_forward_hook(lambda m, i, out: seen.append(out))
    with torch.no_grad():
        masked = model(x, ids, engram_mask=mask).hidden
        plain = model(x, ids).hidden
    assert torch.equal(seen[0][~mask], torch.zeros_like(seen[0][~mask]))
    assert torch.equal(seen[0][mask], seen[1][mask]) and not torch.equal(masked, plain)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_model_built_for_a_state_takes_it_as_it_is(name):
    """init=False (issue 48, gpt-fast's build on meta, load with assign): nothing allocated or
    drawn (the global generator as it was), then the state's tensors are the parameters: the
    same state dict, buffers (rotary tables, Engram's head offsets) and logits as the model the
    state came from, tied weights still tied; a later load copies as nn.Module's does."""
    want = make(name)
    state = {k: v.clone() for k, v in want.state_dict().items()}
    untouched = torch.rand(4, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(3)
    got = EngramLM(want.config, init=False).eval()
    assert torch.equal(torch.rand(4), untouched)
    # the adaptive head is built off meta (its arange has no C++ meta kernel), the rest on it
    assert all(p.is_meta for n, p in got.named_parameters() if not n.startswith("head.asm."))
    got.load_state_dict(state)
    assert not any(t.is_meta for t in [*got.parameters(), *got.buffers()])
    mine = got.state_dict()
    assert list(mine) == list(want.state_dict())
    assert all(mine[k].dtype == v.dtype and torch.equal(mine[k], v) for k, v in state.items())
    bufs = dict(want.named_buffers())
    assert all(torch.equal(b, bufs[k]) for k, b in got.named_buffers())
    assert got.embed.weight.data_ptr() == state["embed.weight"].data_ptr()  # not a copy
    assert (getattr(got.head, "weight", None) is got.embed.weight) == want.config.tie_embeddings
    raw = raw_batch()
    assert torch.equal(got(raw, hash_ids(got, raw)).logits, want(raw, hash_ids(want, raw)).logits)
    got.load_state_dict(make(name, seed=4).state_dict())  # loaded: copies, as nn.Module's
    assert got.embed.weight.data_ptr() == state["embed.weight"].data_ptr()


def test_a_model_built_for_a_state_needs_all_of_it():
    state = make("engram").state_dict()
    with pytest.raises(RuntimeError, match="Missing key"):
        EngramLM(model_cfg(**VARIANTS["engram"]), init=False).load_state_dict(
            {k: v for k, v in state.items() if "table" not in k})
    with pytest.raises(ValueError, match="no values for .*table"):
        EngramLM(model_cfg(**VARIANTS["engram"]), init=False).load_state_dict(
            {k: v for k, v in state.items() if "table" not in k}, strict=False)
