"""loop.fit: hooks see every step in order, with the schedule's lr and the step's loss, and the
state they keep in run.hook_state comes back with a resumed run; a study's own loss goes through
the same loop and the same schedule."""

import dataclasses
import math

import pytest
import torch

from engram.training.corpus import DataConfig, build_corpus
from engram.training.hooks import LossCurve, SaveCheckpoints
from engram.training.loop import LoopConfig, fit, loss_run, lr_at, restore, schedule
from engram.training.optim import Optimizers
from engram.training.train import FileCheckpoints, TrainConfig, build_run

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=2, eval_batches=2, lr=3e-3)


class Recorder:
    """A hook that writes down what it sees and counts steps in run.hook_state."""

    def __init__(self):
        self.seen = []

    def start(self, run):
        self.seen.append(("start", run.step))
        run.hook_state.setdefault("steps_seen", 0)

    def after_step(self, run, lr, loss):
        self.seen.append(("step", run.step, lr, loss, run.window))
        run.hook_state["steps_seen"] += 1

    def end(self, run):
        self.seen.append(("end", run.step))


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(DataConfig(max_chars=TINY["max_chars"]))


def test_hooks_see_every_step_and_their_state_survives_a_resume(tmp_path, corpus):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), steps=4, **TINY)
    run, rec = build_run(cfg, corpus), Recorder()
    fit(run, [rec, SaveCheckpoints(FileCheckpoints(cfg.out_dir), every=3)])
    assert rec.seen[0] == ("start", 0) and rec.seen[-1] == ("end", 4)
    steps = rec.seen[1:-1]
    assert [s[1] for s in steps] == [1, 2, 3, 4]
    assert [s[2] for s in steps] == [lr_at(i, cfg) for i in range(4)]
    assert steps[-1][4] == (4, sum(s[3] for s in steps))  # nothing reset the window
    assert len(set(s[3] for s in steps)) == 4 and all(s[3] > 0 for s in steps)
    # Saved at 3 and at the last step: a longer run resumes at 4 with the hook's count.
    longer = build_run(dataclasses.replace(cfg, steps=6), corpus)
    assert restore(longer, FileCheckpoints(cfg.out_dir))
    assert longer.step == 4 and longer.hook_state == {"steps_seen": 4}
    rec = Recorder()
    fit(longer, [rec])
    assert [s[1] for s in rec.seen[1:-1]] == [5, 6] and longer.hook_state == {"steps_seen": 6}


def test_one_schedule_for_every_run():
    c = TrainConfig(steps=100, warmup=10, lr=3e-3, min_lr_ratio=0.1)
    same = LoopConfig(steps=100, lr=3e-3, warmup=10, min_lr_ratio=0.1)
    # engram train's rates, bit for bit the formula it always had (peak times the ramp, in order).
    old = [3e-3 * (s + 1) / 10 if s < 10 else 3e-3 * (0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - 10) / 90)))) for s in range(100)]
    assert [lr_at(s, c) for s in range(100)] == [schedule(s, 100, 10, 0.1, 3e-3)
                                                 for s in range(100)] == old
    assert [lr_at(s, same) for s in range(100)] == old
    assert schedule(9, 100, 10, 0.1) == 1.0 and schedule(100, 100, 10, 0.1) == pytest.approx(0.1)
    # A LoopConfig's defaults (no warmup, floor 1): a constant rate, exactly.
    assert {lr_at(s, LoopConfig(steps=50, lr=0.07)) for s in range(50)} == {0.07}


class Lrs:
    def start(self, run):
        self.seen = []

    def after_step(self, run, lr, loss):
        self.seen.append(lr)

    def end(self, run):
        pass


def test_a_custom_loss_through_fit_is_the_hand_written_loop():
    """loss_run + fit == schedule, forward, backward, clip, AdamW step, zero_grad, bit for bit."""
    x, y = torch.randn(64, 5, generator=torch.Generator().manual_seed(1)), torch.randn(64, 3)
    cfg = LoopConfig(steps=12, lr=0.05, warmup=3, min_lr_ratio=0.1, grad_clip=0.5)

    def trained(through_fit):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        gen = torch.Generator().manual_seed(0)

        def batch(i):
            return torch.randint(0, 64, (8,), generator=gen)

        def loss(module, rows):
            return (module(x[rows]) - y[rows]).pow(2).mean()
        if through_fit:
            curve, lrs = LossCurve("t", progress=False), Lrs()
            fit(loss_run(cfg, model, Optimizers(opt, None, 1.0), batch, loss), [curve, lrs])
            return model, curve.losses, lrs.seen
        losses, lrs = [], []
        for step in range(cfg.steps):
            lrs.append(schedule(step, cfg.steps, cfg.warmup, cfg.min_lr_ratio, cfg.lr))
            for g in opt.param_groups:
                g["lr"] = lrs[-1]
            out = loss(model, batch(step))
            out.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.detach()))
        return model, losses, lrs

    (a, la, ra), (b, lb, rb) = trained(True), trained(False)
    assert la == lb and ra == rb and len(la) == cfg.steps and la[-1] < la[0]
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert all(p.grad is None for p in a.parameters())  # nothing left for the next user
