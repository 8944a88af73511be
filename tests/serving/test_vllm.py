"""vLLM with the engram plugin: greedy completions equal `engram generate`'s token for token, for
64 requests in flight with prompts of 1-87 tokens (longer than one 64-token prefill chunk), prefix
caching on with shared prefixes, and with the tables in memory, on the file tier behind a hot cache
and prefetch, and on the shared pool; and requests preempted for want of KV blocks resume exactly.

vLLM runs in its own process; its Python is ``ENGRAM_VLLM_PYTHON`` (.ci/run makes a venv for it)
or this one if it imports vllm. Skipped cleanly when neither has vLLM.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_hf_export import prompts, random_model, reference

from engram.artifacts.export import write as export_model

VLLM_PYTHON = os.environ.get("ENGRAM_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") is not None else None)
pytestmark = [pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed (see README)"),
              pytest.mark.usefixtures("one_thread")]
MAX_NEW = 8
VLLM_RUN = Path(__file__).parents[2] / "benchmarks" / "vllm_run.py"  # run by its path
RUNS = {}  # the memory tier's vLLM tokens, for the transformers comparison below


def run_vllm(model_dir, ps, tmp_path, name, overrides=None, kv_blocks=None, max_new=MAX_NEW,
             in_process=True):
    """vLLM's greedy tokens for prompts ``ps``. ``in_process``: the engine in one process (an
    engine start ~half as long); test_vllm_greedy_equals_engram_generate runs it as a server does,
    the engine core and its worker in processes of their own (where our plugin is imported anew)."""
    req, res = tmp_path / f"{name}.req.json", tmp_path / f"{name}.res.json"
    req.write_text(json.dumps({"prompts": ps, "max_tokens": max_new}))
    cmd = [VLLM_PYTHON, str(VLLM_RUN), str(model_dir), "--requests", str(req),
           "--result", str(res), "--hf_overrides", json.dumps(overrides or {}),
           "--max_num_batched_tokens", "64", "--max_num_seqs", "64"]
    cmd += [] if kv_blocks is None else ["--kv_blocks", str(kv_blocks)]
    cmd += ["--in_process"] if in_process else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(res.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory, deepseek):
    model, hasher, vocab, counts = random_model(deepseek, d_model=128, n_head=2)  # head dim 64
    out = export_model(model, hasher, vocab, tmp_path_factory.mktemp("vllm") / "m", counts=counts)
    ps = prompts(vocab, 48, seed=3, lo=1, hi=80)
    shared = prompts(vocab, 1, seed=4, lo=45, hi=46)[0]  # a 45-token prefix: one full block
    ps += [shared + p for p in prompts(vocab, 16, seed=5, lo=1, hi=30)]
    return out, ps, reference(model, hasher, vocab, ps, MAX_NEW), (model, hasher, vocab)


# The memory tier in the default run; the others slow-marked: each is an engine start (~40 s), and
# every tier's rows through the same PagedLM are checked in the default run on the mini engine
# (tests/serving/test_hf_export.py test_every_tier_serves_generate_s_tokens).
@pytest.mark.parametrize("overrides", [
    None,
    pytest.param({"engram_serving": {"tier": "file", "cache_fraction": 0.05, "prefetch": True}},
                 marks=pytest.mark.slow),
    pytest.param({"engram_serving": {"tier": "shared"}}, marks=pytest.mark.slow),
], ids=["memory", "file-cache-prefetch", "shared"])
def test_vllm_greedy_equals_engram_generate(served, tmp_path, overrides):
    out, ps, want, _ = served
    got = run_vllm(out, ps, tmp_path, "run", overrides, in_process=False)
    if overrides is None:
        RUNS["memory"] = got
    assert len(ps) == 64 and max(map(len, ps)) > 64  # chunked prefill
    mismatched = [i for i, (g, w) in enumerate(zip(got["tokens"], want)) if g != w]
    assert not mismatched, (f"{len(mismatched)} of {len(ps)} requests differ, e.g. #{mismatched[0]}:"
                            f" vllm {got['tokens'][mismatched[0]]} vs {want[mismatched[0]]}")
    assert len({tuple(w) for w in want}) > 10
    assert np.isfinite(got["tokens_per_s"])
    assert got["counters"]["vllm:prefix_cache_hits"] > 0  # the shared prefix came from the cache


def test_vllm_preempted_requests_resume_exactly(served, tmp_path):
    """10 KV blocks of 32 slots for 24 requests growing from ~25 to ~65 tokens: vLLM preempts
    running requests and recomputes them; their history slots are rewritten, tokens unchanged."""
    out, _, _, (model, hasher, vocab) = served
    ps = prompts(vocab, 24, seed=6, lo=20, hi=30)
    got = run_vllm(out, ps, tmp_path, "preempt", kv_blocks=10, max_new=40)
    assert got["tokens"] == reference(model, hasher, vocab, ps, 40)
    assert got["counters"]["vllm:num_preemptions"] > 0, got["counters"]


def test_vllm_serves_an_imported_v41_layer_set(tmp_path):
    """A DeepSeek-V4.1 layer set (import-v41 of a random tiny checkpoint) in a tiny v4.1 run,
    exported with fp8 tables that keep the checkpoint's E8M0 scales: vLLM on the file tier
    generates what `engram generate` does on the memory tier."""
    from test_v41_serving import RUN
    from v41_ckpt import make_checkpoint

    from engram.artifacts.layer_set import import_v41
    from engram.serving.generate import GenerationConfig, Generator
    from engram.serving.loader import export_hf
    from engram.serving.loader import open_model
    from engram.training.train import TrainConfig, train

    train(TrainConfig(out_dir=str(tmp_path / "run"), **{**RUN, "seq_len": 96}), progress=False)
    make_checkpoint(tmp_path / "ckpt", seed=3)
    import_v41(tmp_path / "ckpt", tmp_path / "layers")
    out = export_hf(tmp_path / "run", tmp_path / "hf", table_dtype="fp8",
                    engram_layers=tmp_path / "layers")
    served = open_model(tmp_path / "run", engram_layers=tmp_path / "layers")
    g = np.random.default_rng(7)
    ps = [[int(x) for x in g.choice(served.vocab, int(g.integers(1, 80)))] for _ in range(12)]
    gen = Generator(served.model, served.hasher, served.vocab,
                    GenerationConfig(max_new_tokens=MAX_NEW))
    want = [gen.generate([p]).tokens[0] for p in ps]
    assert max(map(len, ps)) > 64  # chunked prefill
    got = run_vllm(out, ps, tmp_path, "v41", {"engram_serving": {"tier": "file"}})
    assert got["tokens"] == want


def test_transformers_generate_equals_vllm(served, tmp_path):
    """The same export through AutoModelForCausalLM (left-padded batches of 16): vLLM's tokens."""
    from test_hf_model import greedy
    from transformers import AutoModelForCausalLM

    out, ps, want, _ = served
    got = RUNS.get("memory") or run_vllm(out, ps, tmp_path, "hf")
    m = AutoModelForCausalLM.from_pretrained(out)
    hf = [t for a in range(0, len(ps), 16) for t in greedy(m, ps[a:a + 16], max_new=MAX_NEW)]
    assert hf == got["tokens"] == want
