"""A V4.1 layer set, the folder of DeepSeek-V4.1 Engram layers on our side: read from a V4.1 checkpoint
(``engram import-v41``), written back as one (``engram export-v41``), made from one of our v4.1
models, and loaded into an EngramLM.

    OUT/engram_layers.json         format, the v4.1 EngramConfig, the V4.1 config fields, per layer
                                   the checkpoint's dtypes (restored on export)
    OUT/engram_layers.safetensors  per layer L, fp32: L.kv_proj.weight [(m+1) d, H e] (our layout:
                                   the value first, then each branch's key), L.norm1.i.weight (key
                                   norm: the engine's k_weight[i]), L.norm2.i.weight (hidden norm:
                                   q_weight[i]); L.wkv_scale when the checkpoint's wkv was FP8
    OUT/tables/layer{L}.table      the checkpoint's FP8 rows and E8M0 scales byte for byte, a table
                                   file every tier serves (stamped with the hash profile)

The engine's wkv puts the branch keys first and the value last; ours keeps the value first (the
fused gate kernels read it so), so the rows are reordered here and only here. bf16 weights widen
to fp32 exactly and narrow back unchanged; an FP8 wkv is dequantised with its block scales and
re-quantised with the same scales on export (exact while the weights are unchanged).

Shape legend: R rows, e head dim, m branches, d hidden size, H hash heads, c = H e.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputNotFound, UserError, one_line
from ..files import publish, read_json_object, sha256_file
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from ..tables.fp8 import FP8_MAX, e8m0_to_float, quantize_fp8_e8m0
from ..tables.tablefile import read_header, table_path, verify, write_table
from ..models.v41_checkpoint import (
    EMBED,
    EMBED_SCALE,
    INDEX,
    K_WEIGHT,
    Q_WEIGHT,
    QUANT_BLOCK,
    ST_DTYPES,
    WKV,
    WKV_SCALE,
    V41CheckpointError,
    V41Config,
    check_layers,
    e8m0_codes,
    open_shards,
    read_config,
    staged_dir,
    tensor_index,
    tensor_name,
    write_safetensors,
)

FORMAT = "engram-v41-layers-1"
META, WEIGHTS, TABLES = "engram_layers.json", "engram_layers.safetensors", "tables"
DIGEST = "weights_sha256"  # in META: what WEIGHTS hashes to (a flipped byte opened silently)


@dataclass
class LayerSet:
    path: Path
    config: EngramConfig  # the v4.1 profile with the checkpoint's sizes
    v41: V41Config  # the checkpoint's config fields
    meta: dict[str, Any]  # engram_layers.json
    weights: dict[str, torch.Tensor]  # engram_layers.safetensors

    @property
    def table_dir(self) -> Path:
        return self.path / TABLES

    def module_state(self, layer_id: int) -> dict[str, torch.Tensor]:
        """One layer's Engram state dict (no table), our layout."""
        pre = f"{layer_id}."
        return {k[len(pre):]: v for k, v in self.weights.items()
                if k.startswith(pre) and not k.endswith("wkv_scale")}


def detect(path: str | Path) -> bool:
    """Whether ``path`` is a layer set (``engram import-v41``'s folder): it holds its META."""
    return (Path(path) / META).is_file()


