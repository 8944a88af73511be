"""Token kinds and probe sets defined from the corpus itself, for the suppression analysis (paper 6.2).

The paper compares knowledge tasks (TriviaQA: what the tables hold) with reading comprehension (C3:
what attention does with the context). Without those benchmarks, the corpus supplies both:

- token kinds of held-out targets, from training-set n-gram counts: ``phrase`` = the target
  completes a trigram seen >= ``min_count`` times in training whose continuation is nearly fixed
  (P(target | two previous tokens) >= ``min_prob``): names, formulas, set phrases; ``function`` =
  one of the ``n_function`` most frequent tokens (and not a phrase completion); ``other``.
- ``memorised``: held-out occurrences of frequent training 4-grams whose last two tokens follow
  from the first two; scored on completing those two tokens, in their real context.
- ``copy``: a span of random frequent tokens repeated within the prompt (an induction task no
  n-gram table can know); scored on the second copy.

Shape legend:
    n tokens in a stream, b probes, t positions, V model vocabulary (local ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("phrase", "function", "other")


def _keys(ids: np.ndarray, order: int, v: int) -> np.ndarray:
    """Integer key of every n-gram of ``order`` ending at positions order-1..n-1 of ids [n]."""
    key = np.zeros(len(ids) - order + 1, dtype=np.int64)
    for j in range(order):
        key = key * v + ids[j:len(ids) - order + 1 + j]
    return key


@dataclass
class NgramCounts:
    """Training-set n-gram counts (local ids), looked up by sorted key arrays."""

    v: int
    keys: dict[int, np.ndarray]  # order -> sorted unique keys
    counts: dict[int, np.ndarray]  # order -> their counts
    unigram: np.ndarray  # [V] counts

    @classmethod
    def build(cls, train_local: np.ndarray, v: int, orders: tuple[int, ...] = (2, 3, 4)):
        ids = train_local.astype(np.int64)
        if v ** max(orders) >= 2 ** 63:
            raise ValueError(f"vocabulary {v} too large for {max(orders)}-gram keys")
        keys, counts = {}, {}
        for o in orders:
            keys[o], counts[o] = np.unique(_keys(ids, o, v), return_counts=True)
        return cls(v, keys, counts, np.bincount(ids, minlength=v))

    def count(self, order: int, key: np.ndarray) -> np.ndarray:
        k, c = self.keys[order], self.counts[order]
        pos = np.searchsorted(k, key).clip(0, len(k) - 1)
        return np.where(k[pos] == key, c[pos], 0)


def token_kinds(stream: np.ndarray, ng: NgramCounts, min_count: int = 20, min_prob: float = 0.5,
                n_function: int = 50) -> np.ndarray:
    """Kind index (into KINDS) of each target stream[1:] [n-1] of a local-id stream [n]."""
    s = stream.astype(np.int64)
    kinds = np.full(len(s) - 1, 2, dtype=np.int8)  # other
    function = np.argsort(-ng.unigram)[:n_function]
    kinds[np.isin(s[1:], function)] = 1
    tri = _keys(s, 3, ng.v)  # trigram ending at target s[i+2], i.e. target index i+1
    c3 = ng.count(3, tri)
    c2 = ng.count(2, tri // ng.v)  # its first two tokens
    phrase = (c3 >= min_count) & (c3 >= min_prob * np.maximum(c2, 1))
    kinds[1:][phrase] = 0
    return kinds


def memorised_probes(stream: np.ndarray, ng: NgramCounts, context: int, n: int,
                     min_count: int = 20, min_prob: float = 0.5, seed: int = 0) -> np.ndarray:
    """Up to n windows [b, context + 4] of a held-out stream, each ending in a frequent training
    4-gram (a b c d) whose completion (c d) follows its start (a b) with probability >= min_prob.
    The model is scored on predicting c and d (the last two positions)."""
    s = stream.astype(np.int64)
    four = _keys(s, 4, ng.v)  # ending at index i+3
    c4 = ng.count(4, four)
    c2 = ng.count(2, four // (ng.v * ng.v))
    ok = (c4 >= min_count) & (c4 >= min_prob * np.maximum(c2, 1))
    ends = np.flatnonzero(ok) + 3  # index of d
    ends = ends[ends >= context + 3]
    if len(ends) == 0:
        return np.zeros((0, context + 4), dtype=np.int64)
    rng = np.random.default_rng(seed)
    # One probe per distinct 4-gram first (names repeat), then fill with repeats.
    _, first = np.unique(four[ends - 3], return_index=True)
    pick = rng.permutation(ends[first])[:n]
    if len(pick) < n:
        rest = np.setdiff1d(ends, pick)
        pick = np.concatenate([pick, rng.permutation(rest)[:n - len(pick)]])
    return np.stack([s[e - context - 3:e + 1] for e in np.sort(pick)])


def copy_probes(unigram: np.ndarray, span: int, n: int, pool: int = 2048,
                seed: int = 0) -> np.ndarray:
    """n prompts [b, 2 * span]: a span of random tokens (from the ``pool`` most frequent) twice.
    Scored on positions ``span+1 .. 2*span-1`` of the second copy (its first token is not
    inferable)."""
    top = np.argsort(-unigram)[:pool]
    rng = np.random.default_rng(seed)
    spans = top[rng.integers(0, len(top), size=(n, span))]
    return np.concatenate([spans, spans], axis=1).astype(np.int64)
