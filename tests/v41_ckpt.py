"""A random tiny DeepSeek-V4.1-layout checkpoint, written with plain safetensors from the names,
dtypes and shapes vLLM 0.32.0's V4.1 Engram loads (not with the code under test). Layer sizes come
from the spec's prime rule; V' = 99,092 is DeepSeek's tokenizer compressed (the engine checks
it)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engram import EngramConfig
from engram.retrieval.primes import rows_per_layer

TINY = dict(layer_ids=(1, 2), hc_mult=2, hidden_size=64, head_dim=32, n_heads=2, max_ngram=3,
            vocab_size=97, pad_token_id=1, rms_norm_eps=1e-6)
V_PRIME = 99_092


def v41_config(**kw):
    t = {**TINY, **kw}
    return EngramConfig(engram_vocab_size=t["vocab_size"], max_ngram_size=t["max_ngram"],
                        n_embed_per_ngram=t["n_heads"] * t["head_dim"],
                        n_head_per_ngram=t["n_heads"], layer_ids=list(t["layer_ids"]),
                        pad_id=t["pad_token_id"], profile="v4.1")


def make_checkpoint(path, seed=0, wkv="bf16", split=True, **kw):
    """Write config.json and shards (one per Engram layer, plus an unrelated tensor each);
    ``wkv``: "bf16", "fp8-e8m0" or "fp8-f32" (block-quantised with [32, 32] blocks). Returns the
    tensors written, by name."""
    t = {**TINY, **kw}
    g = torch.Generator().manual_seed(seed)
    rows = rows_per_layer(v41_config(**kw))
    m, d, e = t["hc_mult"], t["hidden_size"], t["head_dim"]
    heads = (t["max_ngram"] - 1) * t["n_heads"]
    text = {"engram_layer_ids": list(t["layer_ids"]),
            "engram_num_embeddings": [rows[i] for i in t["layer_ids"]],
            "engram_vocab_size": t["vocab_size"], "engram_max_ngram_size": t["max_ngram"],
            "engram_n_heads": t["n_heads"], "engram_head_dim": e,
            "engram_compressed_vocab_size": V_PRIME, "engram_pad_token_id": t["pad_token_id"],
            "hidden_size": d, "hc_mult": m, "rms_norm_eps": t["rms_norm_eps"]}
    if wkv.startswith("fp8"):
        text["quantization_config"] = {"weight_block_size": [32, 32]}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"],
                                                  "text_config": text}))
    everything = {}
    for i, lid in enumerate(t["layer_ids"]):
        p = f"layers.{lid}.engram."
        n = rows[lid]
        x = {p + "embed.weight": (torch.randn(n, e, generator=g) * 3).to(torch.float8_e4m3fn),
             p + "embed.scale": torch.randint(118, 126, (n, e // 32), generator=g,
                                              dtype=torch.uint8).view(torch.float8_e8m0fnu),
             p + "q_weight": (1 + 0.2 * torch.randn(m, d, generator=g)).to(torch.bfloat16),
             p + "k_weight": (1 + 0.2 * torch.randn(m, d, generator=g)).to(torch.bfloat16),
             f"layers.{lid}.attn.wq.weight": torch.randn(4, 4, generator=g)}
        w = torch.randn((m + 1) * d, heads * e, generator=g) * 0.1
        if wkv == "bf16":
            x[p + "wkv.weight"] = w.to(torch.bfloat16)
        else:  # fp8 with one scale per [32, 32] block
            codes = torch.randint(118, 124, ((m + 1) * d // 32, heads * e // 32), generator=g,
                                  dtype=torch.uint8)
            x[p + "wkv.weight"] = (torch.randn(w.shape, generator=g) * 50).to(torch.float8_e4m3fn)
            x[p + "wkv.scale"] = (codes.view(torch.float8_e8m0fnu) if wkv == "fp8-e8m0"
                                  else torch.rand(codes.shape, generator=g) * 0.01 + 1e-3)
        everything.update(x)
        save_file(x, str(path / f"model-{i}.safetensors"))
    return everything


def engram_tensors(path):
    """Every ``.engram.`` tensor of a checkpoint folder, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(f)).items() if ".engram." in k})
    return out


def same_tensor(a, b):
    """Equal dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
