"""A trained Engram-Nine run served from int8 and int4 table files (GGUF Q8_0 / Q4_0 blocks,
tables/blocks.py) written by `engram export-tables --table_dtype`: every registered file tier,
bare and behind a hot cache and prefetch, gives the same greedy tokens and logits (the file
tier's, which equal the memory tier's dequantised rows: tests/tables/test_blocks.py); `engram
generate --table_dtype` gives those tokens; a folder of another dtype is refused in one line.
The rows are rounded, so the logits are not the checkpoint's (what that costs is issue 47's
quality gate, not tested here)."""

import json

import numpy as np
import pytest
import torch
from tier_params import tier_fronts

from engram.cli import main
from engram.errors import UserError
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.loader import open_model
from engram.tables.registry import REGISTRY, TIERS
from engram.tables.tablefile import read_header, table_paths
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(max_chars=30_000, n_layer=3, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0, 2),
            warmup=1, eval_batches=1, log_every=1, eval_every=3, ckpt_every=3, lr=3e-3,
            hot_rows=40)
PROMPTS = ["In the beginning God created", "And God said, Let there be"]
KINDS = ("int8", "int4")


def _tokens(served, prompts):
    cfg = GenerationConfig(max_new_tokens=8)
    return Generator(served.model, served.hasher, served.vocab, cfg).generate(prompts).tokens


@torch.no_grad()
def _logits(served):
    train_ids = build_corpus(TrainConfig(**TINY).data_config()).train
    raw = torch.from_numpy(np.asarray(train_ids[:4 * 32], dtype=np.int64)).view(4, 32)
    local = torch.from_numpy(np.searchsorted(served.vocab, raw.numpy()))
    return served.model(local, served.hasher.hash(raw)).logits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Nine run (3 steps), its tables exported by the command line in both kinds ->
    (run, prompts, {kind: (folder, file tier's tokens, its logits)}, the checkpoint's logits)."""
    root = tmp_path_factory.mktemp("formats")
    run = root / "run"
    train(TrainConfig(out_dir=str(run), steps=3, shared_tables=True, **TINY), progress=False)
    memory = open_model(run)
    prompts = [memory.tokenizer.encode(p).ids for p in PROMPTS]
    out = {}
    for kind in KINDS:
        folder = root / f"tables-{kind}"
        assert main(["export-tables", str(run), "--table_dtype", kind,
                     "--table_dir", str(folder)]) == 0
        ref = open_model(run, tier="file", table_dir=folder, table_dtype=kind)
        out[kind] = (folder, _tokens(ref, prompts), _logits(ref))
        for p in table_paths(folder, ref.hasher):  # the cold part and Nine's hot part
            assert read_header(p).dtype == kind
    return run, prompts, out, _logits(memory)


@pytest.mark.parametrize("tier,front", tier_fronts([t for t in TIERS if t != "memory"]))
@pytest.mark.parametrize("kind", KINDS)
def test_every_tier_serves_the_same_tokens_and_logits(run, kind, tier, front):
    why = REGISTRY[tier].missing()
    if why:
        pytest.skip(f"tier {tier} cannot open on this machine: {why}")
    run_dir, prompts, ref, checkpoint = run
    folder, tokens, logits = ref[kind]
    extra = {"cache_fraction": 0.1, "prefetch": True} if front != "bare" else {}
    served = open_model(run_dir, tier=tier, table_dir=folder, table_dtype=kind, **extra)
    assert _tokens(served, prompts) == tokens
    got = _logits(served)
    assert torch.equal(got, logits)
    assert not torch.equal(got, checkpoint)  # rounded rows: not the trained model's logits


def test_generate_reads_the_format_and_refuses_another(run, tmp_path):
    run_dir, _, ref, _ = run
    folder, tokens, _ = ref["int4"]
    base = [str(run_dir), "--max-new-tokens", "8", "--no-stop", "--tier", "file",
            "--table_dir", str(folder)]
    for p in PROMPTS:
        base += ["--prompt", p]
    js = tmp_path / "out.json"
    assert main(["generate", *base, "--table_dtype", "int4", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["tokens"] == tokens
    with pytest.raises(UserError, match=r"holds int4 rows, int8 asked") as e:
        open_model(run_dir, tier="file", table_dir=folder, table_dtype="int8")
    assert "\n" not in str(e.value)
