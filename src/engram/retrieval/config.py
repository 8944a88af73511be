"""EngramConfig: the retrieval side of Engram, with the official demo's field names.

A config written for `engram_demo_v1.py` ports unchanged; `profile` picks which compatibility rules
apply (spec section 3):

- ``"demo-v1"``: one table size per n-gram order, per-head *local* row ids out of the hasher, biased
  projections, signed-sqrt gate, short conv.
- ``"v4.1"``: one table size for all orders, *global* row ids out of the hasher, fused bias-free
  projections, no short conv, multipliers seeded with ``10007 * layer`` (the seed is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import UserError

PROFILES = ("demo-v1", "v4.1")
# What a head's row is keyed on. "ngram": the paper's suffix n-grams (the only one the official code
# and V4.1 know). The others are controls for "is it the memory?" (studies/compare.py), each taking
# one thing away from the same module: "unigram" keys every head on the current token alone (a
# second embedding of the token, no n-gram context); "constant" gives each head a single row read
# at every position (capacity 1: no token or n-gram identity reaches the module at all).
LOOKUPS = ("ngram", "unigram", "constant")

# Multiplier seed stride between layers (official code's PRIME_1).
LAYER_SEED_STRIDE = 10007


@dataclass
class EngramConfig:
    """What Engram hashes and how big its tables are: n-gram orders, heads per order, embedding
    widths, table sizes, the layers that carry a module, and the compatibility profile
    (``EngramConfig.demo_v1()``: the official demo; ``EngramConfig.v4_1()``: DeepSeek-V4.1)."""

    # Hash-table size per n-gram order (orders 2..N), or one int for all orders (v4.1 style).
    engram_vocab_size: list[int] | int = field(default_factory=lambda: [129280 * 5, 129280 * 5])
    # N: the largest n-gram order; orders 2..N are looked up.
    max_ngram_size: int = 3
    # d_ngram: width of one order's memory vector, split evenly across its K heads.
    n_embed_per_ngram: int = 512
    # K: hash heads per order; each head has its own prime-sized table.
    n_head_per_ngram: int = 8
    # Backbone layers that carry an Engram module (0-based, unique). Order matters for the primes.
    layer_ids: list[int] = field(default_factory=lambda: [1, 15])
    # Raw token id whose compressed id fills positions before the sequence start.
    pad_id: int = 2
    # Base seed of the per-layer multipliers (ignored by v4.1, which seeds with 10007 * layer).
    seed: int = 0
    # Short causal conv kernel (the conv's dilation is max_ngram_size).
    kernel_size: int = 4
    # Compatibility profile: "demo-v1" or "v4.1".
    profile: str = "demo-v1"
    # V' the tables were built for; when set, a hasher refuses a compression map of another size.
    compressed_vocab_size: int | None = None
    # Accepted so that an official demo config ports unchanged; engram never downloads it.
    tokenizer_name_or_path: str | None = None
    # What rows are keyed on (LOOKUPS); anything but "ngram" is a control, demo-v1 only.
    lookup: str = "ngram"
    # Each head's table size: the smallest unused prime above its order's size (the paper's), or
    # exactly its order's size (False: the community's hashed-bigram tables, whose size is set to
    # match a parameter budget to the row).
    prime_sizes: bool = True

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise UserError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        _check_int("max_ngram_size", self.max_ngram_size, minimum=2)
        _check_int("n_head_per_ngram", self.n_head_per_ngram, minimum=1)
        _check_int("n_embed_per_ngram", self.n_embed_per_ngram, minimum=1)
        _check_int("kernel_size", self.kernel_size, minimum=1)
        _check_int("pad_id", self.pad_id, minimum=0)
        _check_int("seed", self.seed)
        if self.lookup not in LOOKUPS:
            raise UserError(f"lookup must be one of {LOOKUPS}, got {self.lookup!r}")
        if self.profile == "v4.1" and (self.lookup != "ngram" or not self.prime_sizes):
            raise UserError("the v4.1 profile hashes suffix n-grams into prime tables; the "
                            "lookup controls (lookup, prime_sizes) are demo-v1 only")
        if self.compressed_vocab_size is not None:
            _check_int("compressed_vocab_size", self.compressed_vocab_size, minimum=1)
        if self.n_embed_per_ngram % self.n_head_per_ngram:
            raise UserError(
                f"n_embed_per_ngram={self.n_embed_per_ngram} must be divisible by "
                f"n_head_per_ngram={self.n_head_per_ngram} (each head gets an equal slice)")
        sizes = self.engram_vocab_size
        if isinstance(sizes, (list, tuple)):
            if len(sizes) != self.max_ngram_size - 1:
                raise UserError(
                    f"engram_vocab_size has {len(sizes)} entries but orders 2..{self.max_ngram_size} "
                    f"need {self.max_ngram_size - 1} (or pass one int for all orders)")
            for s in sizes:
                _check_int("engram_vocab_size entry", s, minimum=2)
            self.engram_vocab_size = [int(s) for s in sizes]
        else:
            _check_int("engram_vocab_size", sizes, minimum=2)
        ids = self.layer_ids
        if isinstance(ids, int) or not isinstance(ids, (list, tuple)) or not ids:
            raise UserError(f"layer_ids must be a non-empty list of layer indices, got {ids!r}")
        for i in ids:
            _check_int("layer id", i, minimum=0)
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if list(ids).count(i) > 1})
            raise UserError(f"layer_ids must be unique, got {list(ids)} (repeated: {dup})")
        self.layer_ids = [int(i) for i in ids]

    # -- derived values ------------------------------------------------------------------------
    @property
    def order_sizes(self) -> list[int]:
        """Table size for each order 2..N."""
        s = self.engram_vocab_size
        return list(s) if isinstance(s, list) else [int(s)] * (self.max_ngram_size - 1)

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def num_heads(self) -> int:
        """Heads per layer over all orders: (N-1) * K."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def d_mem(self) -> int:
        """Width of the concatenated memory vector e[t]: (N-1) * d_ngram."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    @property
    def global_row_ids(self) -> bool:
        """Whether the hasher returns row ids into the flat table (v4.1) or per-head ids (demo)."""
        return self.profile == "v4.1"

    def layer_seed(self, layer_id: int) -> int:
        base = 0 if self.profile == "v4.1" else self.seed
        return int(base + LAYER_SEED_STRIDE * int(layer_id))

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def demo_v1(cls, **overrides: Any) -> EngramConfig:
        """The official demo's configuration (engram_demo_v1.py)."""
        return cls(**{"profile": "demo-v1", **overrides})

    @classmethod
    def v4_1(cls, **overrides: Any) -> EngramConfig:
        """DeepSeek-V4.1 production sizes: N=4, K=8, head dim 256, 16M rows per head."""
        base = dict(engram_vocab_size=16_000_000, max_ngram_size=4, n_embed_per_ngram=8 * 256,
                    n_head_per_ngram=8, layer_ids=[1, 14], seed=0, profile="v4.1")
        return cls(**{**base, **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngramConfig:
        """Build from a dict (e.g. a demo config's ``__dict__``); unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown EngramConfig fields: {unknown}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> EngramConfig:
        return replace(self, **changes)


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are fine; floats and strings are not.
        if not (hasattr(value, "__index__") and not isinstance(value, float)):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and int(value) < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
