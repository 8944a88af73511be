"""Minimal perfect hashing of 64-bit keys, vectorised over a batch (Engram-Nine's hot-tier index).

A minimal perfect hash function (MPHF) maps n known keys onto slots 0..n-1 with no collision; a key
outside the set gets an arbitrary slot (or none), so callers keep a fingerprint per slot to reject
it (arXiv 2601.16531, section 3: MPHF + fingerprint).

Two engines, same contract (``lookup`` -> slot in [0, n) for members, arbitrary or -1 otherwise):

- ``"torch"`` (``TorchMPHF``): BBHash (Limasset et al., SEA 2017) written in torch: level l is a
  bit array of ~gamma * (keys left) bits; a key whose level-l hash lands alone in its bit sets it and
  takes slot = rank of that bit; the rest go to level l+1; the few left after ``max_levels`` are kept
  sorted. Build and lookup are whole-batch tensor ops (a Python loop over ~10-20 levels only), on any
  device, and the structure is plain tensors, so checkpoints and table files carry it as is.
- ``"bbhash"`` (``BBHashMPHF``): the ``bbhash`` wheel (C++ BooPHF; optional extra ``nine``).
  ``lookup_many`` runs in C++ over a NumPy array (CPU only); the structure is its own file format,
  stored as bytes.

Shape legend: n keys in the set, q query keys, w 64-bit words of all levels' bit arrays.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from typing import Any

import numpy as np
import torch

from ..errors import UserError

ENGINES = ("torch", "bbhash")


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_POP = [_signed(m) for m in (0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F,
                             0x0101010101010101)]


def shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 by a constant 1 <= s <= 63 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    x = x ^ shr(x, 30)
    x = x * _MIX1  # int64 multiplication wraps: the unsigned product's low 64 bits
    x = x ^ shr(x, 27)
    x = x * _MIX2
    return x ^ shr(x, 31)


@functools.lru_cache(maxsize=1024)
def _salt(seed: int) -> int:
    return int(mix64(torch.tensor([_signed((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))]))[0])


def seeded(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A seeded 64-bit hash of int64 keys (seed picks an independent-looking function)."""
    return mix64(x ^ _salt(seed))


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 word (SWAR; no popcount op in torch)."""
    x = x - (shr(x, 1) & _POP[0])
    x = (x & _POP[1]) + (shr(x, 2) & _POP[1])
    x = (x + shr(x, 4)) & _POP[2]
    return shr(x * _POP[3], 56)


def fingerprint(keys: torch.Tensor, bits: int, seed: int = 0) -> torch.Tensor:
    """``bits``-bit fingerprints in [0, 2^bits) of int64 keys, independent of the MPHF's hashes."""
    if not 1 <= bits <= 32:
        raise UserError(f"fingerprint bits must be in [1, 32], got {bits}")
    return shr(seeded(keys, seed + 0x5EED), 64 - bits)


def fingerprint_dtype(bits: int) -> torch.dtype:
    """Smallest signed dtype whose wrap-around cast keeps ``bits`` bits apart."""
    return torch.int8 if bits <= 8 else torch.int16 if bits <= 16 else torch.int32


def check_keys(keys: Any) -> torch.Tensor:
    if not isinstance(keys, torch.Tensor):
        keys = torch.as_tensor(np.asarray(keys))
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"keys must be a 1-D int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
    if keys.numel() != torch.unique(keys).numel():
        raise ValueError("an MPHF needs distinct keys; the key set has duplicates")
    return keys


