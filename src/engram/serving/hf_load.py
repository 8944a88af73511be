"""Loading and saving ``EngramLMForCausalLM`` as an export.

transformers' own loader would read model.safetensors into a model it builds itself; an export
keeps its tables apart, as table files read on a tier (artifacts/export.py, serving/hf_export.py),
so both directions go through the export's own functions: ``open_export`` (the one runtime) in,
``export_model`` (artifacts/export.py's ``write``) out. The tables are opened by ONE call into
hf_export/loader (the tier chain lives there), so a new tier needs no change here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..artifacts.export import ARCHITECTURE, CONFIG, FORMAT, MODEL_TYPE, SERVING_DEFAULTS
from .hf_export import open_export

# from_pretrained arguments that concern the hub or transformers' own loader: nothing to do here.
_HUB_ARGS = {"cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
             "trust_remote_code", "code_revision", "use_safetensors", "low_cpu_mem_usage",
             "attn_implementation", "proxies", "resume_download", "key_mapping", "weights_only",
             "offload_folder", "offload_state_dict", "adapter_kwargs", "gguf_file", "use_auth_token"}


def load_export(cls: type, path: str | Path, config: Any, engram_serving: dict[str, Any] | None,
                dtype: Any, kwargs: dict[str, Any]) -> Any:
    """``cls.from_pretrained``: see EngramLMForCausalLM.from_pretrained."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory; an engram model loads from a local "
                                "directory written by `engram export-hf` (nothing is downloaded)")
    if not (path / CONFIG).exists():
        raise FileNotFoundError(f"no {CONFIG} in {path}: write the export with `engram export-hf`")
    raw = json.loads((path / CONFIG).read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path}/{CONFIG} is a {raw.get('model_type')!r} model, not an engram "
                         f"export (model_type {MODEL_TYPE!r}, written by `engram export-hf`)")
    if config is None:
        config = cls.config_class.from_pretrained(path)
    for key, value in kwargs.items():
        if key in _HUB_ARGS or key.startswith("_"):
            continue
        if key == "output_loading_info":
            raise ValueError("output_loading_info: an export loads whole or not at all")
        if not hasattr(config, key):
            raise TypeError(f"from_pretrained got an unexpected argument {key!r}")
        setattr(config, key, value)
    check_config(config)
    serving = engram_serving if engram_serving is not None else getattr(config, "engram_serving",
                                                                        None)
    rt = open_export(path, serving)  # the tier and the other keys, the vocabulary size checked
    export = {"engram_serving": {**SERVING_DEFAULTS, **(getattr(config, "engram_serving", None)
                                                        or {}), **(serving or {})}}
    config.engram_serving = export["engram_serving"]
    config._name_or_path = str(path)
    model = cls(config, runtime=rt)
    if dtype not in (None, "auto"):
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.eval()


def check_config(config: Any) -> None:
    """Refuse a config of another model type, or one export-hf did not write."""
    kind = getattr(config, "model_type", None)
    if kind != MODEL_TYPE:
        raise ValueError(f"a {kind!r} config is not an engram export (model_type {MODEL_TYPE!r}, "
                         f"architecture {ARCHITECTURE}); load it with its own class")
    if getattr(config, "engram_format", None) != FORMAT or not getattr(config, "engram_model",
                                                                           None):
        raise ValueError(f"this {MODEL_TYPE} config lacks engram_format={FORMAT!r} or "
                         "engram_model: write it with `engram export-hf`")


def save_export(model: Any, out_dir: str | Path) -> Path:
    """Write ``model`` as an export; its serving keys, table dtype and row counts (for a hot
    cache) are the ones it was loaded with (its runtime's)."""
    from ..tables.tablefile import read_header, table_path
    from ..artifacts.export import write as export_model

    out, rt = Path(out_dir), model.runtime
    serving = {**SERVING_DEFAULTS, **(getattr(model.config, "engram_serving", None) or {})}
    if rt.source is not None and out.resolve() == rt.source.resolve():
        raise ValueError(f"save_pretrained into {out}, the export the model was loaded from, "
                         "would overwrite the table files it reads; choose another directory")
    first = None if rt.source is None or rt.hasher is None else table_path(
        rt.source / serving["table_dir"], rt.hasher.owners[0])
    dtype = read_header(first).dtype if first is not None and first.exists() else "fp32"
    counts = rt.row_counts
    return export_model(rt.model, rt.hasher, rt.vocab, out, counts=counts, tier=serving["tier"],
                        table_dtype=dtype, prefetch=serving["prefetch"], tag=rt.checkpoint,
                        cache_fraction=serving["cache_fraction"] if counts is not None else 0.0,
                        tokenizer_file=rt.tokenizer_file, eos_id=rt.eos_id)
