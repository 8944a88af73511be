"""A transformers causal LM with Engram injected (models/hf.py), behind the interface the one runtime
(serving/runtime.py) drives for our own LM: forward from model ids + hash ids with a decode cache,
``logits``, ``token_nll``, ``new_cache``. ``engram finetune``'s adapter folder opens as a runtime
over it (serving/loader.py ``open_adapter``), so ``engram generate``, ``eval`` and ``lm-eval`` run
it exactly as they run a trained run.

Hashing stays the runtime's (paper 2.2: row ids from token ids alone, on the CPU): its hash ids and
the conv states of the runtime's cache reach the injected layers through
``EngramRuntime.given``, so the hooks' own per-KV-cache bookkeeping (for ``model.generate``) is
not used here. The KV cache is transformers' ``DynamicCache``; ``InjectedCache`` (models/cache.py)
adds the position and the Engram conv states, and reorders and joins both (the Generator's batch
compaction and its merge of prompt-length groups). Model ids are the tokenizer's ids (an HF model
embeds every id of its tokenizer), so the runtime's vocabulary map is the identity.

Shape legend: b rows, t positions, d hidden size, V the model's vocabulary.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..module import EngramState
from .cache import InjectedCache
from .hf import engram_runtime
from .model import ModelOutput


class InjectedLM(nn.Module):
    """A transformers causal LM with Engram injected, driven as the runtime drives an EngramLM."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        rt = engram_runtime(hf_model)
        c = hf_model.config
        n_pos = getattr(c, "max_position_embeddings", None) or c.n_positions
        self.config = SimpleNamespace(vocab_size=hf_model.get_input_embeddings().num_embeddings,
                                      max_seq_len=int(n_pos), engram=rt.config,
                                      engram_layers=list(rt.config.layer_ids))

    @property
    def runtime(self):
        return engram_runtime(self.hf)

    @property
    def embed(self) -> nn.Module:  # vocab.unknown_inputs hooks it
        return self.hf.get_input_embeddings()

    def engrams(self) -> dict[int, nn.Module]:
        return dict(self.runtime.engrams)

    def forward(self, tokens: torch.Tensor, hash_ids: dict[int, torch.Tensor] | None = None, *,
                cache: InjectedCache | None = None) -> ModelOutput:
        """tokens [b, t] -> final hidden [b, t, d]; with ``cache``, continuing at cache.pos."""
        rt = self.runtime
        if hash_ids is None:
            raise ValueError("InjectedLM needs the runtime's hash ids")
        with rt.given(hash_ids, None if cache is None else cache.engram):
            out = rt.base(input_ids=tokens, cache=None if cache is None else cache.kv,
                          use_cache=cache is not None)
        if cache is not None:
            cache.pos += tokens.shape[1]
        hidden = out.last_hidden_state  # [b, t, d] after the final norm
        return ModelOutput(hidden, hidden.new_zeros(()), head=self.logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V]: the model's own head (what its forward applies)."""
        return self.hf.get_output_embeddings()(hidden)

    def token_nll(self, output: ModelOutput, targets: torch.Tensor, *,
                  ignore_index: int = -100) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten(),
                               ignore_index=ignore_index, reduction="none").view_as(targets)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> InjectedCache:
        from transformers import DynamicCache

        if max_len is not None and not 0 < max_len <= self.config.max_seq_len:
            raise ValueError(f"max_len must be in [1, max_seq_len={self.config.max_seq_len}], got "
                             f"{max_len}")
        return InjectedCache(DynamicCache(config=self.hf.config),
                             {i: EngramState() for i in self.config.engram_layers}, 0, batch_size)


__all__ = ["InjectedLM"]
