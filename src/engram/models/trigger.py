"""Trigger-indexed concept tables (Tiny-Engram, arXiv 2605.20309): keys, matching, the tables.

A concept is bound to a rare trigger phrase ("Zorblax"). Its keys are the trigger's token n-grams
of orders 2..N plus the whole trigger (a one-token trigger has the one key). Matching runs on token
ids only, before the encoder runs (house style: addresses come from ids, never from hidden states),
and is vectorised over batch x positions: one comparison per key length, no loop over positions.
A position is *matched* when it lies inside a matched key span; only matched positions ever receive
a residual, so a prompt without the trigger is untouched by construction.

Two tables:
- ``plain``: the paper's recipe, one learned vector per key, averaged over the keys whose span covers
  the position (overlapping matches are normalised by their count), times a learned per-dimension
  scale, optionally tanh-gated;
- ``engram``: the Engram fusion of ``engram.module`` (paper section 2.3) over the same keys: each
  key holds a small memory vector, the encoder's hidden state gates it (context-aware, eq. 4) and a
  short causal conv runs over the matched span only.

Shape legend: b batch, t positions, K keys, n key length, W = t - n + 1 windows, d encoder hidden
size, c memory width of the engram table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..module import Engram
from .hf import zero_value

KINDS = ("plain", "engram")


@dataclass
class TriggerOptions:
    # "plain" (one vector per key times a per-dimension scale, the paper's) or "engram" (gate + conv).
    kind: str = "plain"
    # Keys are the trigger's n-grams of orders 2..max_order plus the whole trigger.
    max_order: int = 3
    # Where the residual goes: "last" (last_hidden_state), "hidden:-2" (that entry of hidden_states;
    # SD3's CLIP encoders read it), or "layer:I" (after encoder layer I, feeding later layers).
    site: str = "last"
    # Plain table: multiply by tanh(g), g a learned scalar starting at 1.
    tanh_gate: bool = False
    # Engram table: width of each key's memory vector.
    d_mem: int = 32
    # Engram table: short conv kernel over the matched span; 0 drops the conv.
    kernel_size: int = 4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.max_order < 2:
            raise ValueError(f"max_order must be at least 2, got {self.max_order}")
        if not (self.site in ("last", "hidden:-2") or self.site.startswith("layer:")):
            raise ValueError(f"site must be 'last', 'hidden:-2' or 'layer:I', got {self.site!r}")
        if self.site.startswith("layer:") and not self.site[6:].lstrip("-").isdigit():
            raise ValueError(f"site {self.site!r}: the layer index must be an integer")
        if self.d_mem <= 0 or self.kernel_size < 0:
            raise ValueError("d_mem must be positive and kernel_size >= 0")


def trigger_ids(tokenizer: Any, trigger: str) -> list[int]:
    """The trigger's ids as they appear inside a prompt (no special tokens); bad input is refused."""
    if not isinstance(trigger, str):
        raise TypeError(f"a trigger must be a string, got {type(trigger).__name__}")
    if not trigger.strip():
        raise ValueError(f"empty trigger {trigger!r}")
    ids = list(tokenizer(trigger, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"trigger {trigger!r} tokenises to nothing with this tokenizer")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        raise ValueError(f"trigger {trigger!r} contains tokens unknown to this tokenizer (ids {ids}): "
                         "it would match every other unknown word")
    return ids


def trigger_keys(ids: Sequence[int], max_order: int) -> list[tuple[int, ...]]:
    """n-grams of orders 2..max_order, then the whole trigger; each key once, in first-seen order."""
    ids = tuple(int(i) for i in ids)
    keys = [ids[s:s + n] for n in range(2, min(max_order, len(ids)) + 1)
            for s in range(len(ids) - n + 1)]
    keys.append(ids)
    return list(dict.fromkeys(keys))


def build_keys(tokenizer: Any, triggers: Sequence[str], max_order: int
               ) -> tuple[list[tuple[int, ...]], list[int]]:
    """(keys, owner trigger index per key). Each trigger owns its keys; a repeated trigger is refused."""
    if isinstance(triggers, str) or not triggers:
        raise ValueError("triggers must be a non-empty list of strings")
    if len(set(triggers)) != len(triggers):
        raise ValueError(f"repeated trigger in {list(triggers)}")
    keys, owner = [], []
    for i, trig in enumerate(triggers):
        for k in trigger_keys(trigger_ids(tokenizer, trig), max_order):
            keys.append(k)
            owner.append(i)
    return keys, owner


class TriggerMatcher:
    """Token ids [b, t] (+ attention mask) -> which keys cover each position, [b, t, K] bool."""

    def __init__(self, keys: Sequence[tuple[int, ...]]):
        self.num_keys = len(keys)
        by_len: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by_len.setdefault(len(k), []).append(i)
        # {n: (keys of length n [K_n, n], their indices among all keys [K_n])}
        self.groups = {n: (torch.tensor([keys[i] for i in idx], dtype=torch.long),
                           torch.tensor(idx, dtype=torch.long)) for n, idx in by_len.items()}

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an integer [batch, seq] tensor, got "
                             f"{ids.dtype} {tuple(ids.shape)}")
        b, t = ids.shape
        alive = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        out = torch.zeros(b, t, self.num_keys, dtype=torch.bool, device=ids.device)
        for n, (keys, index) in self.groups.items():  # one pass per key length
            if t < n:  # a prompt truncated shorter than the key: only shorter keys can match
                continue
            keys, index = keys.to(ids.device), index.to(ids.device)
            win = ids.unfold(1, n, 1)  # [b, W, n]
            # A window touching padding never matches, whatever ids the padding carries.
            ok = alive.unfold(1, n, 1).all(-1)  # [b, W]
            hit = (win[:, :, None, :] == keys[None, None]).all(-1) & ok[..., None]  # [b, W, K_n]
            cover = torch.zeros(b, t, len(index), dtype=torch.bool, device=ids.device)
            w = t - n + 1
            for j in range(n):  # a hit at window s covers positions s..s+n-1
                cover[:, j:j + w] |= hit
            out[:, :, index] = cover
        return out


