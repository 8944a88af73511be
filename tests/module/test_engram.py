import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import Engram, EngramState, MemoryTable, NgramHasher, build_engram
from engram.module import gate_fn


def _ids(cfg, lookup, b=2, t=17, seed=0):
    x = torch.randint(0, 300, (b, t), generator=torch.Generator().manual_seed(seed))
    return NgramHasher(cfg, lookup).hash(x)


VARIANTS = [
    dict(hc_mult=1, gate="demo", conv=True, profile="demo-v1"),
    dict(hc_mult=4, gate="paper", conv=True, profile="demo-v1"),
    dict(hc_mult=2, gate="paper", conv=False, profile="v4.1"),
    dict(hc_mult=1, gate="demo", conv=True, profile="v4.1"),
]


def _module(tiny_config, v, d=24):
    cfg = tiny_config.replace(profile=v["profile"])
    torch.manual_seed(0)
    m = build_engram(cfg, 2, d, v["hc_mult"], gate=v["gate"], conv=v["conv"], conv_init="default")
    return cfg, m


@pytest.mark.parametrize("v", VARIANTS)
@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=8))
@settings(max_examples=10, deadline=None)
def test_incremental_equals_full(tiny_config, tiny_lookup, v, chunks):
    cfg, m = _module(tiny_config, v)
    ids = _ids(cfg, tiny_lookup)[2]
    b, t = ids.shape[:2]
    h = torch.randn(b, t, v["hc_mult"], 24) if v["hc_mult"] > 1 else torch.randn(b, t, 24)
    with torch.no_grad():
        full, alpha = m(h, ids, return_gate=True)
        state, outs, i = EngramState(), [], 0
        for c in chunks * t:
            if i >= t:
                break
            outs.append(m(h[:, i:i + c], ids[:, i:i + c], state=state))
            i += c
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)
    assert alpha.shape == (b, t, v["hc_mult"])


def test_demo_forward_matches_formula(tiny_config, tiny_lookup):
    """Y = alpha*v + SiLU(conv(RMSNorm(alpha*v))), alpha = sigmoid(signed sqrt(s)), written out by hand."""
    cfg, m = _module(tiny_config, VARIANTS[0])
    ids = _ids(cfg, tiny_lookup)[2]
    h = torch.randn(2, 17, 24)
    with torch.no_grad():
        rows = ids + torch.tensor(np.cumsum([0] + NgramHasher(cfg, tiny_lookup).table_sizes(2)[:-1]))
        e = m.table.weight[rows].flatten(-2)
        k, v = m.key_projs[0](e), m.value_proj(e)
        s = (m.norm1[0](k) * m.norm2[0](h)).sum(-1) / math.sqrt(24)
        alpha = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp_min(1e-6)))
        vt = alpha[..., None] * v
        conv = torch.nn.Conv1d(24, 24, 4, groups=24, bias=False, padding=3 * 3, dilation=3)
        conv.weight.copy_(m.short_conv.conv.weight)
        y = vt + torch.nn.functional.silu(conv(m.short_conv.norms[0](vt).transpose(1, 2))[..., :17]
                                          .transpose(1, 2))
        torch.testing.assert_close(m(h, ids), y, rtol=1e-5, atol=1e-5)


def test_zero_conv_starts_as_gated_lookup(tiny_config, tiny_lookup):
    m = build_engram(tiny_config, 2, 24)  # conv_init="zero" by default
    ids = _ids(tiny_config, tiny_lookup)[2]
    h = torch.randn(2, 17, 24)
    with torch.no_grad():
        y, alpha = m(h, ids, return_gate=True)
        v = m.value_proj(m.read(ids))
        torch.testing.assert_close(y, alpha * v)
    assert (alpha > 0).all() and (alpha < 1).all()


def test_gate_variants():
    s = torch.tensor([-4.0, 0.0, 0.25, 4.0])
    torch.testing.assert_close(gate_fn(s, "paper"), torch.sigmoid(s))
    torch.testing.assert_close(gate_fn(s, "demo"), torch.sigmoid(torch.tensor([-2.0, 0.0, 0.5, 2.0])))


def test_memory_path_equals_ids_path_and_tableless_module(tiny_config, tiny_lookup):
    torch.manual_seed(1)
    m = build_engram(tiny_config, 0, 24)
    ids = _ids(tiny_config, tiny_lookup)[0]
    h = torch.randn(2, 17, 24)
    with torch.no_grad():
        mem = m.read(ids)
        torch.testing.assert_close(m(h, memory=mem), m(h, ids))
        # The same weights with the table elsewhere: the module runs on gathered rows alone.
        tableless = build_engram(tiny_config, 0, 24, table=None)
        tableless.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("table")})
        torch.testing.assert_close(tableless(h, memory=mem), m(h, ids))


