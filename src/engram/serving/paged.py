"""The reference LM on a paged engine's flat token batch: requests mixed in one step, history in
slots (serving/slots.py), attention supplied by the engine.

``PagedLM`` runs one engine step: raw token ids of all scheduled tokens -> final hidden states. It
hashes every token's suffix n-grams from the slot history before the first layer (so a tier with
prefetch starts gathering all layers' rows at once), then runs the reference model's own layers
(``EngramLM.trunk``: embedding, blocks, final norm) on the flat batch as one [1, n] sequence,
passing in what differs: the attention proper, the engine's paged attention (vLLM's ``Attention``
in the plugin; in tests a plain torch paged KV, tests/serving/engine_sim.py, so everything here is
tested without an engine), and the Engram read, per request group with the short conv continued
from the slots.

Vocabulary: the engine samples tokenizer ids; the runtime maps them to the model's and back, with
its policy for ids the run never saw (serving/runtime.py).

Shape legend: n tokens of the step, R requests, d width, m branches, h heads, e head dim,
H hash heads per layer, N max n-gram order, V model vocabulary, W tokenizer vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..models.layers import Attend, Memory
from ..models.model import EngramLM
from ..module import Engram, EngramState
from ..retrieval.hashing import NgramHasher
from ..tables.prefetch import prefetch_batch
from .runtime import Runtime
from .slots import SlotHistory, StepLayout
from ..models.vocab import unknown_inputs

# The engine's attention: attend(layer, q, k, v, layout) with q, k, v [n, h, e] -> [n, h, e]
PagedAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "StepLayout | None"],
                       torch.Tensor]


class PagedLM(nn.Module):
    """``PagedLM(runtime)``, or ``PagedLM(model, hasher, vocab, raw_vocab_size)`` from parts."""

    def __init__(self, lm: Runtime | EngramLM, hasher: NgramHasher | None = None,
                 vocab: torch.Tensor | None = None, raw_vocab_size: int | None = None):
        super().__init__()
        rt = lm if isinstance(lm, Runtime) else Runtime.from_parts(lm, hasher, vocab,
                                                                    raw_vocab_size)
        self.runtime = rt
        self.lm, self.hasher = rt.model, rt.hasher
        self.tokens = SlotHistory(None, torch.long, fill=-1)  # raw id per slot (DEAD if unset)
        self.conv = {i: SlotHistory(e.hc_mult * e.hidden_size, torch.float32)
                     for i, e in self.lm.engrams().items() if e.short_conv is not None}

    def ensure_slots(self, num_slots: int) -> None:
        """Size the history to the engine's KV cache (once it exists)."""
        self.tokens.ensure(num_slots)
        for hist in self.conv.values():
            hist.ensure(num_slots)

    # -- one engine step ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, raw: torch.Tensor, positions: torch.Tensor, layout: StepLayout | None,
                attend: PagedAttend) -> torch.Tensor:
        """raw ids [n], positions [n] -> final hidden [n, d]. ``layout`` None (an engine's dummy
        or profiling run): every token is its own one-token request and no history is kept."""
        lm = self.lm
        ids = self.hash(raw, layout)  # {layer: [n, H]}
        if ids:
            prefetch_batch(lm, {k: v[None] for k, v in ids.items()})  # [1, n, H]: all layers now
        cos, sin = lm.rope_cos[positions], lm.rope_sin[positions]  # [n, e/2]

        def attention(i: int) -> Attend:  # the engine's paged attention in the model's block
            return lambda q, k, v: attend(i, q[0], k[0], v[0], layout)[None]  # [1, n, h, e]

        def memory(i: int) -> Memory:  # Engram per request group, its conv context from the slots
            return lambda engram, h: (self._engram(i, engram, h[0], ids[i], layout)[None], None)

        local, unknown = self.runtime.local_ids(raw)
        with unknown_inputs(lm, unknown[None]):  # the runtime's policy for unseen ids
            hidden, _, _ = lm.trunk(local[None], cos, sin, attention, memory)  # [1, n, d]
        return hidden[0]

    def embed(self, raw: torch.Tensor) -> torch.Tensor:
        """Input embeddings [n, d] of raw ids [n] (unseen ids: the mean embedding)."""
        local, unknown = self.runtime.local_ids(raw)
        with unknown_inputs(self.lm, unknown):
            return self.lm.embed(local)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [k, d] -> logits over the tokenizer's ids [k, W] (-inf where unseen)."""
        return self.runtime.raw_logits(hidden)

    # -- pieces ------------------------------------------------------------------------------------
    def hash(self, raw: torch.Tensor, layout: StepLayout | None) -> dict[int, torch.Tensor]:
        """Each token's row ids from its own request's last N tokens: {layer: [n, H]}."""
        if self.hasher is None:
            return {}
        depth = self.hasher.config.max_ngram_size - 1
        raw = raw.long()
        if layout is None:
            past = raw.new_full((raw.numel(), depth), -1)  # DEAD: a sequence start
        else:
            self.tokens.write(layout.slot_mapping, raw)  # this step's ids first: chunks look back
            past = self.tokens.read(layout.slots_before_tokens(depth))  # [n, N-1]
        windows = torch.cat([past, raw[:, None]], dim=1)  # [n, N]
        return {k: v[:, -1] for k, v in self.hasher.hash(windows).items()}  # last position

    def _engram(self, i: int, engram: Engram, h: torch.Tensor, ids: torch.Tensor,
                layout: StepLayout | None) -> torch.Tensor:
        """h [n, (m,) d] -> Y [n, (m,) d]; the conv runs per request, from its slots."""
        memory = engram.read(ids[None])[0]  # [n, c]
        conv = engram.short_conv
        if layout is None:  # one-token requests, no past
            return engram(h[:, None], memory=memory[:, None])[:, 0]
        out = torch.empty_like(h)
        context = None if conv is None else layout.slots_before_requests(conv.context)  # [R, ctx]
        for idx, rows, t in layout.groups():
            b = idx.numel() // t
            state = None
            if conv is not None:
                state = EngramState(conv=self.conv[i].read(context[rows]).to(h.dtype),
                                    keep_inputs=True)  # [b, ctx, m*d]
            y = engram(h[idx].reshape(b, t, *h.shape[1:]), memory=memory[idx].reshape(b, t, -1),
                       state=state)
            out[idx] = y.reshape(idx.numel(), *h.shape[1:])
            if state is not None:
                self.conv[i].write(layout.slot_mapping[idx], state.inputs.reshape(idx.numel(), -1))
        return out
