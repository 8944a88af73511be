"""engram: DeepSeek's Engram conditional memory for PyTorch language models.

The folders are layers, lowest first; a module imports its own layer or lower ones, never higher
(tests/test_layers.py checks it): the foundation (this folder's modules: errors, ranges, files,
outputs, interrupts; commandline/, the command-line machinery; compute/, GEMM routes, machine
identity and jit) -> retrieval (token ids -> row ids) -> tables (where rows live) -> module (the
Engram module, module/) -> models (reference LM, HF injection) -> artifacts (what is on disk: run
folders, checkpoints, table files) -> training -> serving -> studies -> cli. This file re-exports
the names most code needs, imported on first use (``from engram import EngramLM``), so that
``import engram.cli`` for ``engram --help`` and importing the light foundation modules do not import
torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module (under engram) that defines it
_EXPORTS = {
    "DecodeCache": "models.cache", "EngramLM": "models.model", "ModelConfig": "models.model",
    "ModelOutput": "models.model",
    "Engram": "module", "EngramState": "module", "ShortConv": "module", "build_engram": "module",
    "DEAD": "retrieval.compress", "Compression": "retrieval.compress",
    "build_compression": "retrieval.compress", "default_tokenizer": "retrieval.compress",
    "EngramConfig": "retrieval.config",
    "HashStream": "retrieval.hashing", "NgramHasher": "retrieval.hashing",
    "prime_table_sizes": "retrieval.primes", "rows_per_layer": "retrieval.primes",
    "MemoryTable": "tables.store", "TableStore": "tables.store",
    "RowAdam": "training.row_optim", "build_optimizers": "training.optim",
    "Runtime": "serving.runtime", "open_model": "serving.loader",
    "GenerationConfig": "serving.generate", "Generator": "serving.generate",
    # a lossy table format measured and refused over the threshold, as the commands do
    "write_tables": "studies.table_cost", "export_hf": "studies.table_cost",
    "EngramLMConfig": "serving.hf_config", "EngramLMForCausalLM": "serving.hf_model",
    "open_tier": "tables.registry",
    "inject_triggers": "models.encoder", "eject_triggers": "models.encoder",
    "save_triggers": "models.encoder", "load_triggers": "models.encoder",
}
# Public names that differ from their definition's: ``engram.open(path, tier=..., device=...,
# precision=...)``, a run or an export as one Runtime; ``engram.load_adapter(folder)``, an
# ``engram finetune`` adapter as (transformers model with Engram, its tokenizer).
_ALIASES = {"open": ("serving.loader", "open_model"),
            "load_adapter": ("artifacts.adapter", "from_pretrained")}
DISTRIBUTION = "torch-engram"  # the name on the package index; `engram` there is another project


def __getattr__(name: str) -> Any:
    if name == "__version__":
        try:
            from importlib.metadata import version

            value = version(DISTRIBUTION)
        except Exception:  # a source tree that was never installed
            value = "unknown"
    elif name in _ALIASES:
        module, attr = _ALIASES[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'engram' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_ALIASES, "__version__"])


__all__ = sorted([*_EXPORTS, *_ALIASES])

# AutoConfig / AutoModelForCausalLM learn "engram_lm" once transformers' Auto modules load (now, if
# they already have): no trust_remote_code, and no transformers or torch import here
# (serving/hf_auto.py installs an import hook).
from .serving.hf_auto import register_when_imported as _register_when_imported  # noqa: E402

_register_when_imported()