def test_sparse_table_grad_touches_only_read_rows(tiny_config, tiny_lookup):
    m = build_engram(tiny_config, 0, 24, sparse=True)
    ids = _ids(tiny_config, tiny_lookup, t=5)[0]
    m(torch.randn(2, 5, 24), ids).square().sum().backward()
    g = m.table.weight.grad
    assert g.is_sparse
    touched = set(g.coalesce().indices()[0].tolist())
    assert touched == set(m.rows(ids).flatten().tolist())


def test_v41_build_uses_global_ids_fused_no_bias_no_conv(tiny_config, tiny_lookup):
    cfg = tiny_config.replace(profile="v4.1")
    m = build_engram(cfg, 2, 24, hc_mult=2)
    assert m.short_conv is None and m.fused and m.kv_proj.bias is None
    # vLLM's V4.1 engine: signed square root before the sigmoid, norms at rms_norm_eps = 1e-6
    assert m.gate == "demo" and {n.eps for n in [*m.norm1, *m.norm2]} == {1e-6}
    ids = NgramHasher(cfg, tiny_lookup).hash(torch.randint(0, 300, (1, 9)))[2]
    assert torch.equal(m.rows(ids), ids)
    assert m(torch.randn(1, 9, 2, 24), ids).shape == (1, 9, 2, 24)


def test_official_state_dict_names(tiny_config):
    keys = set(build_engram(tiny_config, 0, 24, hc_mult=2, conv_init="default").state_dict())
    for k in ["value_proj.weight", "value_proj.bias", "key_projs.1.weight", "norm1.1.weight",
              "norm2.0.weight", "short_conv.conv.weight", "short_conv.norms.1.weight", "table.weight"]:
        assert k in keys


# -- bad input -------------------------------------------------------------------------------------

def test_bad_inputs_raise(tiny_config, tiny_lookup):
    m = build_engram(tiny_config, 0, 24)
    ids = _ids(tiny_config, tiny_lookup)[0]
    h = torch.randn(2, 17, 24)
    with pytest.raises(ValueError, match="out of range"):
        m(h, ids + 1000)
    with pytest.raises(ValueError, match="out of range"):
        m(h, ids - 1000)
    with pytest.raises(TypeError, match="integer"):
        m(h, ids.float())
    with pytest.raises(ValueError, match="heads"):
        m(h, ids[..., :3])
    with pytest.raises(ValueError, match="shape"):
        m(h, ids[0])
    with pytest.raises(ValueError, match="hidden"):
        m(torch.randn(2, 17, 25), ids)
    with pytest.raises(ValueError, match="memory"):
        m(h, memory=torch.randn(2, 17, 5))
    with pytest.raises(RuntimeError, match="no table"):
        build_engram(tiny_config, 0, 24, table=None)(h, ids)
    with pytest.raises(ValueError, match="hc_mult"):
        build_engram(tiny_config, 0, 24, hc_mult=2)(h, ids)
    with pytest.raises(KeyError, match="layer 7"):
        build_engram(tiny_config, 7, 24)
    with pytest.raises(ValueError, match="needs"):
        build_engram(tiny_config, 0, 24, table=MemoryTable(10, 4))
    with pytest.raises(ValueError, match="gate"):
        Engram(None, None, 8, 8, gate="tanh")
    with pytest.raises(ValueError, match="positive"):
        MemoryTable(0, 4)


# -- the fused forward/backward against the plain per-branch composition ------------------------

def _reference_forward(m, h, e):
    """The module written plainly (per-branch loops, nn.RMSNorm, F.conv1d), as before issue 16."""
    d, hc = m.hidden_size, m.hc_mult
    v = m.value_proj(e)
    ks = [proj(e) for proj in m.key_projs]
    s = torch.stack([(m.norm1[i](ks[i]) * m.norm2[i](h[:, :, i])).sum(-1) for i in range(hc)], 2)
    vt = gate_fn(s / math.sqrt(d), m.gate).unsqueeze(-1) * v.unsqueeze(2)
    sc = m.short_conv
    xn = torch.cat([sc.norms[i](vt[:, :, i]) for i in range(hc)], -1).transpose(1, 2)
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(xn, (sc.context, 0)), sc.conv.weight,
                                   dilation=sc.dilation, groups=hc * d)
    return vt + torch.nn.functional.silu(y).transpose(1, 2).reshape(vt.shape)


