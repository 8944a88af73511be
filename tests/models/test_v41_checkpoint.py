"""DeepSeek-V4.1 checkpoints: a random tiny V4.1-layout checkpoint round-trips through
`engram import-v41` and `engram export-v41` byte for byte (bf16 and FP8 wkv); the imported module
computes the engine's gate on the checkpoint's own tensors; bad checkpoints are refused naming the
tensor, and nothing is left at OUT."""

import json

import pytest
import torch
from v41_ckpt import TINY, engram_tensors, make_checkpoint, same_tensor, v41_config

from engram import EngramLM, ModelConfig, build_engram
from engram.cli import main
from engram.models.v41_checkpoint import V41CheckpointError, read_config
from engram.artifacts.layer_set import (
    check_fits,
    export_v41,
    import_v41,
    load_layer_set,
    read_layer_set,
    write_layer_set,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41")
    written = make_checkpoint(root / "ckpt")
    import_v41(root / "ckpt", root / "layers")
    return root, written


@pytest.mark.parametrize("wkv", ["bf16", "fp8-e8m0", "fp8-f32"])
def test_checkpoint_round_trips_byte_for_byte(tmp_path, wkv):
    written = make_checkpoint(tmp_path / "ckpt", wkv=wkv)
    assert main(["import-v41", str(tmp_path / "ckpt"), str(tmp_path / "layers")]) == 0
    assert main(["export-v41", str(tmp_path / "layers"), str(tmp_path / "back")]) == 0
    back = engram_tensors(tmp_path / "back")
    want = {k: v for k, v in written.items() if ".engram." in k}
    assert sorted(back) == sorted(want)
    assert all(same_tensor(back[k], want[k]) for k in want), [
        k for k in want if not same_tensor(back[k], want[k])]
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    assert read_config(tmp_path / "back") == read_config(tmp_path / "ckpt")


def test_imported_module_is_the_engines_gate_on_the_checkpoints_tensors(imported):
    """Y + H, written out from the engine's kernel: per branch i, dot = sum(h q_i k_i key_i) *
    rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(d); gate = sigmoid(sign(dot)
    sqrt(max(|dot|, 1e-6))), zero where masked; out = h + gate * value. Keys are the first m d
    rows of wkv, the value the last d; rows dequantise as fp8 * 2^(code - 127)."""
    root, w = imported
    ls = read_layer_set(root / "layers")
    lid, m, d, eps = 2, TINY["hc_mult"], TINY["hidden_size"], TINY["rms_norm_eps"]
    p = f"layers.{lid}.engram."
    module = build_engram(ls.config, lid, d, m, table=None)
    module.load_state_dict(ls.module_state(lid))
    rows = torch.randint(0, w[p + "embed.weight"].shape[0], (7, ls.config.num_heads))  # [T, H]
    codes = w[p + "embed.scale"].view(torch.uint8).long()
    scale = torch.pow(2.0, (codes - 127).double()).repeat_interleave(32, 1)
    emb = (w[p + "embed.weight"].double() * scale)[rows].flatten(1)  # [T, c]
    kv = emb @ w[p + "wkv.weight"].double().T  # [T, (m+1) d]
    h = torch.randn(7, m, d, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, False, True])
    key, value = kv[:, :m * d].view(7, m, d), kv[:, m * d:]
    q, k = w[p + "q_weight"].double(), w[p + "k_weight"].double()
    dot = (h * q * k * key).sum(-1) * torch.rsqrt(h.square().mean(-1) + eps) \
        * torch.rsqrt(key.square().mean(-1) + eps) / d ** 0.5
    gate = torch.where(mask[:, None], torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt()),
                       0.0)
    want = h + gate[..., None] * value[:, None]
    for kernels in (True, False):
        module.kernels = kernels
        with torch.no_grad():
            y = module(h[None].float(), memory=emb[None].float(), alive=mask[None])[0]
        torch.testing.assert_close((h.float() + y).double(), want, rtol=2e-5, atol=2e-5)
        assert torch.equal(y[~mask], torch.zeros_like(y[~mask]))  # masked: passes untouched


