"""Engram adapters: the trained memory of an injected HF model as one small safetensors file.

``save_engram(model, dir)`` writes ``engram.safetensors`` (every Engram tensor, under
``layers.<id>.<name>``) with a JSON header entry holding the Engram config, the injection options
and two fingerprints, and the same JSON as ``engram_config.json`` for people to read:

- the base model: its class, its architecture fields and a hash of a fixed sample of every base
  weight (64 evenly spaced values per tensor, cast to float32), cheap on any model size and
  different for any other checkpoint, dtype or quantisation;
- the tokenizer: ``engram.retrieval.compress.tokenizer_fingerprint`` (the hash of its full serialisation),
  because the tables are indexed by n-grams of *that* tokenizer's compressed ids.

``load_engram`` refuses an adapter made on another base model, tokenizer or config, naming what
differs: the rows would load without error and mean nothing.

A self-contained adapter (``engram finetune``'s output) also names its base model (``base_model``:
a packaged name or a folder, models/pretrained.py) and holds the tokenizer (``tokenizer.json``),
its compression map (``compression.npy``) and the end-of-text id, so ``from_pretrained``
loads base + Engram from the folder alone, and ``engram.open`` serves it
(models/injected.py, serving/loader.py open_adapter).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import InputNotFound, UserError
from ..files import publish, publish_bytes, publish_text
from ..retrieval.compress import Compression, build_compression, tokenizer_fingerprint
from ..retrieval.config import EngramConfig
from .hf import InjectOptions, engram_runtime, inject

FORMAT = "engram-hf-adapter-1"
WEIGHTS = "engram.safetensors"
META = "engram_config.json"
TOKENIZER = "tokenizer.json"
COMPRESSION = "compression.npy"
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


def save_engram(model: nn.Module, directory: str | os.PathLike, *, base_model: str | None = None,
                tokenizer: Any = None, eos_id: int | None = None,
                base: dict[str, Any] | None = None) -> Path:
    """Write the adapter into ``directory`` (created if needed); returns the weights path.

    ``base_model`` (a packaged name or folder), ``tokenizer`` (a tokenizers.Tokenizer, the one
    the compression was built from) and ``eos_id`` make it self-contained (``from_pretrained``);
    ``base``: the base fingerprint when the caller has it already (it reads every weight)."""
    rt = engram_runtime(model)
    meta = {"format": FORMAT, "config": rt.config.to_dict(),
            "options": {"gate": rt.options.gate, "conv": rt.options.conv},
            "base": base if base is not None else base_fingerprint(model),
            "tokenizer": compression_fingerprint(rt.compression),
            "compressed_vocab": len(rt.compression)}
    if base_model is not None:
        meta["base_model"] = base_model
    if eos_id is not None:
        meta["eos_id"] = int(eos_id)
    tensors = engram_state_dict(model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        if tokenizer_fingerprint(tokenizer) != meta["tokenizer"]:
            raise ValueError("the tokenizer given is not the one the injected compression was "
                             "built from")
        publish_text(out / TOKENIZER, tokenizer.to_str())
        publish_bytes(out / COMPRESSION, lambda f: np.save(f, rt.compression.lookup))
    text = json.dumps(meta, sort_keys=True)
    publish(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"engram": text}))
    publish_text(out / META, json.dumps(meta, indent=2, sort_keys=True))
    return out / WEIGHTS


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise InputNotFound(f"no Engram adapter at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("engram", "{}"))
    if meta.get("format") != FORMAT:
        raise AdapterMismatch(f"{path} is not an Engram adapter of format {FORMAT} "
                              f"(found {meta.get('format')!r})")
    return meta


def load_engram(model: nn.Module, directory: str | os.PathLike, tokenizer: Any = None, *,
                compression: Compression | None = None, check_base: bool = True) -> nn.Module:
    """Load an adapter onto ``model``: injects it first when the model has no Engram yet.

    A model without Engram needs its ``tokenizer`` (or ``compression``). Every check runs before
    the model is touched, so a refused adapter leaves the model as it was.
    """
    meta = read_meta(directory)
    config = EngramConfig.from_dict(meta["config"])
    if check_base:
        _check_base(meta["base"], base_fingerprint(model))
    rt = engram_runtime(model, required=False)
    if rt is not None:
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
    tensors = _read_tensors(Path(directory) / WEIGHTS)
    if rt is None:
        inject(model, config, compression=compression,
               options=InjectOptions(**meta["options"]))
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


def is_adapter(directory: str | os.PathLike) -> bool:
    return (Path(directory) / WEIGHTS).is_file()


def adapter_tokenizer(directory: str | os.PathLike) -> tuple[Any, Compression]:
    """(tokenizers.Tokenizer, its compression map) a self-contained adapter holds."""
    from tokenizers import Tokenizer

    d = Path(directory)
    if not (d / TOKENIZER).is_file() or not (d / COMPRESSION).is_file():
        raise InputNotFound(f"{d} holds no {TOKENIZER} and {COMPRESSION}: an adapter written by "
                            "save_engram without its tokenizer (load it with load_engram)")
    tok = Tokenizer.from_file(str(d / TOKENIZER))
    lookup = np.load(d / COMPRESSION, allow_pickle=False)
    return tok, Compression(lookup, fingerprint=tokenizer_fingerprint(tok))


def from_pretrained(directory: str | os.PathLike, base: str | None = None,
                    device: str | None = None) -> tuple[nn.Module, Any]:
    """Open an ``engram finetune`` adapter folder (public as ``engram.load_adapter``): returns
    (the base transformers model with the adapter's Engram injected and loaded, its tokenizer as
    a transformers ``PreTrainedTokenizerFast``). The model is the base model's own class, with its
    usual ``generate``; greedy tokens equal ``engram generate``'s on the folder.

    ``base``: the base model's folder or packaged name (default: the one the adapter names); it
    must be the model the adapter was trained on (else ``AdapterMismatch``, one line).
    ``device``: where to move the model (default: where it loads, the CPU)."""
    from transformers import PreTrainedTokenizerFast

    from .pretrained import load_pretrained

    meta = read_meta(directory)
    name = base if base is not None else meta.get("base_model")
    if name is None:
        raise UserError(f"{directory} names no base model: pass base=")
    tok, comp = adapter_tokenizer(directory)
    model, _ = load_pretrained(name, tokenizer=False)
    if device is not None:
        model.to(device)
    load_engram(model, directory, compression=comp)
    eos = meta.get("eos_id")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, **({"eos_token": tok.id_to_token(eos)} if eos is not None else {}))
    return model, hf_tok


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


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


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


__all__ = ["AdapterMismatch", "adapter_tokenizer", "base_fingerprint", "compression_fingerprint",
           "engram_state_dict", "from_pretrained", "is_adapter", "load_engram",
           "load_engram_state_dict", "read_meta", "save_engram"]