@pytest.mark.parametrize("gate", ["paper", "demo"])
def test_fused_gradients_equal_plain_autograd(tiny_config, gate):
    torch.manual_seed(3)
    m = build_engram(tiny_config, 0, 12, hc_mult=3, gate=gate, conv_init="default",
                     table=None).double()
    for p in m.parameters():  # non-trivial norm weights, so their gradients are tested too
        p.data.add_(0.1 * torch.randn_like(p))
    h = torch.randn(2, 11, 3, 12, dtype=torch.double, requires_grad=True)
    e = torch.randn(2, 11, m.d_mem, dtype=torch.double, requires_grad=True)
    gy = torch.randn(2, 11, 3, 12, dtype=torch.double)
    params = [h, e, *m.parameters()]
    ours = torch.autograd.grad(m(h, memory=e), params, gy)
    ref = torch.autograd.grad(_reference_forward(m, h, e), params, gy)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_inference_weight_cache_follows_weight_updates(tiny_config, tiny_lookup):
    torch.manual_seed(0)
    m = build_engram(tiny_config, 0, 24, hc_mult=2, conv_init="default")
    ids = _ids(tiny_config, tiny_lookup)[0]
    h = torch.randn(2, 17, 2, 24)
    with torch.no_grad():
        before = m(h, ids)
        m.key_projs[1].weight.mul_(2.0)  # an optimiser step or load_state_dict works in place
        after = m(h, ids)
    fresh = build_engram(tiny_config, 0, 24, hc_mult=2, conv_init="default")
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(after, fresh(h, ids))
    assert not torch.allclose(before, after)


def test_state_keeps_the_normalised_inputs_when_asked(tiny_config, tiny_lookup):
    torch.manual_seed(0)
    m = build_engram(tiny_config, 0, 24, hc_mult=2, conv_init="default")
    x = torch.randn(2, 5, 2, 24)
    state = EngramState(keep_inputs=True)
    with torch.no_grad():
        m.short_conv(x, state)
        want = torch.cat([m.short_conv.norms[i](x[:, :, i]) for i in range(2)], -1)  # [b, t, m*d]
    torch.testing.assert_close(state.inputs, want)
    assert EngramState().inputs is None


@pytest.mark.parametrize("step", [1, 3, 11, None])
def test_conv_weight_grad_in_chunks_equals_per_tap_sums(step):
    """The chunked accumulation of the conv weight gradient (remainder chunk included)."""
    from engram.module.conv import _tap_grads
    g = torch.Generator().manual_seed(4)
    kernel, dil, t = 4, 3, 11
    gy = torch.randn(2, t, 10, dtype=torch.double, generator=g)
    full = torch.randn(2, (kernel - 1) * dil + t, 10, dtype=torch.double, generator=g)
    ref = torch.stack([(gy * full[:, j * dil: j * dil + t]).sum((0, 1)) for j in range(kernel)])
    torch.testing.assert_close(_tap_grads(gy, full, kernel, dil, step), ref)


@pytest.mark.parametrize("v", VARIANTS)
def test_inference_path_equals_training_path(tiny_config, tiny_lookup, v):
    """Without gradients the gate and conv write in place; the numbers are the same."""
    cfg, m = _module(tiny_config, v)
    ids = _ids(cfg, tiny_lookup)[2]
    h = torch.randn(2, 17, v["hc_mult"], 24) if v["hc_mult"] > 1 else torch.randn(2, 17, 24)
    y_train = m(h.requires_grad_(), ids)
    with torch.no_grad():
        y_infer = m(h, ids)
    assert torch.equal(y_train.detach(), y_infer)


@pytest.mark.parametrize("t", [40, 70])
def test_conv2d_path_gradients_and_decode(tiny_config, tiny_lookup, t):
    """Above 64 rows the conv runs as a channels-last conv2d (below: kernel multiply-adds, as in
    decode steps): gradients equal the plain formula's, and decoding step by step equals it."""
    torch.manual_seed(5)
    m = build_engram(tiny_config, 0, 12, hc_mult=3, gate="demo", conv_init="default",
                     table=None).double()
    for p in m.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    h = torch.randn(2, t, 3, 12, dtype=torch.double, requires_grad=True)
    e = torch.randn(2, t, m.d_mem, dtype=torch.double, requires_grad=True)
    gy = torch.randn(2, t, 3, 12, dtype=torch.double)
    params = [h, e, *m.parameters()]
    y = m(h, memory=e)
    ref = _reference_forward(m, h, e)
    torch.testing.assert_close(y, ref)
    for a, b in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(ref, params, gy)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        state = EngramState()
        steps = [m(h[:, i:i + 1], memory=e[:, i:i + 1], state=state) for i in range(t)]
    torch.testing.assert_close(torch.cat(steps, 1), ref.detach())
