"""The paged serving path without an engine: a miniature scheduler (random block allocation, chunked
prefill, prefix-cache reuse, preemption, many requests per step) drives PagedLM with a plain torch
paged attention; greedy tokens equal `engram generate`'s (Generator) for every request, and the
history of one request never reaches another."""

import numpy as np
import pytest
import torch
from engine_sim import MiniEngine, TorchPagedAttention

from engram import EngramConfig, EngramLM, ModelConfig, NgramHasher
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.paged import PagedLM
from engram.serving.slots import SlotHistory, StepLayout

LOOKUP = np.arange(300) % 250
VOCAB = np.sort(np.random.default_rng(0).choice(300, 120, replace=False))
PROFILES = {
    "demo-v1": EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                            n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0),
    "v4.1": EngramConfig(engram_vocab_size=157, max_ngram_size=4, n_embed_per_ngram=24,
                         n_head_per_ngram=4, layer_ids=[1], pad_id=0, profile="v4.1"),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(profile="demo-v1", hc_mult=1, moe=False):
    cfg = PROFILES[profile]
    mc = ModelConfig(vocab_size=len(VOCAB), n_layer=3, d_model=32, n_head=2, engram=cfg,
                     max_seq_len=64, hc_mult=hc_mult, moe=moe, n_routed_experts=4, top_k=2)
    torch.manual_seed(0)
    model = EngramLM(mc).eval()
    for e in model.engrams().values():  # a live conv: its context must come from the slots
        if e.short_conv is not None:
            torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    return model, NgramHasher(cfg, LOOKUP)


def _reference(model, hasher, prompts, max_new):
    gen = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=max_new))
    return [gen.generate([p]).tokens[0] for p in prompts]


def _prompts(n, seed=0, shared_prefix=0):
    g = np.random.default_rng(seed)
    head = [int(x) for x in g.choice(VOCAB, shared_prefix)]
    return [head + [int(x) for x in g.choice(VOCAB, int(g.integers(1, 19)))] for _ in range(n)]


@pytest.mark.parametrize("profile,hc_mult,moe", [("demo-v1", 1, False), ("demo-v1", 2, False),
                                                 ("v4.1", 1, True)])
def test_paged_greedy_equals_generate(profile, hc_mult, moe):
    model, hasher = _model(profile, hc_mult, moe)
    paged = PagedLM(model, hasher, torch.tensor(VOCAB), 300)
    prompts = _prompts(12, seed=1)
    eng = MiniEngine(paged, chunk=5)
    for p in prompts:
        eng.add(p, 6)
    while eng.step():
        pass
    assert [r["out"] for r in eng.reqs] == _reference(model, hasher, prompts, 6)


