"""Serving a trained Engram-Nine run from table files: every registered tier
(engram.tables.registry), with and without a hot cache and prefetch, gives exactly the logits and
greedy tokens of the in-memory checkpoint, for one table set shared by several layers and for one
set per layer; foreign, stale, corrupted or truncated hot tier files are refused with errors naming
what differs; the `engram generate --tier file` command on a Nine run."""

import json
import shutil

import numpy as np
import pytest
import torch

from engram.artifacts.checkpoint import load_checkpoint, newest_checkpoint
from engram.cli import main
from engram.retrieval.hot import NineHasher, build_hot_index
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.loader import open_model, write_tables
from engram.tables.hotcold import check_index_files, hot_path, read_index_files, write_hot_tier
from engram.tables.registry import REGISTRY, TIERS, open_tier
from engram.tables.tablefile import TableFileError, table_path
from engram.training.corpus import build_corpus
from engram.training.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(max_chars=30_000, n_layer=3, d_model=32, n_head=2, seq_len=32, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0, 2),
            warmup=1, eval_batches=1, log_every=1, eval_every=3, ckpt_every=3, lr=3e-3,
            hot_rows=40)
PROMPTS = ["In the beginning God created", "And God said, Let there be"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny Nine runs on real text (3 steps): one table set shared by layers 0 and 2 (the
    paper's layout), and one set per layer; with their in-memory greedy tokens and logits."""
    root = tmp_path_factory.mktemp("nine-runs")
    out = {}
    for layout in ("shared", "own"):
        run = root / layout
        train(TrainConfig(out_dir=str(run), steps=3, shared_tables=layout == "shared", **TINY),
              progress=False)
        write_tables(run)  # the explicit step that writes RUN/tables (opening writes nothing)
        memory = open_model(run)
        prompts = [memory.tokenizer.encode(p).ids for p in PROMPTS]
        out[layout] = (run, prompts, _tokens(memory, prompts), _logits(memory))
    return out


def _train_tokens():
    return build_corpus(TrainConfig(**TINY).data_config()).train


def _tokens(served, prompts):
    cfg = GenerationConfig(max_new_tokens=8)
    return Generator(served.model, served.hasher, served.vocab, cfg).generate(prompts).tokens


@torch.no_grad()
def _logits(served):
    raw = torch.from_numpy(np.asarray(_train_tokens()[:4 * 32], dtype=np.int64)).view(4, 32)
    local = torch.from_numpy(np.searchsorted(served.vocab, raw.numpy()))
    assert np.array_equal(served.vocab[local.numpy()], raw.numpy())
    ids = served.hasher.hash(raw)
    g = served.hasher.config.max_ngram_size - 1
    assert all(bool((i[..., -g:] >= 0).any()) for i in ids.values())  # the hot tier is read
    return served.model(local, ids).logits


@pytest.mark.parametrize("layout", ["shared", "own"])
def test_opening_takes_the_checkpoint_as_it_is_and_draws_nothing(runs, layout):
    """Issue 48 (gpt-fast: build on meta, load with assign): the opened model's state dict is the
    checkpoint's bit for bit (the file tier's without the tables it reads from files), and
    opening leaves the global generator as it was; it used to draw an init seed and every table
    from it, only to overwrite them."""
    run = runs[layout][0]
    want = load_checkpoint(newest_checkpoint(run), parts=("model",))[0]["model"]
    untouched = torch.rand(4, generator=torch.Generator().manual_seed(0))
    for tier in ("memory", "file"):
        torch.manual_seed(0)
        got = open_model(run, tier=tier).model.state_dict()
        assert torch.equal(torch.rand(4), untouched), tier
        assert set(got) == (set(want) if tier == "memory" else
                            {k for k in want if ".engram.table." not in k})
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in got)


# open_model's "memory" serves the checkpoint's own tables: the reference every other registered
# tier must equal (the registry's memory tier, from table files, in tests/serving/test_hf_export).
FILE_TIERS = [t for t in TIERS if t != "memory"]


@pytest.mark.parametrize("layout,tier,cache,prefetch",
                         [("shared", t, 0.1, True) for t in FILE_TIERS]
                         + [("own", t, 0.0, False) for t in FILE_TIERS]
                         + [("shared", "file", 0.0, False), ("own", "shared", 0.1, True)])
def test_every_tier_serves_exactly_what_memory_serves(runs, layout, tier, cache, prefetch):
    why = REGISTRY[tier].missing()
    if why:
        pytest.skip(f"tier {tier} cannot open on this machine: {why}")
    run, prompts, tokens, logits = runs[layout]
    served = open_model(run, tier=tier, cache_fraction=cache, prefetch=prefetch)
    assert _tokens(served, prompts) == tokens
    stores = {id(t): t for t in served.tables.values()}
    assert len(stores) == (1 if layout == "shared" else 2)  # a shared set is one store
    assert all(type(t).__name__ == "HotColdStore" for t in stores.values())
    # the layers read the tier's stores, not tables of the model's own
    assert all(e.table is served.tables[lid] for lid, e in served.model.engrams().items())
    if prefetch:  # every generation step's rows were gathered ahead, on both tiers
        for t in stores.values():
            for part in (t.cold, t.hot):
                assert part.stats.used > 0 and part.stats.sync == 0, part.stats
    assert torch.equal(_logits(served), logits)


def test_foreign_stale_or_damaged_hot_tier_files_are_refused(runs, tmp_path):
    run, *_ = runs["shared"]
    served = open_model(run, tier="file")
    tables, cfg, nine = run / "tables", served.hasher.config, served.hasher
    # Another hot index over the same hashed tables: its rows would serve other n-grams.
    other = NineHasher(nine.hasher, build_hot_index(nine.hasher, _train_tokens(), 30),
                       shared=True)
    with pytest.raises(TableFileError, match="another Engram-Nine hot tier.*slots: file 80 vs "
                                             "model 60"):
        open_tier("file", tables, cfg, other)
    # A plain run, and the per-layer layout, read the shared set differently.
    with pytest.raises(TableFileError, match="exported from an Engram-Nine run"):
        open_tier("file", tables, cfg, nine.hasher)
    with pytest.raises(TableFileError, match=r"layers: file \[0, 2\] vs model \[0\]"):
        open_tier("file", tables, cfg, NineHasher(nine.hasher, nine.index, shared=False))
    with pytest.raises(TableFileError, match="another hot index"):
        check_index_files(tables, cfg, other)
    # A stale export (another run's files under the same checkpoint name) is refused, not used.
    stale = tmp_path / "stale"
    shutil.copytree(tables, stale)
    write_hot_tier(hot_path(stale, 0), other.index, None, cfg, tag=served.checkpoint)
    with pytest.raises(TableFileError, match="another hot index"):
        open_model(run, tier="file", table_dir=stale)
    # A hot file under another layer's name; a cold file where the hot one belongs.
    own = tmp_path / "own"
    shutil.copytree(runs["own"][0] / "tables", own)
    shutil.copyfile(table_path(own, 0, "hot"), table_path(own, 2, "hot"))
    with pytest.raises(TableFileError, match="holds layer 0, expected layer 2"):
        open_tier("file", own, cfg, open_model(runs["own"][0]).hasher, verify=False)
    shutil.copyfile(table_path(stale, 0), table_path(stale, 0, "hot"))
    with pytest.raises(TableFileError, match="the hot table of layer 0 needs 80 x 32"):
        open_tier("file", stale, cfg, nine, verify=False)
    # Corrupted and truncated hot tier files.
    broken = tmp_path / "broken"
    shutil.copytree(tables, broken)
    path = table_path(broken, 0, "hot")
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TableFileError, match="checksum mismatch in chunk 0"):
        open_tier("pinned", broken, cfg, nine)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(TableFileError, match="truncated"):
        open_tier("shared", broken, cfg, nine)
    index_file = hot_path(broken, 0)
    data = bytearray(index_file.read_bytes())
    data[-3] ^= 0xFF
    index_file.write_bytes(bytes(data))
    with pytest.raises(TableFileError, match="checksum"):
        read_index_files(broken, cfg, nine.hasher, {"hot_slots": 80, "shared": True})


def test_cli_generates_from_a_nine_run_on_the_file_tier(runs, tmp_path, capsys):
    run, *_ = runs["shared"]
    base = [str(run), "--max-new-tokens", "6", "--no-stop"]
    for p in PROMPTS:
        base += ["--prompt", p]
    outputs = {}
    for tier, extra in (("memory", []), ("file", ["--cache-fraction", "0.05", "--prefetch"])):
        js = tmp_path / f"{tier}.json"
        assert main(["generate", *base, "--tier", tier, "--json", str(js), *extra]) == 0
        outputs[tier] = json.loads(js.read_text())["tokens"]
    assert outputs["file"] == outputs["memory"] and [len(t) for t in outputs["file"]] == [6, 6]
    assert "file tables" in capsys.readouterr().err
