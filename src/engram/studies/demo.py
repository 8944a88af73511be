"""`engram demo`: the whole retrieval and fusion path on one real sentence, printed step by step."""

from __future__ import annotations

import time

import torch

from ..module import build_engram
from ..retrieval.compress import build_compression, default_tokenizer
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from ..retrieval.primes import rows_per_layer

DEFAULT_TEXT = "Only Alexander the Great could tame the horse Bucephalus. ONLY alexander THE great!"


def run_demo(text: str = DEFAULT_TEXT, table_size: int = 50_000, hidden_size: int = 256,
             heads_shown: int = 4, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    tok = default_tokenizer()
    comp = build_compression(tok)
    print(f"tokenizer: DeepSeek, V = {comp.raw_vocab_size:,}; compressed V' = {len(comp):,} "
          f"({1 - len(comp) / comp.raw_vocab_size:.2%} fewer ids) in {time.perf_counter() - t0:.2f}s")

    official = EngramConfig.demo_v1()
    print("official demo tables (rows per layer, nothing allocated): "
          + ", ".join(f"layer {k}: {v:,}" for k, v in rows_per_layer(official).items()))
    cfg = official.replace(engram_vocab_size=[table_size] * (official.max_ngram_size - 1),
                           compressed_vocab_size=len(comp))
    hasher = NgramHasher(cfg, comp)
    enc = tok.encode(text)
    ids = torch.tensor([enc.ids])  # [1, t]
    hashes = hasher.hash(ids)  # {layer: [1, t, H]}
    lid = cfg.layer_ids[0]

    torch.manual_seed(seed)
    module = build_engram(cfg, lid, hidden_size).eval()
    # One sentence: torch's gate and conv take ~1 ms; the compiled kernels (module/fused.py) would
    # first import numba and load or compile them, seconds on a fresh clone.
    module.kernels = False
    hidden = torch.randn(1, ids.shape[1], hidden_size)  # stands in for the backbone's state
    with torch.no_grad():
        y, alpha = module(hidden, hashes[lid], return_gate=True)

    print(f"\nsentence: {text!r}\nlayer {lid}: {cfg.num_heads} heads "
          f"(orders 2..{cfg.max_ngram_size} x {cfg.n_head_per_ngram}), table sizes "
          f"{hasher.table_sizes(lid)[:3]}..., {hasher.num_rows(lid):,} rows")
    print(f"{'pos':>3} {'token':<14} {'raw id':>7} {'V id':>6}  {'first head ids':<30} gate")
    compressed = comp(ids)[0]
    for t, (piece, raw) in enumerate(zip(enc.tokens, enc.ids)):
        heads = " ".join(f"{int(v):>6}" for v in hashes[lid][0, t, :heads_shown])
        print(f"{t:>3} {piece[:14]:<14} {raw:>7} {int(compressed[t]):>6}  {heads:<30} "
              f"{float(alpha[0, t, 0]):.3f}")
    print(f"\nmodule output Y: {tuple(y.shape)}, |Y| mean {y.abs().mean():.4f} "
          f"(untrained: random table, zero-initialised conv); {time.perf_counter() - t0:.2f}s total")
    return {"V": comp.raw_vocab_size, "V_compressed": len(comp), "ids": enc.ids,
            "hash": {k: v.tolist() for k, v in hashes.items()}, "gate": alpha[0, :, 0].tolist()}
