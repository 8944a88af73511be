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

__version__ = "0.1.0"

__all__ = [
    "DEAD", "Compression", "Engram", "EngramConfig", "EngramState", "HashStream", "MemoryTable",
    "NgramHasher", "ShortConv", "TableStore", "build_compression", "build_engram",
    "default_tokenizer", "prime_table_sizes", "rows_per_layer",
]
