"""A DeepSeek-V4.1 checkpoint's Engram tensors: names, dtypes, shapes, read shard by shard, written.

What vLLM 0.32.0's in-tree DeepSeek-V4.1 code loads (``vllm/models/deepseek_v41/common/engram.py``,
its weight mapper in ``nvidia/model.py``), per Engram layer L, from safetensors shards that
``model.safetensors.index.json`` names:

    layers.L.engram.embed.weight  [R, e]            float8_e4m3fn   every head's rows, R = sum p
    layers.L.engram.embed.scale   [R, e / 32]       float8_e8m0fnu  one power-of-two scale per 32
    layers.L.engram.wkv.weight    [(m + 1) d, H e]  bf16 (or fp8 e4m3 + wkv.scale, block-quantised):
                                                    branch 0..m-1's key, then the shared value
    layers.L.engram.q_weight      [m, d]            bf16            the hidden state's norm weights
    layers.L.engram.k_weight      [m, d]            bf16            the key's norm weights

and from config.json (text fields on top or under ``text_config``): engram_layer_ids,
engram_num_embeddings, engram_vocab_size, engram_max_ngram_size, engram_n_heads, engram_head_dim,
engram_compressed_vocab_size, engram_pad_token_id, hidden_size, hc_mult, rms_norm_eps.

Shape legend: R rows of a layer's table, e head dim, m hyper-connection branches, d hidden size,
H hash heads per layer ((N-1) K).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputNotFound, OutputExists, UserError
from ..files import disk_errors
from ..retrieval.config import EngramConfig
from ..retrieval.primes import rows_per_layer

QUANT_BLOCK = 32  # values per E8M0 scale (ParallelEngramEmbedding's block_size)
INDEX = "model.safetensors.index.json"
# Suffixes under "layers.L.engram." (the checkpoint's names, before vLLM's mapper renames them).
EMBED, EMBED_SCALE, WKV, WKV_SCALE = "embed.weight", "embed.scale", "wkv.weight", "wkv.scale"
Q_WEIGHT, K_WEIGHT = "q_weight", "k_weight"
# safetensors dtype names <-> torch dtypes.
ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "BF16": torch.bfloat16,
    "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
FLOATS = ("BF16", "F16", "F32")


class V41CheckpointError(UserError):
    """A checkpoint that does not hold what vLLM's DeepSeek-V4.1 Engram loads; names the tensor."""


def tensor_name(layer: int, suffix: str) -> str:
    return f"layers.{layer}.engram.{suffix}"


