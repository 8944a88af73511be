"""Suffix n-grams and multi-head multiplicative-XOR hashing (spec sections 1.2-1.5, paper 2.2).

Row ids depend on token ids alone, so this runs outside the model's tensor path: in the data loader,
in a serving engine, or ahead of the forward pass to prefetch rows from a slow tier.

Shape legend:
    b batch, t positions, s new positions of one decode step, L Engram layers,
    N max n-gram order, H = ``(N-1)*K`` hash heads per layer (orders 2..N, heads 1..K in that order).

Dead positions (attention mask 0, left padding, non-text tokens, or the id ``DEAD`` = -1) act like a
sequence start: they and everything before them read as the pad token in later n-grams, so padding
never leaks into another position's ids, and a left-padded row hashes like the unpadded one.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import numpy as np
import torch

from .compress import DEAD, Compression
from .config import EngramConfig
from .primes import head_offsets, prime_table_sizes

_INT64_MAX = np.iinfo(np.int64).max
# The table files of one table set: "cold" (hashed rows, one head each) and, for Engram-Nine
# (engram.retrieval.hot), "hot" (collision-free rows of width K * d_head).
PARTS = ("cold", "hot")


class Hasher(Protocol):
    """What every caller needs of a hasher, plain (``NgramHasher``) or Engram-Nine
    (``engram.retrieval.hot.NineHasher``), so no caller asks which one it holds.

    A *table set* is the tables one layer reads; ``owner`` names the layer whose set another layer
    reads (the Nine paper shares one set between layers), ``parts`` the table files of a set.
    """

    config: EngramConfig
    layer_ids: list[int]
    compression: Compression

    @property
    def num_heads(self) -> int: ...

    @property
    def owners(self) -> list[int]:
        """The layers that own a table set (one table file per part each)."""
        ...

    @property
    def parts(self) -> tuple[str, ...]:
        """The table files of each set, a subset of ``PARTS`` ("cold" first)."""
        ...

    def owner(self, layer_id: int) -> int:
        """The layer whose table set ``layer_id`` reads."""
        ...

    def hash(self, input_ids: Any, attention_mask: Any = None) -> dict[int, torch.Tensor]: ...

    def hash_compressed(self, xc: torch.Tensor) -> dict[int, torch.Tensor]: ...

    def stream(self, batch_size: int, device: torch.device | str = "cpu") -> HashStream: ...

    def count_reads(self, tokens: Any, window: int = 1 << 15
                    ) -> dict[int, dict[str, torch.Tensor]]:
        """``{layer: {part: counts [rows of the part]}}``: how often each row is read over a raw
        token stream (a hot cache's static part); layers sharing a set share one dict."""
        ...

    def table_shape(self, layer_id: int, part: str = "cold") -> tuple[int, int]:
        """(rows, width) of the ``part`` table of ``layer_id``'s set."""
        ...

    def profile(self, layer_id: int, part: str = "cold") -> dict[str, Any]:
        """The stamp a table file carries: everything that decides which row an n-gram reads."""
        ...

    def profile_mismatch(self, theirs: dict[str, Any] | None, layer_id: int,
                         part: str = "cold") -> str | None:
        """Why a file stamped ``theirs`` cannot serve this hasher's ``part`` (None: it can)."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Entries this hasher adds to a run's checkpoint state (the Nine hot index)."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take back what ``checkpoint_state`` saved, from a checkpoint's state."""
        ...


def layer_multipliers(config: EngramConfig, compressed_vocab: int) -> dict[int, np.ndarray]:
    """Odd int64 multipliers per layer, one per n-gram position j = 0..N-1 (spec 1.3).

    Bounded by INT64_MAX // V' so that x' * mult never overflows int64.
    """
    half_bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    out = {}
    for lid in config.layer_ids:
        rng = np.random.default_rng(config.layer_seed(lid))
        r = rng.integers(low=0, high=half_bound, size=(config.max_ngram_size,), dtype=np.int64)
        out[lid] = r * 2 + 1
    return out


class NgramHasher:
    """Token ids -> per-layer hash row ids, exactly as the official code computes them.

    ``compression`` is an integer array (P, index = raw id) or a ``Compression``.
    """

    def __init__(self, config: EngramConfig, compression: Compression | Any):
        if not isinstance(compression, Compression):
            compression = Compression(compression)
        vp = len(compression)
        if config.compressed_vocab_size is not None and config.compressed_vocab_size != vp:
            raise ValueError(
                f"compression map has V'={vp} but the config was built for "
                f"compressed_vocab_size={config.compressed_vocab_size} (another tokenizer?)")
        if config.pad_id >= compression.raw_vocab_size:
            raise ValueError(f"pad_id={config.pad_id} is outside the tokenizer's "
                             f"{compression.raw_vocab_size} ids")
        self.config = config
        self.compression = compression
        self.pad = int(compression.lookup[config.pad_id])  # pad' = P(pad_id)
        self.multipliers = layer_multipliers(config, vp)
        self.primes = prime_table_sizes(config)
        self.layer_ids = list(config.layer_ids)
        # [L, N] multipliers, [L, N-1, K] primes, [L, H] offsets: moved to a device once, on demand.
        self._cpu = {
            "mult": torch.from_numpy(np.stack([self.multipliers[lid] for lid in self.layer_ids])),
            "primes": torch.tensor([self.primes[lid] for lid in self.layer_ids], dtype=torch.long),
            "offsets": torch.tensor([head_offsets(self.table_sizes(lid)) for lid in self.layer_ids],
                                    dtype=torch.long),
        }
        self._dev: dict[torch.device, dict[str, torch.Tensor]] = {}

    # -- sizes, available without allocating any table --------------------------------------------
    def table_sizes(self, layer_id: int) -> list[int]:
        """Per-head prime table sizes of one layer, in head order (orders 2..N, heads 1..K)."""
        self._check_layer(layer_id)
        return [p for order in self.primes[layer_id] for p in order]

    def num_rows(self, layer_id: int) -> int:
        return sum(self.table_sizes(layer_id))

    def offsets(self, layer_id: int) -> list[int]:
        return head_offsets(self.table_sizes(layer_id))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    # -- table sets: every layer owns its own, with one part (see Hasher) --------------------------
    @property
    def owners(self) -> list[int]:
        return list(self.layer_ids)

    @property
    def parts(self) -> tuple[str, ...]:
        return PARTS[:1]

    def owner(self, layer_id: int) -> int:
        self._check_layer(layer_id)
        return layer_id

    def table_shape(self, layer_id: int, part: str = "cold") -> tuple[int, int]:
        self._check_part(part)
        return self.num_rows(layer_id), self.config.head_dim

    def profile(self, layer_id: int, part: str = "cold") -> dict[str, Any]:
        """Compression map, multipliers and head table sizes; the compression map is identified by
        its content, so the same map reached two ways matches."""
        self._check_part(part)
        comp = self.compression
        return {
            "profile": self.config.profile,
            "compression_sha256": hashlib.sha256(comp.lookup.tobytes()).hexdigest()[:32],
            "compressed_vocab": len(comp),
            "pad": self.pad,
            "multipliers": [int(m) for m in self.multipliers[layer_id]],
            "table_sizes": self.table_sizes(layer_id),
            # a control's rows are keyed on something else: stamped, so no file mixes them up
            **({"lookup": self.config.lookup} if self.config.lookup != "ngram" else {}),
        }

    def profile_mismatch(self, theirs: dict[str, Any] | None, layer_id: int,
                         part: str = "cold") -> str | None:
        if theirs is None:
            return None  # a file written without a stamp: only its shape and config are checked
        diff = profile_diff(self.profile(layer_id, part), theirs)
        if diff == ["hot_tier"]:  # the only stamp key a plain profile lacks (retrieval/hot.py)
            return "was exported from an Engram-Nine run; this model has no hot tier"
        return hashed_differently(diff)

    def count_reads(self, tokens: Any, window: int = 1 << 15
                    ) -> dict[int, dict[str, torch.Tensor]]:
        """Each global row's reads over a raw token stream [n], hashed in windows through
        ``stream`` so n-grams across window edges count exactly as in one pass."""
        toks = torch.as_tensor(np.asarray(tokens), dtype=torch.long).reshape(-1)
        counts = {lid: torch.zeros(self.num_rows(lid), dtype=torch.long) for lid in self.layer_ids}
        offsets = {lid: torch.tensor(self.offsets(lid)) for lid in self.layer_ids}
        stream = self.stream(1)
        for a in range(0, toks.numel(), window):
            ids = stream.step(toks[None, a:a + window])  # {layer: [1, w, H]}
            for lid in self.layer_ids:
                rows = ids[lid] if self.config.global_row_ids else ids[lid] + offsets[lid]
                counts[lid] += torch.bincount(rows.reshape(-1), minlength=counts[lid].numel())
        return {lid: {"cold": c} for lid, c in counts.items()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}  # everything it needs comes from its config and the tokenizer

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        pass

    # -- hashing ------------------------------------------------------------------------------------
    def hash(self, input_ids: Any, attention_mask: Any = None,
             layers: list[int] | None = None) -> dict[int, torch.Tensor]:
        """``{layer_id: LongTensor[b, t, H]}`` for raw ids [b, t] (a tensor or array).

        Row ids are local per head for ``demo-v1`` and global (head offsets added) for ``v4.1``.
        """
        ids = _as_tensor(input_ids)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq], got {tuple(ids.shape)}")
        xc = self.compression(ids)  # [b, t] compressed, DEAD kept
        if attention_mask is not None:
            mask = _as_tensor(attention_mask).to(ids.device)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape "
                                 f"{tuple(ids.shape)}")
            xc = torch.where(mask.bool(), xc, DEAD)
        return self.hash_compressed(xc, layers)

    def hash_compressed(self, xc: torch.Tensor, layers: list[int] | None = None
                        ) -> dict[int, torch.Tensor]:
        """Hash already-compressed ids [b, t] (``DEAD`` marks dead positions)."""
        layers = self.layer_ids if layers is None else list(layers)
        for lid in layers:
            self._check_layer(lid)
        sel = [self.layer_ids.index(lid) for lid in layers]
        c = self._on(xc.device)
        b, t = xc.shape
        n_max = self.config.max_ngram_size
        mult, primes = c["mult"][sel], c["primes"][sel]  # [L, N], [L, N-1, K]
        offsets = c["offsets"][sel].view(len(sel), n_max - 1, -1)  # [L, N-1, K]

        k = self.config.n_head_per_ngram
        lookup = self.config.lookup
        if lookup == "constant":  # capacity 1: row 0 of every head, pad and start included
            rows = offsets.new_zeros(len(sel), b, t, n_max - 1, k)  # [L, b, t, N-1, K]
            if self.config.global_row_ids:
                rows += offsets[:, None, None]
            return {lid: rows[i].flatten(-2) for i, lid in enumerate(layers)}
        shifts = self._suffix_tokens(xc)  # [N, b, t]: token at t-j, or pad'
        rows = torch.empty(len(sel), b, t, n_max - 1, k, dtype=torch.long, device=xc.device)
        for i in range(len(sel)):
            # mix_n = XOR_{j<n} x'[t-j] * mult[j]; orders share prefixes, so accumulate once.
            # "unigram" keeps x'[t] * mult[0] alone for every order (each head still its prime).
            mix = shifts[0] * mult[i, 0]  # [b, t]
            for j in range(1, n_max):
                if lookup == "ngram":
                    mix = torch.bitwise_xor(mix, shifts[j] * mult[i, j])
                # One 2-D broadcast per order writes straight into the output layout; a single
                # 5-D broadcast is several times slower on CPU.
                out = rows[i, :, :, j - 1]  # [b, t, K]
                torch.remainder(mix.unsqueeze(-1), primes[i, j - 1], out=out)
                if self.config.global_row_ids:
                    out += offsets[i, j - 1]
        rows = rows.flatten(-2)  # [L, b, t, H]
        return {lid: rows[i] for i, lid in enumerate(layers)}

    def _suffix_tokens(self, xc: torch.Tensor) -> torch.Tensor:
        """[N, b, t]: slot j holds x'[t-j] when t-j..t are all alive and t-j >= 0, else pad'."""
        b, t = xc.shape
        n_max = self.config.max_ngram_size
        dead = xc == DEAD
        any_dead = bool(dead.any())
        x = torch.where(dead, self.pad, xc) if any_dead else xc
        padded = torch.nn.functional.pad(x, (n_max - 1, 0), value=self.pad)  # [b, N-1+t]
        shifts = torch.stack([padded[:, n_max - 1 - j: n_max - 1 - j + t] for j in range(n_max)])
        if any_dead:
            pos = torch.arange(t, device=xc.device)
            last_dead = torch.cummax(torch.where(dead, pos, -1), dim=1).values  # [b, t]
            js = torch.arange(n_max, device=xc.device)[:, None, None]
            alive = (pos - js) > last_dead  # [N, b, t]
            shifts = torch.where(alive, shifts, self.pad)
        return shifts

    def stream(self, batch_size: int, device: torch.device | str = "cpu") -> HashStream:
        """A stateful hasher for decoding: feed tokens step by step, get the full-sequence ids."""
        return HashStream(self, batch_size, device)

    # -- helpers -------------------------------------------------------------------------------------
    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        d = self._dev.get(device)
        if d is None:
            d = self._dev[device] = {k: v.to(device) for k, v in self._cpu.items()}
        return d

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.primes:
            raise KeyError(f"layer {layer_id} has no Engram module (layer_ids={self.layer_ids})")

    def _check_part(self, part: str) -> None:
        if part not in self.parts:
            raise ValueError(f"{type(self).__name__} has no {part!r} tables (its parts: "
                             f"{self.parts}); a hot tier table needs an Engram-Nine NineHasher")

    def __repr__(self) -> str:
        c = self.config
        return (f"NgramHasher(profile={c.profile}, N={c.max_ngram_size}, K={c.n_head_per_ngram}, "
                f"layers={self.layer_ids}, V'={len(self.compression)})")


