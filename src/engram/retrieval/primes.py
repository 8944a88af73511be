"""Prime-sized hash tables (spec section 1.4), computed without allocating anything.

Each head of each order gets its own prime table size so that heads collide independently. The
official code keeps one set of used primes across all layers (in ``layer_ids`` order) and orders;
for each order the search starts at ``table_size - 1`` and each head takes the smallest unused prime
above the current start, and the next head searches on from there.
"""

from __future__ import annotations

from .config import EngramConfig

# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24, so for all 64-bit ints.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, used: set[int]) -> int:
    """Smallest prime strictly greater than ``start`` that is not in ``used``."""
    candidate = start + 1
    while not (is_prime(candidate) and candidate not in used):
        candidate += 1
    return candidate


def prime_table_sizes(config: EngramConfig) -> dict[int, list[list[int]]]:
    """``{layer_id: [[p for head k] for order n]}``: every head's table size, in layer_ids order.
    The controls (EngramConfig.lookup, prime_sizes) size their heads as they say: one row each
    for ``lookup="constant"``, exactly the order's size without ``prime_sizes``."""
    k = config.n_head_per_ngram
    if config.lookup == "constant":
        return {lid: [[1] * k for _ in config.order_sizes] for lid in config.layer_ids}
    if not config.prime_sizes:
        return {lid: [[int(s)] * k for s in config.order_sizes] for lid in config.layer_ids}
    used: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer_id in config.layer_ids:
        per_order = []
        for size in config.order_sizes:
            start, heads = size - 1, []
            for _ in range(config.n_head_per_ngram):
                p = next_prime(start, used)
                used.add(p)
                heads.append(p)
                start = p
            per_order.append(heads)
        out[layer_id] = per_order
    return out


def head_offsets(sizes: list[int]) -> list[int]:
    """Row offset of each head in the flat per-layer table (exclusive prefix sums)."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    return offsets


def rows_per_layer(config: EngramConfig) -> dict[int, int]:
    """Total rows of each layer's flat table (spec section 3's row-count facts)."""
    return {lid: sum(sum(o) for o in per_order)
            for lid, per_order in prime_table_sizes(config).items()}
