"""The digit data, styles and judge of the vision study (real scikit-learn digits)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn")

from engram.studies import digits as D  # noqa: E402


def test_bold_style_adds_ink_and_keeps_the_digit():
    base, _ = D.load_digits()
    x = base.images[:20]
    bold = D.style(x, "bold")
    assert bold.shape == x.shape and bool((bold >= x).all()) and bold.sum() > x.sum()
    assert torch.equal(D.style(x, "bold", 3), F.max_pool2d(x, 3, stride=1, padding=1))
    with pytest.raises(ValueError, match="unknown style"):
        D.style(x, "italic")


def test_judge_reads_real_digits_and_style():
    base, judge_data = D.load_digits()
    assert len(base.labels) + len(judge_data.labels) == 1797
    assert set(base.labels.tolist()) == set(range(10))
    judge = D.Judge(judge_data)
    acc = judge.accuracy(D.Digits(base.images[:300], base.labels[:300]))  # digits it never saw
    assert acc["digit_plain"] > 0.85 and acc["bold_bold"] > 0.9 and acc["bold_plain"] > 0.9


def test_base_model_trains_through_fit_on_the_one_schedule():
    """train_base is loop.fit around the loop it always had (AdamW, clip at 1, the batches and
    noise from one generator), with loop.schedule's rates: equal, bit for bit, to that loop."""
    pytest.importorskip("diffusers")
    from engram.training.loop import schedule

    base, _ = D.load_digits()

    def encode(prompts):  # a stand-in for MiniLM: fixed random embeddings, one per caption
        g = torch.Generator().manual_seed(len(prompts))
        return (torch.randn(len(prompts), D.MAX_TOKENS, 384, generator=g),
                torch.ones(len(prompts), D.MAX_TOKENS, dtype=torch.long))

    steps, batch, lr = 8, 8, 2e-3
    unet = D.build_unet(8)
    curve = D.train_base(unet, encode, base, steps, batch=batch, lr=lr, progress=False)

    ref_unet = D.build_unet(8)
    sched, _ = D.schedulers()
    table, masks = encode([""] + [t.format(w) for t in D.STYLES.values() for w in D.WORDS])
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(ref_unet.parameters(), lr=lr, weight_decay=0.0)
    ref_unet.train()
    ref = []
    for step in range(steps):
        idx = torch.randint(0, len(base.labels), (batch,), generator=gen)
        st = torch.randint(0, len(D.STYLES), (batch,), generator=gen)
        imgs = torch.stack([D.style(base.images[i:i + 1], list(D.STYLES)[s])[0]
                            for i, s in zip(idx.tolist(), st.tolist())])
        cap = 1 + st * 10 + base.labels[idx]
        cap = torch.where(torch.rand(batch, generator=gen) < 0.1, torch.zeros_like(cap), cap)
        for g in opt.param_groups:
            g["lr"] = schedule(step, steps, D.BASE_WARMUP, 0.1, lr)
        loss = D.diffusion_loss(ref_unet, sched, imgs, table[cap], masks[cap], gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_unet.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(float(loss.detach()))
    assert curve == ref and len(set(curve)) == steps
    assert not unet.training
    assert all(torch.equal(a, b) for a, b in zip(unet.parameters(), ref_unet.parameters()))
