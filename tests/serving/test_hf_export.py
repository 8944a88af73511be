"""engram export-hf: a model written once, loaded back on every registered tier, serves the same
greedy tokens as `engram generate` through the paged path; broken or foreign tables are refused at
load."""

import json
import shutil

import numpy as np
import pytest
import torch
from engine_sim import MiniEngine
from safetensors.torch import load_file

from engram import EngramConfig, EngramLM, ModelConfig, NgramHasher
from engram.errors import UserError
from engram.serving.generate import GenerationConfig, Generator
from engram.artifacts.export import read_export
from engram.artifacts.export import write as export_model
from engram.serving.hf_export import open_export
from engram.serving.paged import PagedLM
from engram.tables.registry import REGISTRY, TIERS
from engram.tables.tablefile import TableFileError

pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(deepseek, seed=0, d_model=64, n_head=2):
    """A random-weight model on DeepSeek's tokenizer with a restricted vocabulary of 600 ids;
    weights large enough that greedy tokens depend on the context (and on Engram)."""
    g = np.random.default_rng(seed)
    vocab = np.sort(g.choice(np.arange(1000, 60000), 600, replace=False))
    ecfg = EngramConfig(engram_vocab_size=[1009, 2003], max_ngram_size=3, n_embed_per_ngram=32,
                        n_head_per_ngram=4, layer_ids=[0, 1], pad_id=2)
    mc = ModelConfig(vocab_size=len(vocab), n_layer=2, d_model=d_model, n_head=n_head,
                     engram=ecfg, max_seq_len=96, init_std=0.2, table_init_std=1.0)
    torch.manual_seed(seed)
    model = EngramLM(mc).eval()
    for e in model.engrams().values():
        torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    hasher = NgramHasher(ecfg, deepseek)
    stream = torch.as_tensor(g.choice(vocab, 5000))
    return model, hasher, vocab, hasher.count_reads(stream)


def prompts(vocab, n, seed=1, lo=1, hi=40):
    g = np.random.default_rng(seed)
    return [[int(x) for x in g.choice(vocab, int(g.integers(lo, hi)))] for _ in range(n)]


def reference(model, hasher, vocab, ps, max_new):
    gen = Generator(model, hasher, vocab, GenerationConfig(max_new_tokens=max_new))
    return [gen.generate([p]).tokens[0] for p in ps]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, deepseek):
    model, hasher, vocab, counts = random_model(deepseek)
    out = export_model(model, hasher, vocab, tmp_path_factory.mktemp("export") / "m",
                       counts=counts, tag="test")
    return out, model, hasher, vocab


def load(out, **serving):
    return PagedLM(open_export(out, serving))  # the one runtime, as the vLLM model opens it


@pytest.mark.parametrize("serving", [{}] + [{"tier": t} for t in TIERS]
                         + [{"tier": "file", "cache_fraction": 0.05, "prefetch": True}])
def test_every_tier_serves_generate_s_tokens(exported, serving):
    why = REGISTRY[serving.get("tier", "memory")].missing()
    if why:
        pytest.skip(f"tier {serving['tier']} cannot open on this machine: {why}")
    out, model, hasher, vocab = exported
    paged = load(out, **serving)
    ps = prompts(vocab, 10)
    eng = MiniEngine(paged, block_size=8, chunk=7)
    for p in ps:
        eng.add(p, 6)
    while eng.step():
        pass
    want = reference(model, hasher, vocab, ps, 6)
    assert [r["out"] for r in eng.reqs] == want
    assert len({tuple(w) for w in want}) > 3  # the tokens depend on the prompt


def test_opening_takes_the_export_as_it_is_and_draws_nothing(exported):
    """Issue 48 (gpt-fast: build on meta, load with assign): the opened model's state dict is the
    exported model's bit for bit (without the tables a file tier reads from files), and opening
    leaves the global generator as it was."""
    out, model, _, _ = exported
    want = model.state_dict()
    untouched = torch.rand(4, generator=torch.Generator().manual_seed(0))
    for tier in ("memory", "file"):
        torch.manual_seed(0)
        got = open_export(out, {"tier": tier}).model.state_dict()
        assert torch.equal(torch.rand(4), untouched), tier
        assert set(got) == (set(want) if tier == "memory" else
                            {k for k in want if ".engram.table." not in k}), tier
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in got)


def test_export_layout(exported):
    out, model, _, vocab = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EngramLMForCausalLM"] and config["vocab_size"] >= 128000
    assert config["head_dim"] == 32 and config["engram_serving"]["tier"] == "memory"
    weights = load_file(str(out / "model.safetensors"))
    assert not any(".engram.table." in k for k in weights)  # tables live once, as table files
    assert torch.equal(weights["engram.vocab"], torch.as_tensor(vocab))