def _step(paged, attn, requests, chunks, done, blocks_per_request=8, block_size=4):
    """One engine step by hand: request requests[j] contributes chunks[j] (raw ids) at positions
    done[j].., in its own blocks r*blocks_per_request.. in order -> final hidden [n, d]."""
    raw, pos, slots, starts = [], [], [], [0]
    for chunk, p0 in zip(chunks, done):
        pos += range(p0, p0 + len(chunk))
        raw += chunk
        starts.append(len(raw))
    table = torch.stack([torch.arange(r * blocks_per_request, (r + 1) * blocks_per_request)
                         for r in requests])  # [R, B]
    for j, r in enumerate(requests):
        for p in pos[starts[j]:starts[j + 1]]:
            slots.append(int(table[j, p // block_size]) * block_size + p % block_size)
    layout = StepLayout(torch.tensor(pos), torch.tensor(starts), table, torch.tensor(slots),
                        block_size)
    return paged(torch.tensor(raw), torch.tensor(pos), layout, attn)


def _live_model(profile, hc_mult, moe):
    model, hasher = _model(profile, hc_mult, moe)
    with torch.no_grad():  # hyper-connections away from their identity start
        for name, p in model.named_parameters():
            if "_hc." in name:
                p.add_(0.3 * torch.randn_like(p))
    paged = PagedLM(model, hasher, torch.tensor(VOCAB), 300)
    attn = TorchPagedAttention(model.config.n_layer, model.config.n_head, model.config.head_dim)
    paged.ensure_slots(256)
    attn.ensure_slots(256)
    return model, hasher, paged, attn


def _full_logits(model, hasher, raw):
    """EngramLM's own forward over one whole sequence of raw ids -> logits [t, V]."""
    local = torch.as_tensor(np.searchsorted(VOCAB, raw))[None]  # [1, t] model ids
    with torch.no_grad():
        return model(local, hasher.hash(torch.tensor([raw]))).logits[0]


@pytest.mark.parametrize("profile,hc_mult,moe", [("demo-v1", 1, False), ("demo-v1", 2, True),
                                                 ("v4.1", 3, True)])
def test_flat_batch_equals_each_sequence_alone(profile, hc_mult, moe):
    """Requests of different lengths, mixed in flat steps (prefill chunks, one-token steps) ==
    EngramLM.forward on each sequence alone: the paged path runs the model's own layers."""
    model, hasher, paged, attn = _live_model(profile, hc_mult, moe)
    prompts = _prompts(4, seed=4)
    prompts[1] = prompts[1][:1] + prompts[0][:5]  # a one-token first step, then a chunk
    out = [[] for _ in prompts]
    done = [0] * len(prompts)
    for sizes in ([5, 1, 6, 4], [1, 5, 1, 1], [30, 30, 30, 30]):  # step 2: 3 one-token requests
        chunks = [p[d:d + s] for p, d, s in zip(prompts, done, sizes)]
        live = [r for r, c in enumerate(chunks) if c]
        hidden = _step(paged, attn, live, [chunks[r] for r in live], [done[r] for r in live])
        logits = paged.logits(hidden)[:, VOCAB]  # [n, V] back in model order
        for r, rows in zip(live, logits.split([len(chunks[r]) for r in live])):
            out[r].append(rows)
            done[r] += len(chunks[r])
    for raw, pieces in zip(prompts, out):
        torch.testing.assert_close(torch.cat(pieces), _full_logits(model, hasher, raw),
                                   atol=1e-5, rtol=1e-5)


def test_one_sequence_equals_forward():
    """A whole sequence in one paged step == EngramLM.forward."""
    model, hasher, paged, attn = _live_model("demo-v1", 2, True)
    raw = _prompts(1, seed=5)[0]
    torch.testing.assert_close(paged.logits(_step(paged, attn, [0], [raw], [0]))[:, VOCAB],
                               _full_logits(model, hasher, raw), atol=1e-5, rtol=1e-5)


def test_prefix_cache_preemption_and_many_requests_in_flight():
    model, hasher = _model()
    paged = PagedLM(model, hasher, torch.tensor(VOCAB), 300)
    prompts = _prompts(24, seed=2, shared_prefix=9)  # shared full blocks: prefix-cache hits
    eng = MiniEngine(paged, chunk=3, seed=3)
    for p in prompts[:8]:
        eng.add(p, 5)
    for _ in range(10):
        eng.step()
    for p in prompts[8:]:  # arrive later, reuse the first requests' cached prompt blocks
        eng.add(p, 5)
    eng.step()
    eng.preempt(1)  # recomputed from scratch, into new blocks
    eng.preempt(10)
    while eng.step():
        pass
    assert eng.prefix_hits > 0
    assert [r["out"] for r in eng.reqs] == _reference(model, hasher, prompts, 5)


def test_histories_are_not_shared():
    """Two requests with the same last token but different pasts get different Engram rows."""
    model, hasher = _model()
    paged = PagedLM(model, hasher, torch.tensor(VOCAB), 300)
    paged.ensure_slots(64)
    a, b = [int(VOCAB[1]), int(VOCAB[2]), int(VOCAB[5])], [int(VOCAB[3]), int(VOCAB[4]),
                                                           int(VOCAB[5])]
    layout = StepLayout(torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 3, 6]),
                        torch.tensor([[0], [1]]), torch.tensor([0, 1, 2, 4, 5, 6]), 4)
    ids = paged.hash(torch.tensor(a + b), layout)
    full = hasher.hash(torch.tensor([a, b]))
    for lid, v in ids.items():
        assert torch.equal(v.view(2, 3, -1), full[lid])
        assert not torch.equal(v[2], v[5])


def test_layout_and_history_errors():
    with pytest.raises(RuntimeError, match="disagree"):
        StepLayout(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([[3]]),
                   torch.tensor([0, 1]), 4)
    h = SlotHistory(None, torch.long, fill=-1)
    with pytest.raises(RuntimeError, match="ensure"):
        h.read(torch.tensor([0]))
    h.ensure(8)
    h.write(torch.tensor([2]), torch.tensor([7]))
    assert h.read(torch.tensor([2, -1, 3])).tolist() == [7, -1, -1]
    model, hasher = _model()
    with pytest.raises(ValueError, match="vocab maps"):
        PagedLM(model, hasher, torch.tensor(VOCAB[:10]), 300)
    with pytest.raises(ValueError, match="hasher"):
        PagedLM(model, None, torch.tensor(VOCAB), 300)
