"""RowAdam, sparse-aware clipping and the optimiser split, against torch and hand-written
references."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engram
from engram.tables.store import MemoryTable
from engram.training.optim import Optimizers, build_optimizers, clip_grad_norm_
from engram.training.row_optim import RowAdam


def sparse_grad(ids, grads, num_rows):
    """A row-sparse COO gradient, uncoalesced (duplicates kept), like F.embedding's backward."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (num_rows, grads.shape[1]),
                                   check_invariants=True)


def embedding_step(table: MemoryTable, opt, ids: torch.Tensor, target: torch.Tensor):
    """One real backward through the table's sparse lookup, then a step."""
    opt.zero_grad()
    loss = ((table.lookup(ids) - target) ** 2).sum()
    loss.backward()
    opt.step()


# -- only touched rows change -------------------------------------------------------------------
def test_untouched_rows_are_bit_identical_and_stateless():
    torch.manual_seed(0)
    table = MemoryTable(500, 8, sparse=True)
    before = table.weight.detach().clone()
    opt = RowAdam(table.parameters(), lr=0.05)
    seen = set()
    for _ in range(6):
        ids = torch.randint(0, 500, (4, 7))
        seen |= set(ids.flatten().tolist())
        embedding_step(table, opt, ids, torch.randn(4, 7, 8))
    touched = torch.tensor(sorted(seen))
    assert torch.equal(opt.touched_rows(table.weight), touched)
    untouched = torch.tensor(sorted(set(range(500)) - seen))
    assert torch.equal(table.weight.detach()[untouched], before[untouched])
    assert not torch.equal(table.weight.detach()[touched], before[touched])
    m, v, t = opt.row_state(table.weight, untouched)
    assert not m.any() and not v.any() and not t.any()
    m, v, t = opt.row_state(table.weight, touched)
    assert (t > 0).all() and v.any()


def test_state_is_compact_not_table_shaped():
    table = MemoryTable(200_000, 8, sparse=True)
    opt = RowAdam(table.parameters(), lr=0.01)
    embedding_step(table, opt, torch.randint(0, 200_000, (64,)), torch.zeros(64, 8))
    st = opt.state[table.weight]
    assert st["slot"].dtype == torch.int32 and st["slot"].shape == (200_000,)
    assert st["exp_avg"].shape[0] <= 1024 and st["exp_avg_sq"].shape[0] <= 1024
    assert st["exp_avg"].dtype == torch.float32


def test_growth_keeps_state():
    """Touching more rows than the first capacity (1024) grows the buffers without losing rows."""
    torch.manual_seed(1)
    n, e = 6000, 4
    w0 = torch.randn(n, e)
    p = nn.Parameter(w0.clone())
    opt = RowAdam([p], lr=0.01)
    order = torch.randperm(n)
    steps = []
    for s in range(5):
        ids = torch.cat([order[s * 900:(s + 1) * 900], order[:50]])  # new rows + revisits
        g = torch.randn(ids.numel(), e)
        steps.append((ids, g))
        p.grad = sparse_grad(ids, g, n)
        opt.step()
    assert opt.state[p]["exp_avg"].shape[0] >= 4550
    ref = lazy_adam_reference(w0, steps, 0.01, (0.9, 0.999), 1e-8)
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-6)


# -- equivalence with references -------------------------------------------------------------------
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_equals_torch_adam_when_every_row_is_touched(betas):
    torch.manual_seed(2)
    rows, e = 7, 5
    sparse_table = MemoryTable(rows, e, sparse=True)
    dense_table = nn.Embedding(rows, e)
    with torch.no_grad():
        dense_table.weight.copy_(sparse_table.weight)
    row_opt = RowAdam(sparse_table.parameters(), lr=0.03, betas=betas)
    ref_opt = torch.optim.Adam(dense_table.parameters(), lr=0.03, betas=betas)
    for _ in range(8):
        # every row every step, in random order and with repeats
        ids = torch.cat([torch.randperm(rows), torch.randint(0, rows, (5,))]).view(3, 4)
        target = torch.randn(3, 4, e)
        embedding_step(sparse_table, row_opt, ids, target)
        ref_opt.zero_grad()
        ((dense_table(ids) - target) ** 2).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(sparse_table.weight, dense_table.weight, rtol=0, atol=1e-6)
    m, v, t = row_opt.row_state(sparse_table.weight, torch.arange(rows))
    # A few ulps, not 0: the gradients are equal, but torch's Adam rounds its moment update alike
    # only where it vectorises alike (seen 1 ulp apart, at 1 element of 35, on an AVX-512 AMD EPYC).
    torch.testing.assert_close(m, ref_opt.state[dense_table.weight]["exp_avg"], rtol=1e-6,
                               atol=1e-7)
    ref_v = ref_opt.state[dense_table.weight]["exp_avg_sq"]
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-7)
    assert (t == 8).all()


