"""A plain NumPy port of the official demo's hashing (engram_demo_v1.py), kept as an oracle.

Deliberately literal: per-order recomputation, one ``np.pad`` per shift, one ``%`` per head. Tests
compare the vectorised torch hasher against it on random configs, and ``benchmarks/hashing.py``
uses it as the speed baseline. It knows nothing about dead positions (the demo has none).
"""

from __future__ import annotations

import numpy as np

from .config import EngramConfig
from .hashing import layer_multipliers
from .primes import prime_table_sizes


class NumpyReferenceHasher:
    def __init__(self, config: EngramConfig, lookup: np.ndarray):
        self.config = config
        self.lookup = np.asarray(lookup, dtype=np.int64)
        vp = int(self.lookup.max()) + 1
        self.pad_id = int(self.lookup[config.pad_id])
        self.multipliers = layer_multipliers(config, vp)
        self.primes = prime_table_sizes(config)

    def _layer(self, x: np.ndarray, layer_id: int) -> np.ndarray:
        b, t = x.shape
        mult = self.multipliers[layer_id]
        shifts = [x] + [np.pad(x, ((0, 0), (k, 0)), mode="constant",
                               constant_values=self.pad_id)[:, :t]
                        for k in range(1, self.config.max_ngram_size)]
        out = []
        for n in range(2, self.config.max_ngram_size + 1):
            mix = shifts[0] * mult[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * mult[k])
            for p in self.primes[layer_id][n - 2]:
                out.append(mix % int(p))
        return np.stack(out, axis=2)

    def hash(self, input_ids: np.ndarray) -> dict[int, np.ndarray]:
        arr = np.asarray(input_ids, dtype=np.int64)
        x = arr.copy()
        x[arr >= 0] = self.lookup[arr[arr >= 0]]
        return {lid: self._layer(x, lid) for lid in self.config.layer_ids}
