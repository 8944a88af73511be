"""A run's restricted vocabulary inside code that speaks the tokenizer's ids: a run's LM covers
only the ids of its training corpus (``Corpus.vocab``, V of the tokenizer's W), while engines,
transformers and lm-evaluation-harness hand it tokenizer ids. The one map between the two, for
training's batches (training/corpus.py) and every front door; the policy for ids a run never saw,
as inputs and as targets, is the runtime's (serving/runtime.py).

Shape legend: b rows, t positions, d model width, V model vocabulary, W tokenizer vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch


class VocabMap:
    """Raw (tokenizer) ids <-> the model's ids; ``vocab`` [V] holds the raw id of each model id."""

    def __init__(self, vocab: Any, raw_vocab_size: int):
        self.vocab = torch.as_tensor(vocab, dtype=torch.long).cpu()  # [V]
        if self.vocab.numel() == 0 or int(self.vocab.max()) >= raw_vocab_size:
            raise ValueError(f"the vocabulary map holds {self.vocab.numel()} ids (max "
                             f"{int(self.vocab.max()) if self.vocab.numel() else None}); the "
                             f"tokenizer has {raw_vocab_size}")
        self.raw_vocab_size = raw_vocab_size
        self.local = torch.full((raw_vocab_size,), -1, dtype=torch.long)  # [W] raw -> model id
        self.local[self.vocab] = torch.arange(self.vocab.numel())

    def to_local(self, raw: Any) -> Any:
        """Raw ids [...] -> model ids [...], -1 for ids the model never saw (or out of range); a
        CPU tensor, or numpy for a numpy array."""
        if isinstance(raw, np.ndarray):
            return self.to_local(torch.from_numpy(raw)).numpy()
        raw = raw.long().cpu()
        ok = (raw >= 0) & (raw < self.raw_vocab_size)
        return torch.where(ok, self.local[raw.clamp(0, self.raw_vocab_size - 1)], -1)

    def to_raw(self, local: torch.Tensor) -> torch.Tensor:
        return self.vocab.to(local.device)[local]

    def scatter(self, logits: torch.Tensor) -> torch.Tensor:
        """Model logits [..., V] -> logits over the tokenizer's ids [..., W] (-inf where unseen)."""
        out = logits.new_full((*logits.shape[:-1], self.raw_vocab_size), float("-inf"))
        out[..., self.vocab.to(logits.device)] = logits
        return out


@contextmanager
def unknown_inputs(model: torch.nn.Module, unknown: torch.Tensor) -> Iterator[None]:
    """Inside the block the input embedding at ``unknown`` [b, t] positions is the mean embedding."""
    if not bool(unknown.any()):  # the common case costs nothing (no V x d mean per step)
        yield
        return

    def hook(_module, _args, out):  # out [b, t, d]
        mean = _module.weight.mean(0).to(out.dtype)  # [d]
        return torch.where(unknown.to(out.device).unsqueeze(-1), mean, out)

    handle = model.embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
