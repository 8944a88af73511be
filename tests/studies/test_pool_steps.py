"""The pool budget's model side: t_exec per layer by hooks sums to a measured forward (within 10%),
the hooks leave the model as it was, and a decode step's hash ids are the full sequence's last."""

import pytest
import torch

from engram.studies.pool_steps import LayerClock, build_setup, run_step, steps, time_layers
from engram.training.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    return build_setup(None, TrainConfig(max_chars=30_000, engram_layers=(1, 2)), seed=0)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_layer_times_sum_to_forward(setup, mode):
    batch = steps(setup, mode, batch=4, prefill_len=96, decode_context=32, reps=15)
    for attempt in range(4):  # a shared machine: a burst of load can hit one side; a gap stays
        t = time_layers(setup.rt, batch)
        gap = abs(t["parts_over_forward"] - 1)  # per step, hooked vs plain call back to back
        if gap < 0.10:
            break
    assert gap < 0.10, (t["parts_sum_s"], t["forward_s"], t["parts_over_forward"])
    assert len(t["block_s"]) == 4 and all(b > 0 for b in t["block_s"])
    w = t["window_s"]  # window of depth k: embedding + blocks before k
    assert w[0] == t["embed_s"] and w[3] == pytest.approx(t["embed_s"] + sum(t["block_s"][:3]))


def test_hooks_are_removed_and_outputs_unchanged(setup):
    step = steps(setup, "prefill", 2, 16, 8, 1)[0]["step"]
    with torch.no_grad():
        ref = setup.model(step.local, step.ids).hidden
        clock = LayerClock(setup.model)
        hooked = setup.model(step.local, step.ids).hidden
        clock.remove()
    assert torch.equal(ref, hooked) and set(clock.times) == {"embed", "norm"} | {
        f"block{i}" for i in range(4)}
    assert not any(b._forward_hooks or b._forward_pre_hooks for b in setup.model.blocks)
    assert run_step(setup.rt, {"step": step})[0] > 0
    assert torch.equal(setup.rt.run(step).hidden, ref)  # the runtime's step is the model's


def test_decode_step_ids_equal_full_sequence(setup):
    for s in steps(setup, "decode", 3, 8, 20, 2):
        raw = setup.corpus.to_raw(torch.cat([s["prompt"].local, s["step"].local], 1))
        full = setup.hasher.hash(raw)
        for lid, ids in s["step"].ids.items():
            assert torch.equal(ids, full[lid][:, -1:])
        assert s["step"].local.shape == (3, 1) and s["prompt"].local.shape == (3, 20)