def test_layer_set_loads_into_a_v41_model_and_writes_back(imported, tmp_path, deepseek):
    root, written = imported
    ecfg = v41_config()
    mc = ModelConfig(vocab_size=50, n_layer=3, d_model=64, n_head=2, hc_mult=2, engram=ecfg,
                     max_seq_len=16)
    model = EngramLM(mc)
    from engram import NgramHasher
    hasher = NgramHasher(ecfg, deepseek)
    load_layer_set(model, root / "layers", hasher)
    table = model.engrams()[1].table.weight
    p = "layers.1.engram."
    codes = written[p + "embed.scale"].view(torch.uint8).long()
    want = written[p + "embed.weight"].float() * torch.pow(2.0, (codes - 127).float()) \
        .repeat_interleave(32, 1)
    assert torch.equal(table, want)  # the memory tier holds the checkpoint's rows exactly
    # the model's layers written out again: the same weights byte for byte, the same row values
    # (re-quantised with the smallest power-of-two scales, which is lossless)
    write_layer_set(model, hasher, tmp_path / "again")
    export_v41(tmp_path / "again", tmp_path / "back")
    back = engram_tensors(tmp_path / "back")
    for k, v in written.items():
        if ".engram.embed." not in k and ".engram." in k:
            assert same_tensor(back[k], v), k
    got = back[p + "embed.weight"].float() * torch.pow(
        2.0, back[p + "embed.scale"].view(torch.uint8).float() - 127).repeat_interleave(32, 1)
    assert torch.equal(got, want)
    # a model of another shape is refused before anything changes
    other = EngramLM(ModelConfig(vocab_size=50, n_layer=3, d_model=32, n_head=2, hc_mult=2,
                                 engram=ecfg, max_seq_len=16))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="hidden size: layer set 64 vs model 32"):
        load_layer_set(other, root / "layers", hasher)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())
    # a run whose hasher reads two parts per table set (Engram-Nine's hot + cold) is refused too
    with pytest.raises(ValueError, match=r"table parts: layer set \('cold',\) vs model "
                       r"\('cold', 'hot'\)"):
        check_fits(model.config, read_layer_set(root / "layers"), ("cold", "hot"))


def _assert_refused(tmp_path, match, **edit):
    """Write a checkpoint, break it with ``edit``, import: an error naming the tensor, no OUT."""
    from safetensors.torch import save_file

    written = make_checkpoint(tmp_path / "ckpt")
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()
    for k, fn in edit.items():
        written = fn(written) if k == "tensors" else written
    save_file({k: v.contiguous() for k, v in written.items()},
              str(tmp_path / "ckpt" / "model.safetensors"))
    if "config" in edit:
        path = tmp_path / "ckpt" / "config.json"
        path.write_text(json.dumps(edit["config"](json.loads(path.read_text()))))
    with pytest.raises((V41CheckpointError, ValueError), match=match):
        import_v41(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no half-written folder beside it


def _drop(name):
    return lambda w: {k: v for k, v in w.items() if k != name}


def _set(name, value):
    return lambda w: {**w, name: value(w[name])}


@pytest.mark.parametrize("edit,match", [
    (dict(tensors=_drop("layers.2.engram.k_weight")), r"layers\.2\.engram\.k_weight is missing"),
    (dict(tensors=_set("layers.1.engram.wkv.weight", lambda t: t[:, :-1])),
     r"layers\.1\.engram\.wkv\.weight has shape \[192, 127\], expected \[192, 128\]"),
    (dict(tensors=_set("layers.1.engram.embed.weight", lambda t: t.float())),
     r"layers\.1\.engram\.embed\.weight is F32, vLLM's V4.1 Engram loads F8_E4M3"),
    (dict(tensors=_set("layers.2.engram.embed.scale", lambda t: t.float() * 0.75)),
     r"layers\.2\.engram\.embed\.scale rows 0:\d+: value 0\.\d+ at flat index 0 is not a "
     "positive normal power of two"),
    (dict(tensors=_set("layers.1.engram.embed.scale",
                       lambda t: torch.where(torch.arange(t.numel()).view(t.shape) == 5,
                                             255, t.view(torch.uint8)).to(torch.uint8))),
     r"layers\.1\.engram\.embed\.scale rows 0:\d+: E8M0 code 255 \(NaN\) at flat index 5"),
    (dict(config=lambda c: {**c, "text_config": {**c["text_config"],
                                                 "engram_layer_ids": [1, 3]}}),
     r"layers\.3\.engram\.embed\.weight is missing: config.json puts Engram at layers \[1, 3\], "
     r"the checkpoint has Engram tensors for layers \[1, 2\]"),
    (dict(config=lambda c: {**c, "text_config": {**c["text_config"],
                                                 "engram_compressed_vocab_size": 1234}})
     , r"V'=99092 ids, config.json's engram_compressed_vocab_size is 1234"),
    (dict(config=lambda c: {**c, "text_config": {
        **c["text_config"], "engram_num_embeddings": [5, 7]}}),
     r"engram_num_embeddings says 5 rows for layer 1, its heads' primes sum to"),
], ids=["missing", "shape", "dtype", "scale-not-pow2", "scale-nan", "layer-ids", "vocab",
        "rows"])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, edit, match):
    _assert_refused(tmp_path, match, **edit)


def test_out_is_never_overwritten_or_half_written(imported, tmp_path, capsys):
    root, _ = imported
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["import-v41", str(root / "ckpt"), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["import-v41", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert "nope: no such file or folder" in capsys.readouterr().err  # checked before any work
    assert not (tmp_path / "o2").exists()
