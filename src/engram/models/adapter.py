"""Engram adapters on a model: the model side of an adapter folder (artifacts/adapter.py owns the
files: ``save_engram``, ``read``, ``load_engram``, ``from_pretrained``).

An adapter's header holds the Engram config, the injection options and two fingerprints:

- the base model: its class, its architecture fields and a hash of a fixed sample of every base
  weight (64 evenly spaced values per tensor, cast to float32), cheap on any model size and
  different for any other checkpoint, dtype or quantisation;
- the tokenizer: ``engram.retrieval.compress.tokenizer_fingerprint`` (the hash of its full serialisation),
  because the tables are indexed by n-grams of *that* tokenizer's compressed ids.

``attach`` refuses an adapter made on another base model, tokenizer or config, naming what
differs: the rows would load without error and mean nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..retrieval.compress import Compression, build_compression
from ..retrieval.config import EngramConfig
from .hf import InjectOptions, engram_runtime, inject

# Config fields that fix the architecture; names differ by family, absent ones are skipped.
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
              "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "n_inner",
              "head_dim", "max_position_embeddings", "n_positions", "tie_word_embeddings")
_SAMPLES = 64


class AdapterMismatch(UserError):
    """The adapter was made for another base model, tokenizer or Engram config."""


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Class, architecture fields and a weight-sample hash of the model without its Engram."""
    rt = engram_runtime(model, required=False)
    mine = {id(p) for p in rt.engram_parameters()} if rt is not None else set()
    cfg = model.config.to_dict()
    h = hashlib.sha256()
    n = 0
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if id(p) in mine:
            continue
        flat = p.detach().reshape(-1)
        # float32 positions round the last one up past the end from 2**24 values on (SmolLM2's
        # embedding): clamp, which keeps every fingerprint that could be computed before.
        idx = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel()),
                             device=flat.device).long().clamp_(max=flat.numel() - 1)
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
        n += 1
    return {"class": type(model).__name__,
            "config": {k: cfg[k] for k in _ARCH_KEYS if k in cfg},
            "weights": h.hexdigest()[:32], "tensors": n}


def compression_fingerprint(compression: Compression) -> str:
    """The tokenizer's fingerprint; a map built from a bare array is identified by its content."""
    if compression.fingerprint is not None:
        return compression.fingerprint
    return "lookup:" + hashlib.sha256(compression.lookup.tobytes()).hexdigest()[:32]


def attach(model: nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
           tokenizer: Any = None, *, compression: Compression | None = None,
           check_base: bool = True, tables: dict[int, Any] | None = None) -> nn.Module:
    """Put an adapter (its header ``meta`` and ``tensors``, as artifacts/adapter.py reads them)
    into ``model``: injects it first when the model has no Engram yet. ``tables``: {layer: store}
    of its rows on a tier (its table files), injected as they are; ``tensors`` then leaves out
    those layers' tables.

    A model without Engram needs its ``tokenizer`` (or ``compression``). Every check runs before
    the model is touched, so a refused adapter leaves the model as it was.
    """
    config = EngramConfig.from_dict(meta["config"])
    if check_base:
        _check_base(meta["base"], base_fingerprint(model))
    rt = engram_runtime(model, required=False)
    if rt is not None:
        if tables:
            raise ValueError("tables= goes with a model that has no Engram yet (they are injected)")
        compression = rt.compression
        if rt.config.to_dict() != config.to_dict() or rt.options.structural() != meta["options"]:
            raise AdapterMismatch(
                "the adapter's Engram config differs from the one injected in the model: "
                + _diff({**config.to_dict(), **meta["options"]},
                        {**rt.config.to_dict(), **rt.options.structural()}))
    elif compression is None:
        if tokenizer is None:
            raise ValueError("this model has no Engram yet: pass the tokenizer the adapter was "
                             "trained with (tokenizer=...) so its ids can be hashed")
        compression = build_compression(tokenizer)
    got = compression_fingerprint(compression)
    if got != meta["tokenizer"]:
        raise AdapterMismatch(f"the adapter was trained with another tokenizer (fingerprint "
                              f"{meta['tokenizer']}, this one {got}): its rows are indexed by that "
                              "tokenizer's n-grams")
    if rt is None:
        inject(model, config, compression=compression,
               options=InjectOptions(**meta["options"]), tables=tables)
        rt = engram_runtime(model)
    _copy_in(rt.engrams, tensors)
    return model


def engram_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every Engram tensor of an injected model (CPU copies), as the adapter file keys them."""
    return {f"layers.{lid}.{k}": v.detach().cpu().contiguous().clone()
            for lid, eng in engram_runtime(model).engrams.items()
            for k, v in eng.state_dict().items()}


def load_engram_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``engram_state_dict``'s tensors back (AdapterMismatch if they do not fit)."""
    _copy_in(engram_runtime(model).engrams, tensors)


def _copy_in(engrams: dict[int, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    expected = {f"layers.{lid}.{k}": v for lid, e in engrams.items() for k, v in e.state_dict().items()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise AdapterMismatch(f"adapter tensors do not fit the model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise AdapterMismatch(f"{k}: adapter has {tuple(tensors[k].shape)}, model needs "
                                  f"{tuple(v.shape)}")
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(tensors[k])  # state_dict tensors share storage with the parameters


def _check_base(saved: dict[str, Any], current: dict[str, Any]) -> None:
    if saved["class"] != current["class"] or saved["config"] != current["config"]:
        raise AdapterMismatch(
            f"the adapter was trained on another base model ({saved['class']} vs {current['class']}"
            f"): {_diff(saved['config'], current['config']) or 'different class'}")
    if saved["weights"] != current["weights"]:
        raise AdapterMismatch(
            "the adapter was trained on another base model: same architecture but different "
            f"weights (fingerprint {saved['weights']} vs {current['weights']}; another checkpoint, "
            "dtype or quantisation). Pass check_base=False to load it anyway.")


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: adapter {a.get(k)!r} vs model {b.get(k)!r}"
                     for k in keys if a.get(k) != b.get(k))


__all__ = ["AdapterMismatch", "attach", "base_fingerprint", "compression_fingerprint",
           "engram_state_dict", "load_engram_state_dict"]
