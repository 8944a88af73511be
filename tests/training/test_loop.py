"""loop.fit: hooks see every step in order, with the schedule's lr and the step's loss, and the
state they keep in run.hook_state comes back with a resumed run."""

import dataclasses

import pytest

from engram.training.corpus import DataConfig, build_corpus
from engram.training.hooks import SaveCheckpoints
from engram.training.loop import fit, lr_at, restore
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