def read_layer_set(path: str | Path) -> LayerSet:
    """The layer set at ``path``; a missing or unreadable part is one line naming it (its table
    files are checked where a tier opens them)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / META).exists():
        raise InputNotFound(f"no {META} in {path}: write a layer set with `engram import-v41`")
    again = "write it again with `engram import-v41` (or copy it back)"
    try:
        meta = read_json_object((path / META))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: {META} cannot be read ({type(e).__name__}: {one_line(e)}): "
                        f"{again}") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path / META} is format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        if "gate" not in meta:
            raise KeyError("gate")
        configs = EngramConfig.from_dict(meta["engram_config"]), V41Config(**meta["v41_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: {META} is not a layer set's ({type(e).__name__}: "
                        f"{one_line(e)}): {again}") from None
    for part in [WEIGHTS] + [table_path(TABLES, lid).as_posix() for lid in configs[1].layer_ids]:
        if not (path / part).is_file():
            raise UserError(f"{path}: {part} is missing: {again}")
    digest = meta.get(DIGEST)  # layer sets written before it carry none, and open unchecked
    if digest is not None and sha256_file(path / WEIGHTS) != digest:
        raise UserError(f"{path}: {WEIGHTS} is not the file {META} records (its sha256 "
                        f"differs: damaged or replaced): {again}")
    try:
        weights = load_file(str(path / WEIGHTS))
    except Exception as e:  # safetensors raises several types for a torn file
        raise UserError(f"{path}: {WEIGHTS} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): {again}") from None
    return LayerSet(path, *configs, meta, weights)


read = read_layer_set  # the artifacts kinds' name


def _hasher(cfg: V41Config, ecfg: EngramConfig, tokenizer: Any) -> NgramHasher:
    from ..retrieval.compress import build_compression

    comp = build_compression(tokenizer)
    if len(comp) != cfg.compressed_vocab_size:
        raise V41CheckpointError(
            f"the tokenizer compresses to V'={len(comp)} ids, config.json's "
            f"engram_compressed_vocab_size is {cfg.compressed_vocab_size}: every hash multiplier "
            "derives from it (another tokenizer?)")
    return NgramHasher(ecfg, comp)


# -- checkpoint -> layer set -----------------------------------------------------------------------

def import_v41(ckpt_dir: str | Path, out_dir: str | Path, *, tokenizer: Any = None,
               progress: bool = False) -> Path:
    """Read the Engram layers of a DeepSeek-V4.1 checkpoint into a layer set at ``out_dir``.

    Everything is checked (names, dtypes, shapes, row counts) before a row is copied; the tables
    stream shard by shard into table files without re-quantising. ``tokenizer``: the one the
    hashes use (default: ``ckpt_dir/tokenizer.json``, else DeepSeek's). ``out_dir`` appears whole
    or not at all.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    ckpt = Path(ckpt_dir)
    cfg = read_config(ckpt)
    ecfg = cfg.engram_config()
    layers = check_layers(cfg, tensor_index(ckpt))
    if tokenizer is None and (ckpt / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    hasher = _hasher(cfg, ecfg, tokenizer)
    m, d = cfg.hc_mult, cfg.hidden_size
    weights, dtypes = {}, {}
    with staged_dir(out_dir) as tmp:
        for lid, infos in layers.items():
            with open_shards(infos) as read:
                wkv = _dequantized_wkv(read, infos, cfg)  # [(m+1) d, c]: keys, then the value
                weights[f"{lid}.kv_proj.weight"] = torch.cat([wkv[m * d:], wkv[:m * d]])
                for i in range(m):
                    weights[f"{lid}.norm1.{i}.weight"] = read(K_WEIGHT, i, i + 1)[0].float()
                    weights[f"{lid}.norm2.{i}.weight"] = read(Q_WEIGHT, i, i + 1)[0].float()
                if WKV_SCALE in infos:
                    weights[f"{lid}.wkv_scale"] = read(WKV_SCALE, 0, infos[WKV_SCALE].shape[0])
                dtypes[str(lid)] = {k: infos[k].dtype for k in (WKV, WKV_SCALE, Q_WEIGHT)
                                    if k in infos}
                scale_name = tensor_name(lid, EMBED_SCALE)

                def rows(a: int, b: int, read=read, name=scale_name):
                    return read(EMBED, a, b), e8m0_codes(read(EMBED_SCALE, a, b),
                                                         f"{name} rows {a}:{b}")
                write_table(table_path(tmp / TABLES, lid), rows, num_rows=infos[EMBED].shape[0],
                            dim=cfg.head_dim, layer_id=lid, config=ecfg,
                            profile=hasher.profile(lid), dtype="fp8",
                            scale_block=QUANT_BLOCK, scale_format="e8m0", tag=ckpt.name,
                            progress=progress)
        state = {k: v.contiguous() for k, v in weights.items()}
        publish(tmp / WEIGHTS, lambda p: save_file(state, p))
        _write_meta(tmp, ecfg, cfg, dtypes, source=str(ckpt))
    return Path(out_dir)


def _write_meta(path: Path, ecfg: EngramConfig, cfg: V41Config, dtypes: dict, source: str) -> None:
    """META, written last: after WEIGHTS, whose digest it records."""
    (path / META).write_text(json.dumps({
        "format": FORMAT, "engram_config": ecfg.to_dict(), "v41_config": cfg.to_dict(),
        "gate": "demo", "norm_eps": cfg.rms_norm_eps, "dtypes": dtypes, "source": source,
        DIGEST: sha256_file(path / WEIGHTS)}, indent=1))


def _block_scales(scale: torch.Tensor, shape: tuple[int, int], block: list[int]) -> torch.Tensor:
    """Per-block scales [ceil(r/b0), ceil(c/b1)] (fp32, or E8M0 decoded as the engine does)
    -> [r, c]."""
    s = e8m0_to_float(scale.view(torch.uint8)) if scale.dtype == torch.float8_e8m0fnu else scale
    return s.float().repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(
        block[1], 1)[:, :shape[1]]


def _dequantized_wkv(read, infos: dict, cfg: V41Config) -> torch.Tensor:
    n = infos[WKV].shape[0]
    w = read(WKV, 0, n)
    if WKV_SCALE not in infos:
        return w.float()
    s = read(WKV_SCALE, 0, infos[WKV_SCALE].shape[0])
    return w.float() * _block_scales(s, tuple(w.shape), cfg.weight_block_size or [128, 128])


# -- layer set -> checkpoint -----------------------------------------------------------------------

def export_v41(layer_dir: str | Path, out_dir: str | Path, *, progress: bool = False) -> Path:
    """Write a layer set as a DeepSeek-V4.1-layout checkpoint (config.json, one shard per Engram
    layer and model.safetensors.index.json): the engine's names, dtypes and layout. Tables with
    E8M0 scales are copied byte for byte; others are quantised to FP8 with E8M0 scales."""
    ls = read_layer_set(layer_dir)
    cfg, m, d = ls.v41, ls.v41.hc_mult, ls.v41.hidden_size
    n, weight_map, total = len(cfg.layer_ids), {}, 0
    with staged_dir(out_dir) as tmp:
        for i, lid in enumerate(cfg.layer_ids):
            state = ls.module_state(lid)
            dt = ls.meta.get("dtypes", {}).get(str(lid), {})
            kv = state["kv_proj.weight"]
            wkv = torch.cat([kv[d:], kv[:d]])  # the engine's layout: branch keys, then the value
            tensors: dict[str, Any] = dict(_table_sources(ls, lid, cfg))
            if dt.get(WKV) == "F8_E4M3":
                q, s = _requantized_wkv(wkv, ls.weights[f"{lid}.wkv_scale"],
                                        cfg.weight_block_size or [128, 128])
                tensors[tensor_name(lid, WKV)], tensors[tensor_name(lid, WKV_SCALE)] = q, s
            else:
                tensors[tensor_name(lid, WKV)] = wkv.to(ST_DTYPES[dt.get(WKV, "BF16")])
            norm = ST_DTYPES[dt.get(Q_WEIGHT, "BF16")]
            tensors[tensor_name(lid, Q_WEIGHT)] = torch.stack(
                [state[f"norm2.{j}.weight"] for j in range(m)]).to(norm)
            tensors[tensor_name(lid, K_WEIGHT)] = torch.stack(
                [state[f"norm1.{j}.weight"] for j in range(m)]).to(norm)
            shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            write_safetensors(tmp / shard, tensors)
            weight_map.update({k: shard for k in tensors})
            total += (tmp / shard).stat().st_size
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))
    return Path(out_dir)


