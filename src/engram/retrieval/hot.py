"""Engram-Nine's hot tier index: the most frequent compressed n-grams get collision-free slots.

arXiv 2601.16531 (section 3): count the compressed n-grams (orders 2..N) of the training stream,
give the top N_hot of each order a slot through a minimal perfect hash function plus a per-slot
fingerprint, and serve them from one hot row of width K * d_head instead of the K hashed heads;
misses and fingerprint mismatches go to the ordinary hashed (cold) tier. Everything here reads
token ids only, so hot slots are known in the data pipeline, before the model runs.

N_hot is per order: the paper's Nine-100K/400K and Hash-500K are equal in parameters only if each
order gets 100K hot rows of width K * d_head beside 400K cold rows per head.

A key is the n-gram packed exactly into an int64: ``(n - 2) << (bits * N) | sum_j x'[t-j] << (bits * j)``
(bits = width of the largest compressed id), so two n-grams share a key only if they are equal.

Shape legend: b batch, t positions, N max order, G = N-1 orders, K heads per order,
H = G * K hash heads, n keys, q queries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .compress import DEAD
from .hashing import (
    PARTS,
    HashStream,
    NgramHasher,
    _as_tensor,
    differences,
    hashed_differently,
    profile_diff,
)
from .mphf import (
    build_mphf,
    check_keys,
    fingerprint,
    fingerprint_dtype,
    mphf_from_state_dict,
)

KINDS = ("mphf", "exact")


def key_bits(hasher: NgramHasher) -> int:
    """Bits per token in a packed key; refuses a (V', N) whose keys would not fit in 63 bits."""
    bits = max(1, (len(hasher.compression) - 1).bit_length())
    n = hasher.config.max_ngram_size
    if bits * n + max(1, (n - 2).bit_length()) > 63:
        raise UserError(f"n-grams of order {n} over V'={len(hasher.compression)} do not pack into "
                         f"an int64 key ({bits} bits per token); use a smaller max_ngram_size")
    return bits


def ngram_keys(hasher: NgramHasher, xc: torch.Tensor) -> torch.Tensor:
    """Compressed ids [b, t] (DEAD marks dead positions) -> exact n-gram keys [b, t, G]."""
    bits, n_max = key_bits(hasher), hasher.config.max_ngram_size
    # The hasher's own suffix view, so a key sees exactly the tokens (and pads) its hash saw.
    shifts = hasher._suffix_tokens(xc)  # [N, b, t]
    acc = shifts[0].clone()
    out = []
    for j in range(1, n_max):
        acc = acc | (shifts[j] << (bits * j))
        out.append(acc | ((j - 1) << (bits * n_max)))  # order n = j + 1
    return torch.stack(out, dim=-1)  # [b, t, G]


def count_keys(hasher: NgramHasher, tokens: Any, chunk: int = 1 << 20
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Distinct keys and their counts per order (2..N) over a raw token stream read as one sequence."""
    raw = torch.as_tensor(np.asarray(tokens)).long().view(1, -1)
    if raw.numel() == 0:
        raise ValueError("cannot count n-grams of an empty token stream")
    xc = hasher.compression(raw)  # [1, n]
    keep = hasher.config.max_ngram_size - 1
    per_order: list[list[np.ndarray]] = [[] for _ in range(keep)]
    for a in range(0, xc.shape[1], chunk):
        # Each chunk carries the previous N-1 tokens, whose own keys were counted already.
        lo = max(0, a - keep)
        keys = ngram_keys(hasher, xc[:, lo:a + chunk])[0, a - lo:]  # [chunk, G]
        for g in range(keep):
            per_order[g].append(keys[:, g].numpy())
    return [np.unique(np.concatenate(k), return_counts=True) for k in per_order]


def top_keys(counted: list[tuple[np.ndarray, np.ndarray]], n_hot: int) -> torch.Tensor:
    """The n_hot most frequent keys of each order (ties: smaller key first), orders back to back."""
    if n_hot < 0:
        raise UserError(f"N_hot must be >= 0, got {n_hot}")
    out = []
    for g, (keys, counts) in enumerate(counted):
        if n_hot > len(keys):
            raise UserError(f"N_hot={n_hot} but the training stream has only {len(keys)} distinct "
                             f"n-grams of order {g + 2}; choose N_hot <= {len(keys)}")
        order = np.lexsort((keys, -counts))[:n_hot]
        out.append(keys[order])
    return torch.from_numpy(np.concatenate(out).astype(np.int64)) if out else torch.zeros(0).long()


class HotIndex:
    """Hot keys -> slots. ``kind="mphf"``: MPHF + ``bits``-bit fingerprint per slot (false positive
    rate ~2^-bits); ``kind="exact"``: sorted keys + searchsorted (no false positives, 64 bits/key)."""

    def __init__(self, keys: torch.Tensor, kind: str, bits: int = 16, mphf: Any = None,
                 fingerprints: torch.Tensor | None = None, seed: int = 0):
        if kind not in KINDS:
            raise UserError(f"hot index kind must be one of {KINDS}, got {kind!r}")
        self.keys = keys  # [n] key of each slot (sorted for "exact")
        self.kind, self.bits, self.mphf, self.seed = kind, int(bits), mphf, int(seed)
        self.fingerprints = fingerprints  # [n] per slot, mphf only

    @property
    def num_slots(self) -> int:
        return int(self.keys.numel())

    @classmethod
    def build(cls, keys: torch.Tensor, kind: str = "mphf", bits: int = 16, engine: str = "torch",
              seed: int = 0, gamma: float = 2.0) -> HotIndex:
        keys = check_keys(keys)
        if kind == "exact" or keys.numel() == 0:
            return cls(torch.sort(keys).values, kind, bits, seed=seed)
        if kind != "mphf":
            raise UserError(f"hot index kind must be one of {KINDS}, got {kind!r}")
        mphf = build_mphf(keys, engine, gamma=gamma, seed=seed)
        slots = mphf.lookup(keys)
        if bool((slots < 0).any()) or torch.unique(slots).numel() != keys.numel():
            raise RuntimeError("MPHF build did not give every key its own slot")
        by_slot = torch.empty_like(keys)
        by_slot[slots] = keys
        fps = fingerprint(by_slot, bits, seed).to(fingerprint_dtype(bits))
        return cls(by_slot, kind, bits, mphf, fps, seed)

    def lookup(self, q: torch.Tensor) -> torch.Tensor:
        """Keys [...] -> hot slot [...], -1 for the cold tier (a miss or a fingerprint mismatch)."""
        shape, q = q.shape, q.reshape(-1)
        if self.num_slots == 0:
            return torch.full(shape, -1, dtype=torch.long, device=q.device)
        if self.kind == "exact":
            at = torch.searchsorted(self.keys, q).clamp(max=self.num_slots - 1)
            return torch.where(self.keys[at] == q, at, -1).view(shape)
        s = self.mphf.lookup(q)  # members: their slot; others: any slot or -1
        fp = fingerprint(q, self.bits, self.seed).to(self.fingerprints.dtype)
        ok = (s >= 0) & (self.fingerprints[s.clamp(min=0)] == fp)
        return torch.where(ok, s, -1).view(shape)

    def nbytes(self) -> dict[str, float]:
        """Bytes of what a lookup needs, and bits per hot key (the stored keys are extra)."""
        n = max(1, self.num_slots)
        if self.kind == "exact" or self.mphf is None:  # (an empty mphf index holds nothing)
            idx = self.keys.numel() * 8
            return {"index_bytes": idx, "bits_per_key": 8 * idx / n, "mphf_bits_per_key": 0.0,
                    "fingerprint_bits_per_key": 0.0}
        mb = self.mphf.nbytes()
        fb = self.fingerprints.numel() * self.fingerprints.element_size()
        return {"index_bytes": mb + fb, "bits_per_key": 8 * (mb + fb) / n,
                "mphf_bits_per_key": 8 * mb / n, "fingerprint_bits_per_key": 8 * fb / n,
                "fingerprint_bits_packed": self.bits}

    def state_dict(self) -> dict[str, Any]:
        sd = {"kind": self.kind, "bits": self.bits, "seed": self.seed, "keys": self.keys}
        if self.kind == "mphf" and self.mphf is not None:
            sd["mphf"], sd["fingerprints"] = self.mphf.state_dict(), self.fingerprints
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any]) -> HotIndex:
        try:
            mphf = mphf_from_state_dict(sd["mphf"]) if "mphf" in sd else None
            return cls(sd["keys"], sd["kind"], sd["bits"], mphf, sd.get("fingerprints"), sd["seed"])
        except KeyError as e:
            raise ValueError(f"not a hot index state: missing {e}") from e

    def equals(self, other: HotIndex) -> bool:
        return (self.kind == other.kind and self.bits == other.bits
                and torch.equal(self.keys, other.keys))

    def digest(self) -> str:
        """Content hash of the whole index (kind, bits, seed, keys by slot, MPHF, fingerprints):
        table files of a Nine run carry it, so rows trained for one index never serve another."""
        h = hashlib.sha256()

        def walk(obj: Any, name: str) -> None:
            if isinstance(obj, torch.Tensor):
                t = obj.detach().cpu().contiguous()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            elif isinstance(obj, dict):
                for k in sorted(obj):
                    walk(obj[k], f"{name}.{k}")
            else:
                h.update(f"{name}={json.dumps(obj, default=str)};".encode())

        walk(self.state_dict(), "index")
        return h.hexdigest()[:32]


def build_hot_index(hasher: NgramHasher, tokens: Any, n_hot: int, kind: str = "mphf",
                    bits: int = 16, engine: str = "torch", seed: int = 0) -> HotIndex:
    """Count the stream's n-grams and index the top ``n_hot`` of each order."""
    return HotIndex.build(top_keys(count_keys(hasher, tokens), n_hot), kind, bits, engine, seed)


class NineHasher:
    """Token ids -> ``{layer: [b, t, H + G]}``: H global cold row ids, then G hot slots (-1 = cold).

    ``shared=True`` gives every Engram layer the first layer's ids: one table set read by several
    layers, the Nine paper's setup. A drop-in for ``NgramHasher`` in the data pipeline.
    """

    def __init__(self, hasher: NgramHasher, index: HotIndex, shared: bool = True):
        self.hasher, self.index, self.shared = hasher, index, shared
        self.config, self.layer_ids = hasher.config, list(hasher.layer_ids)
        self.compression = hasher.compression
        key_bits(hasher)  # fail now, not on the first batch
        self._offsets = {lid: torch.tensor(hasher.offsets(lid)) for lid in self.layer_ids}

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def hash(self, input_ids: Any, attention_mask: Any = None) -> dict[int, torch.Tensor]:
        ids = _as_tensor(input_ids)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq], got {tuple(ids.shape)}")
        xc = self.compression(ids)  # [b, t]
        if attention_mask is not None:
            xc = torch.where(_as_tensor(attention_mask).to(ids.device).bool(), xc, DEAD)
        return self.hash_compressed(xc)

    def hash_compressed(self, xc: torch.Tensor) -> dict[int, torch.Tensor]:
        """Compressed ids [b, t] (DEAD = dead) -> ``{layer: [b, t, H + G]}``."""
        layers = self.owners
        rows = self.hasher.hash_compressed(xc, layers)  # {lid: [b, t, H]}
        slots = self.index.lookup(ngram_keys(self.hasher, xc))  # [b, t, G]
        out = {}
        for lid, r in rows.items():
            if not self.config.global_row_ids:
                r = r + self._offsets[lid].to(r.device)
            out[lid] = torch.cat([r, slots], dim=-1)  # [b, t, H + G]
        return {lid: out[layers[0] if self.shared else lid] for lid in self.layer_ids}

    def stream(self, batch_size: int, device: torch.device | str = "cpu") -> HashStream:
        """Decode step by step with the full sequence's ids (the same history as NgramHasher's)."""
        return HashStream(self, batch_size, device)

    def split(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H + G] -> cold rows [..., H], hot slots [..., G]."""
        h = self.num_heads
        return ids[..., :h], ids[..., h:]

    @property
    def owners(self) -> list[int]:
        """The layers that own a table set: the first Engram layer when shared, else every one."""
        return self.layer_ids[:1] if self.shared else list(self.layer_ids)

    def owner(self, layer_id: int) -> int:
        """The layer whose table set ``layer_id`` reads (the first Engram layer's when shared)."""
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer {self.layer_ids}")
        return self.layer_ids[0] if self.shared else layer_id

    @property
    def parts(self) -> tuple[str, ...]:
        """Cold rows, and hot rows when the index has slots (an empty index writes no hot file)."""
        return PARTS if self.index.num_slots else PARTS[:1]

    def table_shape(self, layer_id: int, part: str = "cold") -> tuple[int, int]:
        """Cold: the owner's hashed rows [R, e]; hot: one row per slot [S, K * e]."""
        self._check_part(part)
        if part == "cold":
            return self.hasher.table_shape(self.owner(layer_id))
        return self.index.num_slots, self.config.n_head_per_ngram * self.config.head_dim

    def profile(self, layer_id: int, part: str = "cold") -> dict[str, Any]:
        """The owner's plain stamp plus the hot tier: the index's content hash, its slot count,
        which part the file holds and the layers that read the set (section 4); a shared set is
        hashed with its first layer's multipliers."""
        self._check_part(part)
        owner = self.owner(layer_id)
        prof = self.hasher.profile(owner)
        prof["hot_tier"] = {"tier": part, "index": self.index.digest(),
                            "slots": self.index.num_slots, "kind": self.index.kind,
                            "fingerprint_bits": self.index.bits,
                            "layers": [lid for lid in self.layer_ids if self.owner(lid) == owner]}
        return prof

    def profile_mismatch(self, theirs: dict[str, Any] | None, layer_id: int,
                         part: str = "cold") -> str | None:
        """Like NgramHasher's, but a file without a stamp is refused too: the stamp names the hot
        index its rows were trained for."""
        mine, theirs = self.profile(layer_id, part), theirs or {}
        diff = profile_diff(mine, theirs)
        if diff == ["hot_tier"] and "hot_tier" in theirs:
            return (f"belongs to another Engram-Nine hot tier "
                    f"({differences(theirs['hot_tier'], mine['hot_tier'])}); re-export the "
                    "tables of this run")
        if diff == ["hot_tier"]:
            return "was exported from a plain (no hot tier) run; this model has a hot tier"
        return hashed_differently(diff)

    def _check_part(self, part: str) -> None:
        if part not in self.parts:
            raise ValueError(f"this NineHasher has no {part!r} tables (its parts: {self.parts})")

    def count_reads(self, tokens: Any, window: int = 1 << 15
                    ) -> dict[int, dict[str, torch.Tensor]]:
        """``{layer: {"cold": counts [R], "hot": counts [S]}}``: how often each row of each part
        is read over a raw token stream [n] (a cold row only by an order the hot tier did not
        serve); the serving cache's static part (``engram.tables.cache.build_cache``). Shared
        layers share one dict."""
        toks = torch.as_tensor(np.asarray(tokens), dtype=torch.long).reshape(-1)
        g, k, s = self.config.max_ngram_size - 1, self.config.n_head_per_ngram, self.index.num_slots
        counts = {o: (torch.zeros(self.hasher.num_rows(o), dtype=torch.long),
                      torch.zeros(s, dtype=torch.long)) for o in self.owners}
        stream = self.stream(1)
        for a in range(0, toks.numel(), window):
            ids = stream.step(toks[None, a:a + window])  # {layer: [1, w, H + G]}
            for o in self.owners:
                rows, slots = self.split(ids[o])
                rows, slots = rows.reshape(-1, g, k), slots.reshape(-1, g)  # [w, G, K], [w, G]
                cold, hot = counts[o]
                cold += torch.bincount(rows[slots < 0].reshape(-1), minlength=cold.numel())
                hot += torch.bincount(slots[slots >= 0], minlength=s)
        per_set = {o: dict(zip(self.parts, c)) for o, c in counts.items()}
        return {lid: per_set[self.owner(lid)] for lid in self.layer_ids}

    # -- the hot index in a run's checkpoint -----------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """The hot tier's keys, MPHF and fingerprints: the index the hot rows were trained for."""
        return {STATE_KEY: self.index.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if STATE_KEY not in state:
            raise ValueError("the checkpoint carries no hot index: not an Engram-Nine run")
        self.index = HotIndex.from_state_dict(state[STATE_KEY])


STATE_KEY = "hot_index"  # where a checkpoint's state keeps a Nine run's hot index


def checkpoint_hasher(hasher: Any, state: dict[str, Any], shared: bool) -> Any:
    """The hasher a checkpoint was trained with, from the plain one its config builds: a
    ``NineHasher`` over the saved hot index when ``state`` carries one, else ``hasher``. A
    NineHasher given must hold the checkpoint's index and sharing."""
    index = HotIndex.from_state_dict(state[STATE_KEY]) if STATE_KEY in state else None
    if isinstance(hasher, NineHasher):
        if index is None or index.digest() != hasher.index.digest() or hasher.shared != shared:
            raise ValueError("the NineHasher given has another hot index or table sharing than "
                             "the checkpoint")
        return hasher
    return hasher if index is None else NineHasher(hasher, index, shared=shared)


def nine_config(hasher: Any) -> dict[str, Any] | None:
    """What an export's config.json says of the hot tier (``engram_nine``): slots and sharing;
    None for a plain hasher. The index itself travels in the table files."""
    if not isinstance(hasher, NineHasher):
        return None
    return {"hot_slots": hasher.index.num_slots, "shared": hasher.shared}
