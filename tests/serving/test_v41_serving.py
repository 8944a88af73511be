"""A DeepSeek-V4.1 Engram layer set (imported from a random tiny V4.1-layout checkpoint) served in a
tiny v4.1 run: `engram generate` gives the same tokens and logits on every tier; an `export-hf` of
it (fp8 tables with the checkpoint's E8M0 scales) serves those tokens through the paged path vLLM
uses, on every tier; `engram export-v41` from the run gives the checkpoint back."""

import json

import numpy as np
import pytest
import torch
from engine_sim import MiniEngine
from v41_ckpt import engram_tensors, make_checkpoint, same_tensor

from engram.artifacts.layer_set import import_v41
from engram.cli import main
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.hf_export import open_export
from engram.serving.loader import export_hf
from engram.serving.loader import open_model
from engram.serving.paged import PagedLM
from engram.serving.v41 import export_v41_checkpoint
from engram.tables.tablefile import read_header
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
# The checkpoint's shape (tests/v41_ckpt.py TINY): Engram at layers 1 and 2, d 64, 2 branches,
# 2 heads of 32 per order, orders 2..3, tables from 97, pad id 1.
RUN = dict(max_chars=30_000, n_layer=3, d_model=64, n_head=1, seq_len=32, batch_size=4,
           hc_mult=2, engram_profile="v4.1", engram_layers=(1, 2), table_size=97,
           max_ngram_size=3, n_head_per_ngram=2, n_embed_per_ngram=64, warmup=1, eval_batches=1,
           log_every=1, eval_every=3, ckpt_every=3, steps=1)
PROMPTS = ["In the beginning God created", "And God said, Let there be"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-serving")
    train(TrainConfig(out_dir=str(root / "run"), **RUN), progress=False)
    written = make_checkpoint(root / "ckpt", seed=3)
    import_v41(root / "ckpt", root / "layers")
    served = open_model(root / "run", engram_layers=root / "layers")
    prompts = [served.tokenizer.encode(p).ids for p in PROMPTS]
    return root, written, served, prompts, _tokens(served, prompts), _logits(served)


def _tokens(served, prompts):
    gen = Generator(served.model, served.hasher, served.vocab, GenerationConfig(max_new_tokens=8))
    return gen.generate(prompts).tokens


@torch.no_grad()
def _logits(served):
    raw = torch.from_numpy(np.asarray(build_corpus(TrainConfig(**RUN).data_config()).train[:64], dtype=np.int64)).view(2, 32)
    local = torch.from_numpy(np.searchsorted(served.vocab, raw.numpy()))
    return served.model(local, served.hasher.hash(raw)).logits


def test_the_layer_set_replaces_the_runs_engram(setup):
    root, written, served, prompts, tokens, logits = setup
    own = open_model(root / "run")
    assert not torch.equal(_logits(own), logits)  # the imported layers are what runs
    eng = served.model.engrams()[2]
    kv = eng.kv_proj.weight
    w = written["layers.2.engram.wkv.weight"].float()
    assert torch.equal(kv, torch.cat([w[-64:], w[:-64]]))  # value first here, last there
    assert eng.gate == "demo" and eng.norm1[0].eps == 1e-6


@pytest.mark.parametrize("tier,cache,prefetch", [("file", 0.0, False), ("file", 0.1, True),
                                                 ("pinned", 0.0, False), ("shared", 0.0, True)])
def test_every_tier_serves_what_memory_serves(setup, tier, cache, prefetch):
    root, _, _, prompts, tokens, logits = setup
    served = open_model(root / "run", tier=tier, cache_fraction=cache, prefetch=prefetch,
                      engram_layers=root / "layers")
    assert not any(".engram.table." in k for k in served.model.state_dict())  # rows stay outside
    assert _tokens(served, prompts) == tokens
    assert torch.equal(_logits(served), logits)


def test_cli_generate_with_a_layer_set_on_every_tier(setup, tmp_path, capsys):
    root = setup[0]
    base = ["generate", str(root / "run"), "--engram-layers", str(root / "layers"), "--prompt",
            PROMPTS[0], "--max-new-tokens", "5", "--no-stop"]
    got = {}
    for tier in ("memory", "file", "pinned", "shared"):
        assert main(base + ["--tier", tier, "--json", str(tmp_path / "g.json")]) == 0
        got[tier] = json.loads((tmp_path / "g.json").read_text())["tokens"]
    capsys.readouterr()
    assert all(t == got["memory"] for t in got.values()) and len(got["memory"][0]) == 5
    other = tmp_path / "other"  # a layer set of another shape is refused, naming what differs
    make_checkpoint(tmp_path / "ck2", hidden_size=32)
    import_v41(tmp_path / "ck2", other)
    assert main(base[:2] + ["--engram-layers", str(other), "--prompt", "x"]) == 2
    assert "hidden size: layer set 32 vs model 64" in capsys.readouterr().err


def test_export_hf_serves_the_layer_set_on_every_tier(setup, tmp_path):
    root, written, served, prompts, _, _ = setup
    out = export_hf(root / "run", tmp_path / "hf", table_dtype="fp8",
                    engram_layers=root / "layers")
    h = read_header(out / "tables" / "layer1.table")
    assert (h.dtype, h.scale_format) == ("fp8", "e8m0")
    want = _tokens(served, prompts)
    for serving in ({}, {"tier": "file", "cache_fraction": 0.05, "prefetch": True},
                    {"tier": "pinned"}, {"tier": "shared"}):
        rt = open_export(out, serving)
        table = rt.model.engrams()[1].table
        rows = torch.arange(0, table.num_rows, 7)
        assert torch.equal(table.lookup(rows), served.model.engrams()[1].table.lookup(rows))
        eng = MiniEngine(PagedLM(rt), block_size=8,
                         chunk=5)
        for p in prompts:
            eng.add(p, 8)
        while eng.step():
            pass
        assert [r["out"] for r in eng.reqs] == want, serving


def test_export_v41_from_the_run_gives_the_checkpoint_back(setup, tmp_path):
    root, written, *_ = setup
    export_v41_checkpoint(root / "run", tmp_path / "ckpt", engram_layers=root / "layers")
    back = engram_tensors(tmp_path / "ckpt")
    for k, v in written.items():  # weights byte for byte; rows re-quantised losslessly
        if ".engram." in k and ".embed." not in k:
            assert same_tensor(back[k], v), k
    for lid in (1, 2):
        p = f"layers.{lid}.engram."

        def rows(w):
            s = torch.pow(2.0, w[p + "embed.scale"].view(torch.uint8).float() - 127)
            return w[p + "embed.weight"].float() * s.repeat_interleave(32, 1)
        assert torch.equal(rows(back), rows(written))
    # a plain v4.1 run of ours exports too, and its checkpoint imports back to the same model
    export_v41_checkpoint(root / "run", tmp_path / "own")
    import_v41(tmp_path / "own", tmp_path / "own-layers")
    again = open_model(root / "run", engram_layers=tmp_path / "own-layers")
    own = open_model(root / "run")
    torch.testing.assert_close(_logits(again), _logits(own), rtol=0.05, atol=0.05)  # bf16 weights
