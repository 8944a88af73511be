"""Generation: batched incremental decoding == recomputing the full sequence every step (left-padded
prompts of different lengths, both profiles, tables in memory or behind file + cache + prefetch);
stop ids, sampling, errors; the CLI on a real (tiny) trained run, on every registered tier."""

import json

import numpy as np
import pytest
import torch

from engram import EngramConfig, EngramLM, ModelConfig, NgramHasher
from engram.artifacts.table_files import export_tables
from engram.cli import main
from engram.serving.generate import GenerationConfig, Generator
from engram.serving.loader import load_dense_state
from engram.tables.cache import CachedTable
from engram.tables.prefetch import wrap_prefetch
from engram.tables.registry import REGISTRY
from engram.tables.tiers import open_tables
from engram.training.train import TrainConfig, train

LOOKUP = np.arange(300) % 250
PROFILES = {
    "demo-v1": EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=16,
                            n_head_per_ngram=4, layer_ids=[0, 2], pad_id=0),
    "v4.1": EngramConfig(engram_vocab_size=157, max_ngram_size=3, n_embed_per_ngram=16,
                         n_head_per_ngram=4, layer_ids=[1], pad_id=0, profile="v4.1"),
}
VOCAB = np.sort(np.random.default_rng(0).choice(300, 120, replace=False))  # a restricted vocabulary


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(profile, hc_mult=1, head="full"):
    cfg = PROFILES[profile]
    mc = ModelConfig(vocab_size=len(VOCAB), n_layer=3, d_model=32, n_head=2, engram=cfg,
                     max_seq_len=40, hc_mult=hc_mult, head=head, head_cutoffs=(16, 64))
    torch.manual_seed(0)
    model = EngramLM(mc).eval()
    for e in model.engrams().values():  # a live conv: decode must carry its state
        if e.short_conv is not None:
            torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    return model, NgramHasher(cfg, LOOKUP)


@torch.no_grad()
def _recompute(model, hasher, prompt, n):
    """The reference: the whole sequence through the model, no cache, at every step."""
    raw = list(prompt)
    for _ in range(n):
        x = torch.tensor([raw])
        local = torch.from_numpy(np.searchsorted(VOCAB, x.numpy()))
        raw.append(int(VOCAB[int(model(local, hasher.hash(x)).logits[0, -1].argmax())]))
    return raw[len(prompt):]


def _left_padded(lengths, seed=1):
    g = np.random.default_rng(seed)
    t = max(lengths)
    x = np.zeros((len(lengths), t), dtype=np.int64)
    mask = np.zeros_like(x)
    for i, n in enumerate(lengths):
        x[i, t - n:] = g.choice(VOCAB, n)
        mask[i, t - n:] = 1
    return torch.from_numpy(x), torch.from_numpy(mask)


@pytest.mark.parametrize("profile,hc,head", [("demo-v1", 1, "full"), ("v4.1", 1, "full"),
                                             ("demo-v1", 2, "full"), ("demo-v1", 1, "adaptive")])
def test_greedy_equals_full_recompute_with_left_padded_prompts(profile, hc, head):
    model, hasher = _model(profile, hc, head)
    lengths = [6, 1, 9, 6, 3]
    x, mask = _left_padded(lengths)
    out = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=8)).generate(x, mask)
    for row, m, got in zip(x, mask, out.tokens):
        assert got == _recompute(model, hasher, row[m.bool()].tolist(), 8)
    assert out.prefill_tokens == sum(lengths) and out.decode_tokens == 7 * len(lengths)


def test_tables_on_file_cache_prefetch_generate_the_same(tmp_path):
    model, hasher = _model("demo-v1")
    export_tables(model, tmp_path, hasher=hasher, dtype="fp32")
    files = open_tables(tmp_path, model.config.engram, hasher)
    tables = wrap_prefetch({lid: CachedTable(t, 50, hot_rows=torch.arange(20))
                            for lid, t in files.items()})
    offloaded = EngramLM(model.config, tables=tables).eval()
    load_dense_state(offloaded, model.state_dict())
    x, mask = _left_padded([4, 7, 2], seed=3)
    cfg = GenerationConfig(max_new_tokens=10)
    want = Generator(model, hasher, VOCAB, cfg).generate(x, mask).tokens
    assert Generator(offloaded, hasher, VOCAB, cfg).generate(x, mask).tokens == want
    assert all(t.stats.used > 0 and t.stats.sync == 0 for t in tables.values())


def test_stop_ids_sampling_and_errors():
    model, hasher = _model("demo-v1")
    prompts = [[int(VOCAB[5]), int(VOCAB[9])], [int(VOCAB[1])]]
    greedy = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=6)).generate(prompts)
    stop = greedy.tokens[0][2]
    out = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=6, stop_ids=(stop,))
                    ).generate(prompts).tokens
    assert out[0] == greedy.tokens[0][:3]  # stops at (and keeps) the stop id
    assert len(out[1]) == 6 or out[1][-1] == stop
    sample = GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=5, seed=3)
    a = Generator(model, hasher, VOCAB, sample).generate(prompts).tokens
    assert a == Generator(model, hasher, VOCAB, sample).generate(prompts).tokens
    assert all(t in set(VOCAB.tolist()) for row in a for t in row)
    gen = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=40))
    with pytest.raises(ValueError, match="max_seq_len=40"):
        gen.generate(prompts)
    with pytest.raises(ValueError, match="needs left padding"):
        gen.generate(torch.tensor([[int(VOCAB[1]), 0]]), torch.tensor([[1, 0]]))
    unseen = int(np.setdiff1d(np.arange(300), VOCAB)[0])  # the runtime's policy: warned, read
    with pytest.warns(UserWarning, match="never occurred in training"):  # as the mean embedding
        assert len(Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=3))
                   .generate([[unseen, int(VOCAB[1])]]).tokens[0]) == 3
    with pytest.raises(ValueError, match="hasher"):
        Generator(model, None, VOCAB)