class HashStream:
    """Keeps the last N-1 compressed tokens of each row, so decode steps hash like the full sequence.

    Before the first token the history is dead, which reads exactly like the sequence start.
    """

    def __init__(self, hasher: NgramHasher, batch_size: int, device: torch.device | str = "cpu"):
        self.hasher = hasher
        self.history = torch.full((batch_size, hasher.config.max_ngram_size - 1), DEAD,
                                  dtype=torch.long, device=device)  # [b, N-1]

    def step(self, input_ids: Any, attention_mask: Any = None) -> dict[int, torch.Tensor]:
        """Hash s new tokens per row ([b, s] or [b]); returns ``{layer: [b, s, H]}``."""
        ids = _as_tensor(input_ids).to(self.history.device)
        if ids.dim() == 1:
            ids = ids[:, None]
        if ids.dim() != 2 or ids.shape[0] != self.history.shape[0]:
            raise ValueError(f"expected ids of shape [{self.history.shape[0]}, s], "
                             f"got {tuple(ids.shape)}")
        xc = self.hasher.compression(ids)
        if attention_mask is not None:
            mask = _as_tensor(attention_mask).to(ids.device).reshape(ids.shape)
            xc = torch.where(mask.bool(), xc, DEAD)
        keep = self.history.shape[1]
        full = torch.cat([self.history, xc], dim=1)  # [b, N-1+s]
        out = self.hasher.hash_compressed(full)
        self.history = full[:, full.shape[1] - keep:]
        return {lid: r[:, keep:] for lid, r in out.items()}

    def reorder(self, index: torch.Tensor) -> None:
        """Follow a beam search or batch compaction: keep rows ``index`` of the history."""
        self.history = self.history.index_select(0, index.to(self.history.device))


def profile_diff(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The stamp keys whose values differ (or that only one side has)."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def hashed_differently(diff: list[str]) -> str | None:
    return None if not diff else (f"was hashed differently (hash profile differs in {diff}): "
                                  "its rows would be read under other n-grams")


def differences(file: dict[str, Any], model: dict[str, Any]) -> str:
    """"key: file X vs model Y, ..." for every key whose value differs."""
    return ", ".join(f"{k}: file {file.get(k)!r} vs model {model.get(k)!r}"
                     for k in sorted(set(file) | set(model)) if file.get(k) != model.get(k))


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype == object:
        raise TypeError("token ids must be a rectangular integer array")
    return torch.from_numpy(np.ascontiguousarray(arr))