class TriggerTable(nn.Module):
    """The learned part: key rows -> residual [b, t, d] for the matched positions."""

    def __init__(self, num_keys: int, hidden_size: int, kind: str = "plain", tanh_gate: bool = False,
                 d_mem: int = 32, kernel_size: int = 4):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.tanh_gate, self.hidden_size = kind, tanh_gate, hidden_size
        if kind == "plain":
            self.values = nn.Parameter(torch.empty(num_keys, hidden_size))
            self.scale = nn.Parameter(torch.empty(hidden_size))
            if tanh_gate:
                self.gate = nn.Parameter(torch.empty(()))
        else:
            self.memory = nn.Parameter(torch.empty(num_keys, d_mem))
            # No table inside: the rows are ours and come in as memory=; dilation 1 because the
            # span is a handful of tokens (the LM paper's dilation N spans whole n-grams).
            self.engram = Engram(None, None, d_mem, hidden_size, gate="paper",
                                 kernel_size=kernel_size, dilation=1, conv_init="zero")
        self.init_weights()

    def init_weights(self) -> None:
        """Everything starts at a zero residual, so a new table changes nothing until trained."""
        with torch.no_grad():
            if self.kind == "plain":
                self.values.zero_()  # zero rows with a unit scale: the rows get gradient at once
                self.scale.fill_(1.0)
                if self.tanh_gate:
                    self.gate.fill_(1.0)
            else:
                self.memory.normal_(0.0, 1.0)
                self.engram.init_weights()
                zero_value(self.engram)  # LoRA-style: value projection 0, keys and gate live

    def forward(self, hidden: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
        """hidden [b, t, d], member [b, t, K] bool -> residual [b, t, d], zero off the matches."""
        m = member.to(hidden.dtype)  # [b, t, K]
        count = m.sum(-1, keepdim=True).clamp_min(1.0)  # [b, t, 1]
        rows = self.values if self.kind == "plain" else self.memory
        e = (m @ rows.to(hidden.dtype)) / count  # [b, t, d] or [b, t, c]
        alive = member.any(-1)  # [b, t]
        if self.kind == "plain":
            y = e * self.scale
            if self.tanh_gate:
                y = y * torch.tanh(self.gate)
        else:
            # The conv runs over the span only: positions outside it feed zeros.
            y = self.engram(hidden, memory=e, alive=alive)  # [b, t, d]
        return y * alive[..., None].to(y.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, hidden={self.hidden_size}, tanh_gate={self.tanh_gate}"


def build_table(num_keys: int, hidden_size: int, options: TriggerOptions) -> TriggerTable:
    return TriggerTable(num_keys, hidden_size, options.kind, options.tanh_gate, options.d_mem,
                        options.kernel_size)


__all__ = ["KINDS", "TriggerMatcher", "TriggerOptions", "TriggerTable", "build_keys", "build_table",
           "trigger_ids", "trigger_keys"]