def lazy_adam_reference(w0, steps, lr, betas, eps):
    """Per-row lazy Adam, one row at a time in float64: each row keeps its own step count."""
    w = w0.double().clone()
    b1, b2 = betas
    m, v, t = {}, {}, {}
    for ids, grads in steps:
        summed = {}
        for r, g in zip(ids.tolist(), grads.double()):
            summed[r] = summed.get(r, 0) + g
        for r, g in summed.items():
            t[r] = t.get(r, 0) + 1
            m[r] = b1 * m.get(r, 0) + (1 - b1) * g
            v[r] = b2 * v.get(r, 0) + (1 - b2) * g * g
            m_hat, v_hat = m[r] / (1 - b1 ** t[r]), v[r] / (1 - b2 ** t[r])
            w[r] -= lr * m_hat / (v_hat.sqrt() + eps)
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_per_row_lazy_reference_when_rows_come_and_go(seed):
    torch.manual_seed(seed)
    rows, e, lr, betas = 12, 3, 0.02, (0.9, 0.95)
    w0 = torch.randn(rows, e)
    p = nn.Parameter(w0.clone())
    opt = RowAdam([p], lr=lr, betas=betas)
    steps = []
    for _ in range(10):
        k = int(torch.randint(1, 9, ()))
        ids = torch.randint(0, rows, (k,))  # some rows skipped, some repeated
        g = torch.randn(k, e)
        steps.append((ids, g))
        p.grad = sparse_grad(ids, g, rows)
        opt.step()
    ref = lazy_adam_reference(w0, steps, lr, betas, 1e-8)
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-6)


def test_duplicate_ids_are_summed():
    torch.manual_seed(3)
    w0 = torch.randn(10, 4)
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    oa, ob = RowAdam([a], lr=0.1), RowAdam([b], lr=0.1)
    g = torch.randn(5, 4)
    a.grad = sparse_grad([3, 7, 3, 3, 7], g, 10)
    b.grad = sparse_grad([3, 7], torch.stack([g[0] + g[2] + g[3], g[1] + g[4]]), 10)
    oa.step()
    ob.step()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert torch.equal(oa.row_state(a, [3, 7])[2], torch.tensor([1, 1]))


def test_bfloat16_table_keeps_float32_state():
    torch.manual_seed(4)
    w0 = torch.randn(20, 8).bfloat16()
    p = nn.Parameter(w0.clone())
    opt = RowAdam([p], lr=0.01)
    g = torch.randn(6, 8)
    p.grad = sparse_grad([1, 2, 2, 5, 9, 9], g.bfloat16(), 20)  # grads arrive in the table dtype
    opt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["exp_avg"].dtype == torch.float32
    ids = torch.tensor([1, 2, 2, 5, 9, 9])
    ref = lazy_adam_reference(w0.float(), [(ids, g.bfloat16().float())], 0.01, (0.9, 0.999), 1e-8)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-2, atol=1e-2)  # bf16 rounding


# -- checkpoints ---------------------------------------------------------------------------------
def _batches(n_steps, rows, e, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(ids := torch.randint(0, rows, (700,), generator=gen),
             torch.randn(ids.numel(), e, generator=gen)) for _ in range(n_steps)]


def test_state_dict_rejects_a_table_of_another_shape():
    p = nn.Parameter(torch.zeros(100, 4))
    opt = RowAdam([p])
    p.grad = sparse_grad([99], torch.ones(1, 4), 100)
    opt.step()
    q = nn.Parameter(torch.zeros(50, 4))
    with pytest.raises(ValueError, match="does not fit"):
        RowAdam([q]).load_state_dict(opt.state_dict())


# -- clipping --------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_matches_torch_on_dense(max_norm):
    torch.manual_seed(7)
    shapes = [(4, 5), (5,), (3, 2, 2)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    n_ours = clip_grad_norm_(ours, max_norm)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert torch.equal(n_ours, n_ref)
    for a, b in zip(ours, ref):
        assert torch.equal(a.grad, b.grad)


def test_clip_sparse_and_dense_together():
    torch.manual_seed(8)
    table = nn.Parameter(torch.randn(30, 4))
    dense = nn.Parameter(torch.randn(6))
    table.grad = sparse_grad([2, 9, 2, 29], torch.randn(4, 4), 30)  # duplicate row 2
    dense.grad = torch.randn(6)
    densified = [table.grad.to_dense(), dense.grad.clone()]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in densified]))
    total = clip_grad_norm_([table, dense], 0.1)
    torch.testing.assert_close(total, expected)
    coef = 0.1 / (expected + 1e-6)
    assert table.grad.is_sparse
    torch.testing.assert_close(table.grad.to_dense(), densified[0] * coef)
    torch.testing.assert_close(dense.grad, densified[1] * coef)


# -- the split between AdamW and RowAdam ----------------------------------------------------
CFG = engram.EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                          n_head_per_ngram=4, layer_ids=[0], pad_id=0)


class TinyLM(nn.Module):
    def __init__(self, sparse=True, d=32, vocab=300):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.engram = engram.build_engram(CFG, 0, d, sparse=sparse)
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, ids):
        h = self.embed(x)
        h = h + self.engram(h, ids)
        return self.head(self.norm(h))