TINY = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, seq_len=48, batch_size=4,
            table_size=997, n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,),
            warmup=1, eval_batches=1, log_every=1, eval_every=3, ckpt_every=3)


def test_cli_generates_from_a_trained_run_on_every_tier(tmp_path, capsys):
    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=1, **TINY), progress=False)
    base = [str(run), "--prompt", "In the beginning God created", "--prompt", "And God",
            "--max-new-tokens", "6", "--no-stop"]
    outputs = {}
    # memory: the checkpoint's tables; every other tier from table files, behind cache + prefetch
    for tier in [t for t, tt in REGISTRY.items() if tt.missing() is None]:
        extra = ["--cache-fraction", "0.05", "--prefetch"] if tier != "memory" else []
        js = tmp_path / f"{tier}.json"
        assert main(["generate", *base, "--tier", tier, "--json", str(js), *extra]) == 0
        result = json.loads(js.read_text())
        assert [len(t) for t in result["tokens"]] == [6, 6]
        outputs[tier] = result["tokens"]
        captured = capsys.readouterr()
        assert all(c in captured.out for c in result["continuations"])
        if tier != "memory":  # a tiered run reports its hot cache
            assert result["cache"]["lookups"] > 0 and "cache hit rate" in captured.err
    assert all(o == outputs["memory"] for o in outputs.values()) and len(outputs) >= 6
    assert (run / "tables" / "layer0.table").exists()
    # a cache or prefetch on the memory tier would do nothing: refused, before any work
    assert main(["generate", *base, "--cache-fraction", "0.05"]) == 2
    assert "on the memory tier they would do nothing" in capsys.readouterr().err
    # a request longer than the context: the prompt is cut from the left, the count said; new
    # tokens that cannot fit with any prompt: refused naming max_new_tokens and max_seq_len
    assert main(["generate", str(run), "--prompt", "And God " * 40, "--max-new-tokens", "4"]) == 0
    assert "keeping the last 45 of" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "x", "--max-new-tokens", "100"]) == 2
    assert "max_new_tokens=100 leaves no room for a prompt" in capsys.readouterr().err
    # the deprecated --run spelling still works, with a warning; a missing run is one line, exit 2
    assert main(["generate", "--prompt", "x", "--run", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--run is deprecated" in err and "engram generate: error: RUN_DIR " in err
    assert "nope: no such file or folder" in err


def test_nine_model_decodes_like_a_full_recompute():
    """Engram-Nine: the hot slots of each decode step come from the stream's n-gram history."""
    from engram.models.nine_model import build_nine_lm
    from engram.retrieval.hot import NineHasher, build_hot_index

    cfg = PROFILES["demo-v1"]
    mc = ModelConfig(vocab_size=len(VOCAB), n_layer=3, d_model=32, n_head=2, engram=cfg,
                     max_seq_len=40)
    torch.manual_seed(0)
    model = build_nine_lm(mc, hot_slots=2 * 30, shared=True).eval()
    for e in model.engrams().values():
        torch.nn.init.normal_(e.short_conv.conv.weight, std=0.3)
    plain = NgramHasher(cfg, LOOKUP)
    stream = np.random.default_rng(5).choice(VOCAB[:12], 3000)  # few ids: many repeated n-grams
    hasher = NineHasher(plain, build_hot_index(plain, stream, 30), shared=True)
    x, mask = _left_padded([5, 8, 3], seed=4)
    x = torch.where(mask.bool(), torch.from_numpy(np.asarray(VOCAB[:12]))[x % 12], x)
    out = Generator(model, hasher, VOCAB, GenerationConfig(max_new_tokens=6)).generate(x, mask)
    for row, m, got in zip(x, mask, out.tokens):
        assert got == _recompute(model, hasher, row[m.bool()].tolist(), 6)
    ids = hasher.hash(x, attention_mask=mask)[0]
    assert (ids[..., -2:] >= 0).any()  # the prompts do read hot rows


def test_precision_and_device_belong_to_the_runtime(tmp_path):
    """Issue 48's two owners: engram.open(path, precision="bf16") then a Generator with a default
    GenerationConfig decodes in bf16 (it used to reset the runtime to fp32); a config that says
    otherwise is refused in one line, not obeyed behind the runtime's back."""
    import engram
    from engram.errors import UserError
    from engram.serving.generate import GenerationConfig, Generator
    run = tmp_path / "run"
    train(TrainConfig(out_dir=str(run), steps=1, **TINY), progress=False)
    rt = engram.open(run, precision="bf16")
    gen = Generator(rt, config=GenerationConfig(max_new_tokens=2))
    assert rt.precision == "bf16" and gen.runtime is rt
    assert len(gen.generate([rt.encode("In the beginning")]).tokens[0]) == 2
    with pytest.raises(UserError, match="precision belongs to the runtime"):
        Generator(rt, config=GenerationConfig(precision="fp32"))
    elsewhere = engram.open(run)
    elsewhere.model.to("meta")  # a model on another device than the config names
    with pytest.raises(UserError, match="device belongs to the runtime"):
        Generator(elsewhere, config=GenerationConfig(device="cpu"))
    Generator(rt, config=GenerationConfig(precision="bf16", device="cpu"))  # agreeing: fine