def _table_sources(ls: LayerSet, lid: int, cfg: V41Config):
    """(name, (dtype, shape, read)) of embed.weight and embed.scale, streamed from the table
    file."""
    import numpy as np

    path = table_path(ls.table_dir, lid)
    h = read_header(path)
    verify(path, h)
    rows, e = h.num_rows, h.dim
    if (rows, e) != (cfg.num_embeddings[cfg.layer_ids.index(lid)], cfg.head_dim):
        raise V41CheckpointError(f"{path} is {rows} x {e}, layer {lid} needs "
                                 f"{cfg.num_embeddings[cfg.layer_ids.index(lid)]} x {cfg.head_dim}")
    shape_q, shape_s = (rows, e), (rows, e // QUANT_BLOCK)
    if h.dtype == "fp8" and h.scale_format == "e8m0" and h.scale_block == QUANT_BLOCK:
        mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: nothing writes to it
        q = torch.from_numpy(mm[h.data_offset:h.data_offset + rows * e]).view(*shape_q)
        s = torch.from_numpy(mm[h.scale_offset:h.scale_offset + rows * shape_s[1]]).view(*shape_s)
        yield tensor_name(lid, EMBED), ("F8_E4M3", shape_q,
                                        lambda a, b: q[a:b].view(torch.float8_e4m3fn))
        yield tensor_name(lid, EMBED_SCALE), ("F8_E8M0", shape_s,
                                              lambda a, b: s[a:b].view(torch.float8_e8m0fnu))
        return
    from ..tables.tiers import FileTable  # rows of another dtype: FP8 + E8M0 made here

    table = FileTable(path, verify=False)

    def quant(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_e8m0(table.lookup(torch.arange(a, b)), QUANT_BLOCK)
    yield tensor_name(lid, EMBED), ("F8_E4M3", shape_q, lambda a, b: quant(a, b)[0])
    yield tensor_name(lid, EMBED_SCALE), ("F8_E8M0", shape_s,
                                          lambda a, b: quant(a, b)[1].view(torch.float8_e8m0fnu))


def _requantized_wkv(w: torch.Tensor, scale: torch.Tensor, block: list[int]):
    """FP8 wkv again with the checkpoint's own block scales (exact while the weights are the
    imported ones); blocks whose values no longer fit get fresh scales of the same kind."""
    full = _block_scales(scale, tuple(w.shape), block)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if torch.equal(q.float() * full, w):
        return q, scale
    rb, cb = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    pad = torch.zeros(rb * block[0], cb * block[1])
    pad[:w.shape[0], :w.shape[1]] = w
    amax = pad.view(rb, block[0], cb, block[1]).abs().amax((1, 3))  # [rb, cb]
    if scale.dtype == torch.float8_e8m0fnu:  # smallest power of two that fits each block
        _, codes = quantize_fp8_e8m0(amax.reshape(-1, 1), 1)
        scale = codes.view(rb, cb).view(torch.float8_e8m0fnu)
    else:
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = _block_scales(scale, tuple(w.shape), block)
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# -- our models <-> layer sets ---------------------------------------------------------------------

def check_fits(mc: Any, ls: LayerSet, parts: tuple[str, ...] = ("cold",)) -> None:
    """Refuse a model config (ModelConfig) the layer set does not fit, naming what differs;
    ``parts``: the table parts the model's hasher reads (``Hasher.parts``; a layer set has one)."""
    v, ec = ls.v41, mc.engram
    if ec is None or ec.profile != "v4.1":
        raise UserError(f"a V4.1 layer set loads into a model with the v4.1 Engram profile, this "
                        f"one has {'no Engram' if ec is None else ec.profile}")
    want = {"table parts": (("cold",), tuple(parts)),
            "Engram layer ids": (v.layer_ids, list(ec.layer_ids)),
            "hidden size": (v.hidden_size, mc.d_model), "hc_mult": (v.hc_mult, mc.hc_mult),
            "head dim": (v.head_dim, ec.head_dim), "memory width": (ls.config.d_mem, ec.d_mem),
            "gate": (ls.meta["gate"], mc.engram_gate),
            "gate norm eps": (v.rms_norm_eps, mc.engram_norm_eps),
            "short conv": (False, mc.engram_conv is True)}
    bad = [f"{k}: layer set {a} vs model {b}" for k, (a, b) in want.items() if a != b]
    if bad:
        raise UserError(f"the layer set at {ls.path} does not fit this model ({'; '.join(bad)})")


def load_layer_set(model: Any, layers: LayerSet | str | Path, hasher: NgramHasher | None = None,
                   *, memory_tables: bool = True, verify: bool = True) -> LayerSet:
    """Put a layer set's Engram weights into ``model`` (an EngramLM with the v4.1 profile at the
    same layers, width, branches, gate and eps), and with ``memory_tables`` its rows into the
    model's in-memory tables (files checked against ``hasher``'s hash profile). Other tiers serve
    ``layers.table_dir`` (engram.serving.loader.open_tier with ``layers.config``)."""
    from ..tables.tiers import FileTable

    ls = layers if isinstance(layers, LayerSet) else read_layer_set(layers)
    check_fits(model.config, ls)
    engrams = model.engrams()
    files = {lid: FileTable(table_path(ls.table_dir, lid), expect=(ls.config, lid, hasher),
                            verify=verify) for lid in engrams} if memory_tables else {}
    for lid, eng in engrams.items():  # every check before the model changes
        own = {k for k in eng.state_dict() if not k.startswith("table.")}
        given = set(ls.module_state(lid))
        if own != given:
            raise UserError(f"layer {lid}: the layer set lacks {sorted(own - given)}, has extra "
                             f"{sorted(given - own)}")
    for lid, eng in engrams.items():
        eng.load_state_dict(ls.module_state(lid), strict=False)
        if lid in files:
            w = eng.table.weight
            with torch.no_grad():
                for a in range(0, w.shape[0], 1 << 16):
                    b = min(w.shape[0], a + (1 << 16))
                    w[a:b] = files[lid].lookup(torch.arange(a, b)).to(w.dtype)
            files[lid].close()
    return ls


def write_layer_set(model: Any, hasher: NgramHasher, out_dir: str | Path, *, tag: str = "",
                    progress: bool = False) -> Path:
    """One of our v4.1 models' Engram layers as a layer set (tables quantised to FP8 with E8M0
    scales; weights exported as bf16, the engine's dtype), ready for ``export_v41``."""
    from safetensors.torch import save_file

    mc = model.config
    ec = mc.engram
    if ec is None or ec.profile != "v4.1" or mc.engram_gate != "demo":
        raise ValueError("only a model with the v4.1 profile and its signed-sqrt gate has the "
                         "DeepSeek-V4.1 layout")
    eps = mc.engram_norm_eps or float(torch.finfo(torch.float32).eps)
    cfg = V41Config.of(ec, mc.d_model, mc.hc_mult, eps, len(hasher.compression))
    weights, dtypes = {}, {}
    with staged_dir(out_dir) as tmp:
        for lid, eng in model.engrams().items():
            if eng.short_conv is not None or not eng.fused:
                raise ValueError(f"layer {lid} has a short conv or separate projections, which "
                                 "DeepSeek-V4.1's Engram does not")
            for k, w in eng.state_dict().items():
                if not k.startswith("table."):
                    weights[f"{lid}.{k}"] = w.detach().float().cpu().contiguous()
            dtypes[str(lid)] = {WKV: "BF16", Q_WEIGHT: "BF16"}
            store = eng.table
            rows = (store.weight.detach() if hasattr(store, "weight")
                    else lambda a, b, s=store: s.lookup(torch.arange(a, b)).float())
            write_table(table_path(tmp / TABLES, lid), rows, num_rows=store.num_rows,
                        dim=store.dim, layer_id=lid, config=ec, profile=hasher.profile(lid),
                        dtype="fp8", scale_block=QUANT_BLOCK, scale_format="e8m0", tag=tag,
                        progress=progress)
        publish(tmp / WEIGHTS, lambda p: save_file(weights, p))
        _write_meta(tmp, ec, cfg, dtypes, source=tag or "engram model")
    return Path(out_dir)