@dataclass
class V41Config:
    # Backbone layers with an Engram module (engram_layer_ids).
    layer_ids: list[int]
    # Rows of each layer's table (engram_num_embeddings): the sum of its heads' primes.
    num_embeddings: list[int]
    # Table size every head's prime search starts from (engram_vocab_size).
    vocab_size: int
    # N, the largest n-gram order (engram_max_ngram_size).
    max_ngram_size: int
    # K, hash heads per n-gram order (engram_n_heads).
    n_heads: int
    # e, the width of one head's row (engram_head_dim).
    head_dim: int
    # V' of the tokenizer compression the multipliers derive from (engram_compressed_vocab_size).
    compressed_vocab_size: int
    # Raw token id whose compressed id pads the n-grams (engram_pad_token_id).
    pad_token_id: int
    # d, the backbone width.
    hidden_size: int
    # m, hyper-connection branches; each gets its own key and gate.
    hc_mult: int
    # Eps of the gate's RMSNorms (the model's rms_norm_eps).
    rms_norm_eps: float
    # FP8 linear layers' [rows, cols] scale block (quantization_config.weight_block_size).
    weight_block_size: list[int] | None = None

    KEYS = {"layer_ids": "engram_layer_ids", "num_embeddings": "engram_num_embeddings",
            "vocab_size": "engram_vocab_size", "max_ngram_size": "engram_max_ngram_size",
            "n_heads": "engram_n_heads", "head_dim": "engram_head_dim",
            "compressed_vocab_size": "engram_compressed_vocab_size",
            "pad_token_id": "engram_pad_token_id", "hidden_size": "hidden_size",
            "hc_mult": "hc_mult", "rms_norm_eps": "rms_norm_eps"}

    @classmethod
    def from_json(cls, d: dict[str, Any], name: str = "config.json") -> V41Config:
        """Read the text model's fields, flattening ``text_config`` as vLLM's DeepseekV41Config."""
        flat = {**d, **d.get("text_config", {})}
        missing = [k for k in cls.KEYS.values() if k not in flat]
        if missing:
            raise V41CheckpointError(f"{name} lacks {missing}: not a DeepSeek-V4.1 config with "
                                     "Engram layers")
        quant = flat.get("quantization_config") or {}
        out = cls(**{f: flat[k] for f, k in cls.KEYS.items()},
                  weight_block_size=quant.get("weight_block_size"))
        out.layer_ids, out.num_embeddings = list(out.layer_ids), list(out.num_embeddings)
        if len(out.layer_ids) != len(out.num_embeddings):
            raise V41CheckpointError(f"{name}: {len(out.layer_ids)} engram_layer_ids but "
                                     f"{len(out.num_embeddings)} engram_num_embeddings")
        if out.head_dim % QUANT_BLOCK:
            raise V41CheckpointError(f"{name}: engram_head_dim={out.head_dim} is not a multiple "
                                     f"of the {QUANT_BLOCK}-value scale block")
        return out

    def to_json(self) -> dict[str, Any]:
        """The fields as a V4.1 config.json holds them (under ``text_config``)."""
        text = {k: getattr(self, f) for f, k in self.KEYS.items()}
        if self.weight_block_size is not None:
            text["quantization_config"] = {"weight_block_size": list(self.weight_block_size)}
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                "text_config": text}

    def engram_config(self) -> EngramConfig:
        """The ``v4.1`` profile with this checkpoint's sizes; refuses row counts its primes miss."""
        cfg = EngramConfig(engram_vocab_size=self.vocab_size, max_ngram_size=self.max_ngram_size,
                           n_embed_per_ngram=self.n_heads * self.head_dim,
                           n_head_per_ngram=self.n_heads, layer_ids=list(self.layer_ids),
                           pad_id=self.pad_token_id, profile="v4.1",
                           compressed_vocab_size=self.compressed_vocab_size)
        rows = rows_per_layer(cfg)
        for lid, n in zip(self.layer_ids, self.num_embeddings):
            if n != rows[lid]:
                raise V41CheckpointError(
                    f"engram_num_embeddings says {n} rows for layer {lid}, its heads' primes "
                    f"sum to {rows[lid]} (padded tables are not supported)")
        return cfg

    @classmethod
    def of(cls, config: EngramConfig, hidden_size: int, hc_mult: int, rms_norm_eps: float,
           compressed_vocab_size: int, weight_block_size: list[int] | None = None) -> V41Config:
        """The V4.1 fields of one of our ``v4.1`` configs (the reverse of engram_config)."""
        rows = rows_per_layer(config)
        return cls(layer_ids=list(config.layer_ids), num_embeddings=[rows[i] for i in
                                                                     config.layer_ids],
                   vocab_size=int(config.order_sizes[0]), max_ngram_size=config.max_ngram_size,
                   n_heads=config.n_head_per_ngram, head_dim=config.head_dim,
                   compressed_vocab_size=compressed_vocab_size, pad_token_id=config.pad_id,
                   hidden_size=hidden_size, hc_mult=hc_mult, rms_norm_eps=rms_norm_eps,
                   weight_block_size=weight_block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TensorInfo:
    name: str
    shard: Path
    dtype: str  # a safetensors dtype name
    shape: tuple[int, ...]


# -- reading ---------------------------------------------------------------------------------------

def read_config(ckpt_dir: str | Path) -> V41Config:
    path = Path(ckpt_dir) / "config.json"
    if not path.exists():
        raise InputNotFound(f"no config.json in {ckpt_dir} (a DeepSeek-V4.1 checkpoint folder)")
    return V41Config.from_json(json.loads(path.read_text()), str(path))


def tensor_index(ckpt_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint's shards (by ``model.safetensors.index.json`` when there is
    one) with its shard, dtype and shape; only headers are read."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    if (ckpt / INDEX).exists():
        shards = sorted({ckpt / f for f in json.loads((ckpt / INDEX).read_text())["weight_map"]
                         .values()})
    else:
        shards = sorted(ckpt.glob("*.safetensors"))
    if not shards:
        raise InputNotFound(f"no safetensors shards in {ckpt}")
    out = {}
    for shard in shards:
        if not shard.exists():
            raise InputNotFound(f"{ckpt / INDEX} names {shard.name}, which is missing")
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = TensorInfo(k, shard, sl.get_dtype(), tuple(sl.get_shape()))
    return out


def check_layers(cfg: V41Config, index: dict[str, TensorInfo]) -> dict[int, dict[str, TensorInfo]]:
    """Each Engram layer's tensors, checked for presence, dtype and shape against the config."""
    m, d, e = cfg.hc_mult, cfg.hidden_size, cfg.head_dim
    heads = (cfg.max_ngram_size - 1) * cfg.n_heads
    present = sorted({int(k.split(".")[1]) for k in index
                      if k.startswith("layers.") and ".engram." in k and k.split(".")[1].isdigit()})
    out = {}
    for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
        want = {EMBED: ((rows, e), ("F8_E4M3",)),
                EMBED_SCALE: ((rows, e // QUANT_BLOCK), ("F8_E8M0", "U8", "F32")),
                WKV: (((m + 1) * d, heads * e), FLOATS + ("F8_E4M3",)),
                Q_WEIGHT: ((m, d), FLOATS), K_WEIGHT: ((m, d), FLOATS)}
        layer = {}
        for suffix, (shape, dtypes) in want.items():
            name = tensor_name(lid, suffix)
            info = index.get(name)
            if info is None:
                raise V41CheckpointError(
                    f"{name} is missing: config.json puts Engram at layers {cfg.layer_ids}, the "
                    f"checkpoint has Engram tensors for layers {present}")
            if info.dtype not in dtypes:
                raise V41CheckpointError(f"{name} is {info.dtype}, vLLM's V4.1 Engram loads "
                                         f"{' or '.join(dtypes)}")
            if info.shape != shape:
                raise V41CheckpointError(f"{name} has shape {list(info.shape)}, expected "
                                         f"{list(shape)} from config.json")
            layer[suffix] = info
        wkv_scale = index.get(tensor_name(lid, WKV_SCALE))
        if layer[WKV].dtype == "F8_E4M3":
            if wkv_scale is None:
                raise V41CheckpointError(f"{tensor_name(lid, WKV)} is F8_E4M3 but "
                                         f"{tensor_name(lid, WKV_SCALE)} is missing")
            block = cfg.weight_block_size or [128, 128]
            shape = tuple(-(-n // b) for n, b in zip(layer[WKV].shape, block))
            if wkv_scale.shape != shape or wkv_scale.dtype not in ("F32", "F8_E8M0"):
                raise V41CheckpointError(
                    f"{tensor_name(lid, WKV_SCALE)} is {wkv_scale.dtype} {list(wkv_scale.shape)}, "
                    f"expected F32 or F8_E8M0 {list(shape)} (blocks of {block})")
            layer[WKV_SCALE] = wkv_scale
        out[lid] = layer
    return out


@contextmanager
def open_shards(infos: dict[str, TensorInfo]) -> Iterator[Callable[[str, int, int], torch.Tensor]]:
    """``read(suffix, start, stop)``: rows start:stop of one of a layer's tensors, from its shard
    (memory-mapped by safetensors, so a table larger than memory streams through)."""
    from safetensors import safe_open

    with ExitStack() as stack:
        files = {}
        for info in infos.values():
            if info.shard not in files:
                files[info.shard] = stack.enter_context(safe_open(str(info.shard), "pt"))

        def read(suffix: str, a: int, b: int) -> torch.Tensor:
            info = infos[suffix]
            return files[info.shard].get_slice(info.name)[a:b]
        yield read


def e8m0_codes(scales: torch.Tensor, name: str) -> torch.Tensor:
    """A scale tensor as read (F8_E8M0, U8 codes or F32 powers of two) -> E8M0 bytes (uint8)."""
    from ..tables.fp8 import E8M0_NAN, float_to_e8m0

    if scales.dtype == torch.float32:
        return float_to_e8m0(scales, name)
    codes = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    bad = codes == E8M0_NAN
    if bool(bad.any()):
        raise V41CheckpointError(f"{name}: E8M0 code {E8M0_NAN} (NaN) at flat index "
                                 f"{int(bad.flatten().nonzero()[0])} is not a power of two")
    return codes


# -- writing ---------------------------------------------------------------------------------------

Source = torch.Tensor | tuple[str, tuple[int, ...], Callable[[int, int], torch.Tensor]]


def write_safetensors(path: Path, tensors: dict[str, Source], chunk_rows: int = 1 << 16) -> None:
    """A safetensors file written row chunk by row chunk: a source is a tensor, or (dtype name,
    shape, ``read(start, stop)`` -> rows of that dtype), so a 100 GB table never sits in memory.
    The layout is the format's own: u64 header length, JSON header, then the tensors in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, plan = 0, []
    for name, src in tensors.items():
        if isinstance(src, torch.Tensor):
            dtype, shape = ST_NAMES[src.dtype], tuple(src.shape)
            t = src.contiguous()
            read = lambda a, b, t=t: t[a:b]  # noqa: E731
        else:
            dtype, shape, read = src
        size = ST_DTYPES[dtype].itemsize
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        plan.append((name, dtype, shape, read))
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned
    with disk_errors(path, 8 + len(body) + offset), open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
        for name, dtype, shape, read in plan:
            rows = shape[0] if shape else 1
            for a in range(0, rows, chunk_rows):
                b = min(rows, a + chunk_rows)
                x = read(a, b) if shape else read(0, 1)
                if x.dtype != ST_DTYPES[dtype] or tuple(x.shape[1:]) != tuple(shape[1:]):
                    raise ValueError(f"{name}: rows {a}:{b} came as {x.dtype} "
                                     f"{tuple(x.shape)}, expected {dtype} {shape}")
                f.write(x.contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def staged_dir(out_dir: str | Path) -> Iterator[Path]:
    """A folder that appears at ``out_dir`` whole or not at all: written beside it, renamed into
    place when the block ends, removed on any error. An existing non-empty ``out_dir`` is
    refused."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExists(f"{out} exists and is not empty; refusing to write over it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        with disk_errors(out):  # a full disk: one line naming the file (or OUT), OUT left absent
            yield tmp
            if out.exists():
                out.rmdir()  # empty (checked above); rename cannot replace it on every filesystem
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
