"""engram: DeepSeek's Engram conditional memory for PyTorch language models.

Layers (lower never import higher): retrieval (compress, hashing) -> storage (store) ->
module -> models -> train / serve / study -> cli.
"""

from .compress import DEAD, Compression, build_compression, default_tokenizer
from .config import EngramConfig
from .hashing import HashStream, NgramHasher
from .module import Engram, EngramState, ShortConv, build_engram
from .primes import prime_table_sizes, rows_per_layer
from .store import MemoryTable, TableStore
# Higher layers, re-exported for convenience (they import the ones above, never the reverse).
from .model import DecodeCache, EngramLM, ModelConfig, ModelOutput  # noqa: E402
from .optim import RowAdam, build_optimizers  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DEAD", "Compression", "DecodeCache", "Engram", "EngramConfig", "EngramLM", "EngramState",
    "HashStream", "MemoryTable", "ModelConfig", "ModelOutput", "NgramHasher", "RowAdam",
    "ShortConv", "TableStore", "build_compression", "build_engram", "build_optimizers",
    "default_tokenizer", "prime_table_sizes", "rows_per_layer",
]