def lm_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 300, (2, 16), generator=gen)
    ids = engram.NgramHasher(CFG, np.arange(300) % 250).hash(x)[0]
    return x, ids


def lm_loss(model, x, ids):
    logits = model(x[:, :-1], ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def test_build_optimizers_split_and_lrs():
    torch.manual_seed(9)
    model = TinyLM()
    opts = build_optimizers(model, lr=1e-3, weight_decay=0.1)
    table = model.engram.table.weight
    assert isinstance(opts.tables, RowAdam) and isinstance(opts.dense, torch.optim.AdamW)
    [tg] = opts.tables.param_groups
    assert tg["params"] == [table] and tg["lr"] == pytest.approx(5e-3) and tg["weight_decay"] == 0
    decay, no_decay = ({id(p) for p in g["params"]} for g in opts.dense.param_groups)
    assert opts.dense.param_groups[0]["weight_decay"] == 0.1
    assert opts.dense.param_groups[1]["weight_decay"] == 0.0
    assert id(model.head.weight) in decay and id(model.engram.value_proj.weight) in decay
    assert id(model.engram.short_conv.conv.weight) in decay
    for p in (model.embed.weight, model.head.bias, model.norm.weight, model.engram.value_proj.bias):
        assert id(p) in no_decay
    n_dense = sum(len(g["params"]) for g in opts.dense.param_groups)
    assert n_dense == len(list(model.parameters())) - 1  # everything but the table, once
    opts.set_lr(2e-3)
    assert opts.dense.param_groups[0]["lr"] == 2e-3 and tg["lr"] == pytest.approx(1e-2)


def test_one_step_lowers_the_loss_and_touches_only_read_rows():
    torch.manual_seed(10)
    model = TinyLM()
    opts = build_optimizers(model, lr=1e-2)
    x, ids = lm_batch()
    table = model.engram.table.weight
    before = table.detach().clone()
    loss0 = lm_loss(model, x, ids)
    opts.zero_grad()
    loss0.backward()
    assert table.grad.is_sparse
    clip_grad_norm_(model.parameters(), 1.0)
    opts.step()
    assert lm_loss(model, x, ids).item() < loss0.item()
    read = torch.unique(model.engram.rows(ids[:, :-1]))
    assert torch.equal(opts.tables.touched_rows(table), read)
    changed = (table.detach() != before).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(read.tolist())


def test_optimizers_state_dict_round_trip():
    torch.manual_seed(11)
    model, twin = TinyLM(), TinyLM()
    twin.load_state_dict(model.state_dict())
    opts, opts2 = build_optimizers(model, lr=1e-2), build_optimizers(twin, lr=1e-2)

    def train(m, o, seeds):
        for s in seeds:
            x, ids = lm_batch(s)
            o.zero_grad()
            lm_loss(m, x, ids).backward()
            o.step()

    train(model, opts, [0, 1])
    train(twin, opts2, [0])
    buf = io.BytesIO()
    torch.save(opts2.state_dict(), buf)
    fresh_model = TinyLM()
    fresh_model.load_state_dict(twin.state_dict())
    fresh = build_optimizers(fresh_model, lr=1.0)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    train(fresh_model, fresh, [1])
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def test_dense_table_is_a_clear_error():
    with pytest.raises(ValueError, match="sparse=True"):
        build_optimizers(TinyLM(sparse=False), lr=1e-3)
    model = TinyLM(sparse=False)
    opt = RowAdam([model.engram.table.weight], lr=1e-3)
    x, ids = lm_batch()
    lm_loss(model, x, ids).backward()
    with pytest.raises(TypeError, match="sparse=True"):
        opt.step()


def test_weight_decay_is_refused():
    p = nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="weight decay"):
        RowAdam([p], weight_decay=0.1)
    opt = RowAdam([p])
    opt.param_groups[0]["weight_decay"] = 0.01
    p.grad = sparse_grad([1], torch.ones(1, 2), 4)
    with pytest.raises(ValueError, match="weight decay"):
        opt.step()


def test_model_without_tables_gets_only_adamw():
    opts = build_optimizers(nn.Linear(3, 3), lr=1e-3)
    assert opts.tables is None and isinstance(opts.dense, torch.optim.AdamW)
    assert isinstance(opts, Optimizers)


def test_clip_leaves_sparse_grad_coalesced_and_capacity_stops_at_the_table():
    """RowAdam's coalesce() after clipping is free, and the state never outgrows the table."""
    table = MemoryTable(1500, 4, sparse=True)
    opt = RowAdam(table.parameters(), lr=0.01)
    for s in range(3):
        ids = torch.arange(s * 500, (s + 1) * 500).repeat(2)  # duplicates: an uncoalesced grad
        table.weight.grad = None
        table.lookup(ids).sum().backward()
        clip_grad_norm_([table.weight], 0.5)
        assert table.weight.grad.is_coalesced()
        opt.step()
    assert opt.state[table.weight]["exp_avg"].shape[0] == 1500
    assert opt.touched_rows(table.weight).equal(torch.arange(1500))