def test_bad_exports_are_refused_at_load(exported, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(exported[0], out)
    with pytest.raises(ValueError, match="tier must be one of"):
        read_export(out, {"tier": "nvme"})
    with pytest.raises(ValueError, match="unknown engram_serving keys"):
        read_export(out, {"tiers": "file"})
    table = out / "tables" / "layer1.table"
    data = table.read_bytes()
    table.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(TableFileError):
        load(out, tier="file")
    shutil.copyfile(out / "tables" / "layer0.table", table)  # layer 0's rows in layer 1's place
    with pytest.raises(TableFileError, match="layer"):
        load(out, tier="file")
    table.unlink()
    with pytest.raises(FileNotFoundError, match="missing a table file.*tables/layer1.table"):
        load(out, tier="memory")
    config = json.loads((out / "config.json").read_text())
    edited = {**config, "num_hidden_layers": config["num_hidden_layers"] + 1}
    (out / "config.json").write_text(json.dumps(edited))  # the HF copy of the shape, edited
    with pytest.raises(UserError, match="num_hidden_layers=.*engram_model"):
        load(out, tier="memory")
    config["engram_format"] = "something-else"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not an engram export"):
        read_export(out)


def test_tables_of_another_config_are_refused(exported, tmp_path, deepseek):
    other, hasher, vocab, counts = random_model(deepseek, seed=1)
    other.config.engram.seed = 7  # other multipliers: the same n-grams hash to other rows
    dst = export_model(other, NgramHasher(other.config.engram, deepseek), vocab, tmp_path / "o")
    out = tmp_path / "m"
    shutil.copytree(exported[0], out)
    shutil.copyfile(dst / "tables" / "layer0.table", out / "tables" / "layer0.table")
    with pytest.raises(TableFileError):
        load(out, tier="file")


def test_export_refuses_a_foreign_directory(exported, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model, hasher, vocab = exported[1], exported[2], exported[3]
    with pytest.raises(FileExistsError, match="not an export"):
        export_model(model, hasher, vocab, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_export_hf_cli_from_a_trained_run(tmp_path, capsys):
    """`engram export-hf RUN OUT` on a real (tiny) run: the paged model serves exactly what
    `engram generate` serves from the run, for text prompts through DeepSeek's tokenizer."""
    from engram.cli import main
    from engram.serving.loader import open_model
    from engram.training.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=2, n_layer=2, d_model=32, n_head=2, seq_len=32,
                      batch_size=2, table_size=500, max_chars=200_000, eval_every=2,
                      eval_batches=1, warmup=1), progress=False)
    assert main(["export-hf", str(run), str(tmp_path / "hf"), "--tier", "file"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    served = open_model(run)
    known = set(served.vocab.tolist())
    ps = [served.tokenizer.encode(t, add_special_tokens=False).ids for t in
          ("In the beginning God created the heaven and the earth.", "And God said", "And")]
    assert all(i in known for p in ps for i in p)
    paged = load(tmp_path / "hf")  # the export's default tier: file
    eng = MiniEngine(paged, block_size=4, chunk=3)
    for p in ps:
        eng.add(p, 5)
    while eng.step():
        pass
    assert [r["out"] for r in eng.reqs] == reference(served.model, served.hasher, served.vocab,
                                                      ps, 5)


@pytest.mark.parametrize("shared", [True, False])
def test_export_hf_of_a_nine_run_serves_generate_s_tokens(tmp_path, capsys, shared):
    """Engram-Nine through `engram export-hf`: the hot index travels in the table files; the paged
    model (the vLLM plugin's, on the MiniEngine) serves exactly `engram generate`'s tokens from
    every tier, with the slot history hashed by the run's NineHasher."""
    from engram.cli import main
    from engram.serving.loader import open_model
    from engram.training.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=2, n_layer=2, d_model=32, n_head=2, seq_len=32,
                      batch_size=2, table_size=500, max_chars=200_000, eval_every=2,
                      eval_batches=1, warmup=1, hot_rows=50, shared_tables=shared,
                      engram_layers=(0, 1)), progress=False)
    assert main(["export-hf", str(run), str(tmp_path / "hf"), "--tier", "file",
                 "--cache-fraction", "0.05", "--prefetch"]) == 0
    served = open_model(run)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["engram_nine"] == {"hot_slots": 100, "shared": shared}
    counts = load_file(str(tmp_path / "hf" / "tables" / "row_counts.safetensors"))
    assert sorted(counts) == (["0", "0.hot"] if shared else ["0", "0.hot", "1", "1.hot"])
    ps = [served.tokenizer.encode(t, add_special_tokens=False).ids for t in
          ("In the beginning God created the heaven and the earth.", "And God said", "And")]
    assert any(bool((i[..., -2:] >= 0).any()) for i in served.hasher.hash([ps[0]]).values())
    want = reference(served.model, served.hasher, served.vocab, ps, 5)
    for serving in ({}, {"tier": "memory"}, {"tier": "shared", "cache_fraction": 0.0},
                    {"tier": "pool"}, {"tier": "sharded", "cache_fraction": 0.05}):
        paged = load(tmp_path / "hf", **serving)
        assert paged.hasher.index.equals(served.hasher.index)
        eng = MiniEngine(paged, block_size=4, chunk=3)
        for p in ps:
            eng.add(p, 5)
        while eng.step():
            pass
        assert [r["out"] for r in eng.reqs] == want, serving
    config["engram_nine"]["hot_slots"] = 7
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(TableFileError, match="config.json says 7"):
        load(tmp_path / "hf")


def test_plugin_imports_without_vllm():
    import engram.serving.vllm_plugin as plugin

    assert callable(plugin.register)
