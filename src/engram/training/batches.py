"""Training and validation batches cut from a corpus's token streams (see ``corpus``).

Batches are a pure function of (seed, step) or of stream order, so training resumes without replay
and every evaluation sees the same windows. A window is read from the shard files when its batch is
made (``streams.TokenStream``) and mapped to model ids then, so memory stays flat however large the
corpus. Hash ids are computed here, from token ids, never inside the model (spec
section 4: known before the forward pass, so rows can be prefetched).

Shape legend:
    n tokens in a stream, b batch, t positions (seq_len), H hash heads per Engram layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import UserError
from ..retrieval.hashing import NgramHasher
from .corpus import Corpus
from .streams import TokenStream


@dataclass
class Batch:
    raw: torch.Tensor  # [b, t] raw ids, what the hasher and a tokenizer read
    inputs: torch.Tensor  # [b, t] local ids
    targets: torch.Tensor  # [b, t] local id of the token after each input
    hash_ids: dict[int, torch.Tensor]  # {layer_id: [b, t, H]} = hasher.hash(raw); {} without hasher

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.raw.to(device), self.inputs.to(device), self.targets.to(device),
                     {k: v.to(device) for k, v in self.hash_ids.items()})


def _check_stream(tokens: Any, batch_size: int, seq_len: int) -> TokenStream:
    """``tokens`` (a TokenStream, or a 1-D integer array) as a stream, checked."""
    if not isinstance(tokens, TokenStream):
        a = np.asarray(tokens)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
        tokens = TokenStream([a])
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if len(tokens) < seq_len + 1:  # a window needs one more token for the last target
        raise UserError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens; "
                         f"the stream has {len(tokens)}")
    return tokens


def _make_batch(stream: TokenStream, corpus: Corpus, starts: np.ndarray, seq_len: int,
                hasher: NgramHasher | None) -> Batch:
    win = stream.windows(starts, seq_len + 1)  # [b, t+1] raw ids
    raw = torch.from_numpy(win.astype(np.int64))  # [b, t+1]
    loc = torch.from_numpy(corpus.to_local(win))  # [b, t+1] int64 local ids
    x = raw[:, :-1].contiguous()  # [b, t]
    return Batch(x, loc[:, :-1].contiguous(), loc[:, 1:].contiguous(), hasher.hash(x) if hasher else {})


SAMPLINGS = ("uniform", "stratified")


class TokenBatches:
    """Random windows of a token stream; ``batch(step)`` depends on (seed, step) only, so a run
    resumed at step k gets exactly the batches it would have had, with no replay. A window may start
    anywhere in the whole stream, across shard boundaries.

    ``sampling``: "uniform" draws each window's start anywhere; "stratified" cuts the stream into
    b equal strata and draws window i of every batch inside stratum i. Each window is still uniform
    over the stream (the gradient's expectation is unchanged) and the seed still sets the order, but
    every batch holds the sources in their corpus proportions: on a stream of sources back to back
    (two languages by default) a uniform batch's mix varies step to step, and the last steps' mix
    moves a short run's final loss (studies/compare.py measures the effect).
    """

    def __init__(self, tokens: TokenStream | np.ndarray, batch_size: int, seq_len: int,
                 corpus: Corpus, hasher: NgramHasher | None = None, seed: int = 0,
                 sampling: str = "uniform"):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if sampling not in SAMPLINGS:
            raise UserError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
        self.tokens = _check_stream(tokens, batch_size, seq_len)  # [n] raw
        self.corpus = corpus
        self.batch_size, self.seq_len, self.hasher, self.seed = batch_size, seq_len, hasher, seed
        self.sampling = sampling

    def batch(self, step: int) -> Batch:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])  # a fresh stream per step: no state to resume
        span = len(self.tokens) - self.seq_len  # window starts are [0, span)
        if self.sampling == "stratified" and span >= self.batch_size:
            edges = np.arange(self.batch_size + 1) * span // self.batch_size  # [b + 1]
            starts = rng.integers(edges[:-1], edges[1:])  # [b]: window i inside stratum i
        else:  # (a stream shorter than b windows has no b strata: uniform)
            starts = rng.integers(0, span, size=self.batch_size)  # [b]
        return _make_batch(self.tokens, self.corpus, starts, self.seq_len, self.hasher)


def val_batches(tokens: TokenStream | np.ndarray, batch_size: int, seq_len: int, corpus: Corpus,
                hasher: NgramHasher | None = None, max_batches: int | None = None) -> Iterator[Batch]:
    """Non-overlapping windows in stream order (the last batch may be smaller), so every
    validation token is predicted once and every evaluation sees the same ones.

    With ``max_batches`` below the full sweep, the windows kept are spread evenly over the whole
    stream: the stream is sources back to back, and its head alone would measure one source.
    """
    stream = _check_stream(tokens, batch_size, seq_len)  # checked now, not at the first next()
    starts = np.arange((len(stream) - 1) // seq_len) * seq_len  # [windows]
    n = -(-len(starts) // batch_size)  # ceil: a smaller last batch, no token left out
    if max_batches is not None and max_batches < n:
        n = max_batches
        keep = np.linspace(0, len(starts) - 1, n * batch_size).round().astype(np.int64)
        starts = starts[np.unique(keep)]

    def gen() -> Iterator[Batch]:
        for i in range(n):
            yield _make_batch(stream, corpus, starts[i * batch_size:(i + 1) * batch_size], seq_len,
                              hasher)
    return gen()
