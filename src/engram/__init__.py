"""engram: DeepSeek's Engram conditional memory for PyTorch language models.

The folders are layers, lowest first; a module imports its own layer or lower ones, never higher
(tests/test_layers.py checks it): retrieval (token ids -> row ids) -> tables (where rows live) ->
module (the Engram module, module/) -> models (reference LM, HF injection) -> training ->
serving -> studies -> cli. This file re-exports the names most code needs.
"""

from .models.model import DecodeCache, EngramLM, ModelConfig, ModelOutput
from .module import Engram, EngramState, ShortConv, build_engram
from .retrieval.compress import DEAD, Compression, build_compression, default_tokenizer
from .retrieval.config import EngramConfig
from .retrieval.hashing import HashStream, NgramHasher
from .retrieval.primes import prime_table_sizes, rows_per_layer
from .serving.hf_auto import register_when_imported as _register_when_imported
from .tables.store import MemoryTable, TableStore
from .training.optim import RowAdam, build_optimizers

# AutoConfig / AutoModelForCausalLM learn "engram_lm" once transformers' Auto modules load (now,
# if they already have): no trust_remote_code, and no transformers import here (serving/hf_auto.py).
_register_when_imported()

DISTRIBUTION = "torch-engram"  # the name on the package index; `engram` there is another project

try:
    from importlib.metadata import version as _version

    __version__ = _version(DISTRIBUTION)
except Exception:  # a source tree that was never installed
    __version__ = "unknown"

__all__ = [
    "DEAD", "Compression", "DecodeCache", "Engram", "EngramConfig", "EngramLM", "EngramState",
    "HashStream", "MemoryTable", "ModelConfig", "ModelOutput", "NgramHasher", "RowAdam",
    "ShortConv", "TableStore", "build_compression", "build_engram", "build_optimizers",
    "default_tokenizer", "prime_table_sizes", "rows_per_layer",
]