class TorchMPHF:
    """BBHash in torch. ``build(keys)``; ``lookup(q)`` -> slots [q] (-1 where no level claims q)."""

    engine = "torch"

    def __init__(self, words: torch.Tensor, ranks: torch.Tensor, level_bits: torch.Tensor,
                 fallback: torch.Tensor, n: int, seed: int):
        self.words = words  # [w] int64: every level's bits, back to back
        self.ranks = ranks  # [w] int32: set bits before each word (= slots of earlier bits)
        self.level_bits = level_bits  # [levels] int64: bits of each level (a multiple of 64)
        self.fallback = fallback  # [f] int64, sorted: keys no level placed; slots n-f..n-1
        self.n, self.seed = int(n), int(seed)
        offs = torch.cumsum(level_bits, 0) - level_bits
        self._levels = list(zip(offs.tolist(), level_bits.tolist()))
        self._salts: torch.Tensor | None = None  # per-level salts, offsets, sizes on lookup's device

    @classmethod
    def build(cls, keys: torch.Tensor, gamma: float = 2.0, seed: int = 0,
              max_levels: int = 32) -> TorchMPHF:
        keys = check_keys(keys)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        rest, chunks = keys, []
        for level in range(max_levels):
            if rest.numel() == 0:
                break
            m = 64 * max(1, math.ceil(gamma * rest.numel() / 64))
            h = shr(seeded(rest, seed * 64 + level), 1) % m  # [k] positions in this level
            alone = torch.bincount(h, minlength=m)[h] == 1
            bits = torch.zeros(m, dtype=torch.bool, device=keys.device)
            bits[h[alone]] = True
            chunks.append(bits)
            rest = rest[~alone]
        allbits = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.bool)
        shifts = torch.arange(64, device=allbits.device)
        # Distinct powers of two never carry, so the sum is the OR (bit 63 wraps to the sign).
        words = (allbits.view(-1, 64).long() << shifts).sum(1)  # [w]
        counts = popcount64(words)
        ranks = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        level_bits = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        return cls(words, ranks, level_bits, torch.sort(rest).values, keys.numel(), seed)

    def lookup(self, q: torch.Tensor) -> torch.Tensor:
        # Every level at once ([levels, q]): a handful of wide ops beat ~40 narrow ones per level
        # for training-sized batches, and no key needs a data-dependent loop.
        dev = q.device
        if self._salts is None or self._salts.device != dev:
            self._salts = torch.tensor([_salt(self.seed * 64 + lv) for lv in range(len(self._levels))],
                                       dtype=torch.long, device=dev)[:, None]  # [levels, 1]
            self._offs = torch.tensor([o for o, _ in self._levels], device=dev)[:, None]
            self._sizes = torch.tensor([m for _, m in self._levels], device=dev)[:, None]
        out = torch.full_like(q, -1)  # [q]
        if self._levels:
            pos = shr(mix64(q[None] ^ self._salts), 1) % self._sizes + self._offs  # [levels, q]
            hit = ((self.words[pos >> 6] >> (pos & 63)) & 1).bool()  # [levels, q]
            p = torch.full_like(q, -1)  # [q]: the position of the first level that claims q
            for lv in range(len(self._levels) - 1, -1, -1):  # (argmax over levels is ~50x slower)
                p = torch.where(hit[lv], pos[lv], p)
            found = p >= 0
            p = p.clamp(min=0)
            word, s = self.words[p >> 6], p & 63
            # s = 63: (1 << 63) - 1 wraps to the 63 low bits, as wanted.
            slot = self.ranks[p >> 6].long() + popcount64(word & ((1 << s) - 1))
            out = torch.where(found, slot, out)
        if self.fallback.numel():
            f = self.fallback.numel()
            at = torch.searchsorted(self.fallback, q).clamp(max=f - 1)
            out = torch.where((out < 0) & (self.fallback[at] == q), self.n - f + at, out)
        return out

    def nbytes(self) -> int:
        return (self.words.numel() * 8 + self.ranks.numel() * 4 + self.fallback.numel() * 8
                + self.level_bits.numel() * 8)

    def state_dict(self) -> dict[str, Any]:
        return {"engine": "torch", "words": self.words, "ranks": self.ranks,
                "level_bits": self.level_bits, "fallback": self.fallback, "n": self.n,
                "seed": self.seed}

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> TorchMPHF:
        return cls(sd["words"], sd["ranks"], sd["level_bits"], sd["fallback"], sd["n"], sd["seed"])

    def to(self, device: torch.device | str) -> TorchMPHF:
        return TorchMPHF(self.words.to(device), self.ranks.to(device), self.level_bits,
                         self.fallback.to(device), self.n, self.seed)


class BBHashMPHF:
    """The ``bbhash`` wheel's BooPHF behind the same contract (CPU; ``pip install bbhash``)."""

    engine = "bbhash"

    def __init__(self, mphf: Any, n: int, blob: bytes | None = None):
        self.mphf, self.n, self._blob = mphf, int(n), blob

    @classmethod
    def build(cls, keys: torch.Tensor, gamma: float = 2.0, seed: int = 0,
              threads: int = 1) -> BBHashMPHF:
        bbhash = _import_bbhash()
        keys = check_keys(keys)
        if keys.numel() == 0:
            raise ValueError("bbhash cannot build over an empty key set")
        u = keys.cpu().numpy().view(np.uint64)
        return cls(bbhash.PyMPHF(u.tolist(), len(u), threads, float(gamma)), len(u))

    def lookup(self, q: torch.Tensor) -> torch.Tensor:
        s = self.mphf.lookup_many(np.ascontiguousarray(q.cpu().numpy()).view(np.uint64))
        s = torch.from_numpy(np.asarray(s).view(np.int64).copy())  # not-found (2^64-1) -> -1
        return torch.where((s >= 0) & (s < self.n), s, -1).to(q.device)

    def nbytes(self) -> int:
        return int(self.mphf.get_mem()) // 8

    def _bytes(self) -> bytes:
        if self._blob is None:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "mphf.bin")
                self.mphf.save(path)
                with open(path, "rb") as f:
                    self._blob = f.read()
        return self._blob

    def state_dict(self) -> dict[str, Any]:
        blob = torch.frombuffer(bytearray(self._bytes()), dtype=torch.uint8)
        return {"engine": "bbhash", "blob": blob, "n": self.n}

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> BBHashMPHF:
        bbhash = _import_bbhash()
        blob = bytes(sd["blob"].numpy().tobytes())
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mphf.bin")
            with open(path, "wb") as f:
                f.write(blob)
            return cls(bbhash.load_mphf(path), sd["n"], blob)

    def to(self, device: torch.device | str) -> BBHashMPHF:
        return self  # lives in host memory; lookup moves its answer to the query's device


def _import_bbhash():
    try:
        import bbhash
    except ImportError as e:
        raise ImportError("engine 'bbhash' needs the bbhash wheel: pip install -e '.[nine]' "
                          "(builds from source with gcc); engine 'torch' needs nothing") from e
    return bbhash


def build_mphf(keys: torch.Tensor, engine: str = "torch", gamma: float = 2.0, seed: int = 0):
    if engine not in ENGINES:
        raise UserError(f"MPHF engine must be one of {ENGINES}, got {engine!r}")
    return (TorchMPHF if engine == "torch" else BBHashMPHF).build(keys, gamma=gamma, seed=seed)


def mphf_from_state_dict(sd: dict[str, Any]):
    engine = sd.get("engine")
    if engine not in ENGINES:
        raise ValueError(f"not an MPHF state (engine={engine!r})")
    return (TorchMPHF if engine == "torch" else BBHashMPHF).from_state_dict(sd)
