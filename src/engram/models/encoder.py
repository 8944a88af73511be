"""Trigger tables inside a frozen Hugging Face text encoder (CLIP text, T5 encoder, BERT-style).

``inject_triggers(encoder, tokenizer, ["Zorblax"])`` adds hooks, so the encoder keeps its class,
its forward and its state dict (as ``engram.models.hf`` does for LMs):

- a pre-hook on the encoder reads ``input_ids`` and ``attention_mask`` and matches the trigger keys
  (token ids only, outside the encoder's tensor path);
- a hook at the chosen site adds the table's residual at matched positions only: on the returned
  ``last_hidden_state`` ("last", SD1.5's CLIP, T5), on one entry of ``hidden_states`` ("hidden:-2",
  SD3's CLIP encoders; the pooled output stays untouched there, as in the paper), or on the output of
  one encoder layer ("layer:I"), which the later layers then read.

Where nothing matches, the hook returns the encoder's own tensor object, so prompts without a
trigger give bit-identical outputs. The tables are not registered under the encoder: its
``named_parameters`` and fingerprint stay the base model's. ``save_triggers``/``load_triggers``
write and read a small safetensors adapter carrying the encoder's and tokenizer's fingerprints
(the helpers of ``engram.models.adapter``); a mismatch is refused naming what differs.

Shape legend: b batch, t positions, K keys, d hidden size.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..files import publish
from ..retrieval.compress import tokenizer_fingerprint
from .adapter import AdapterMismatch, _check_base, _diff, base_fingerprint
from .trigger import TriggerMatcher, TriggerOptions, build_keys, build_table

FORMAT = "engram-trigger-adapter-1"
WEIGHTS = "triggers.safetensors"
_LAYER_LISTS = ("encoder.layers", "encoder.layer", "encoder.block")  # CLIP, BERT, T5


def encoder_layers(encoder: nn.Module) -> nn.ModuleList:
    for name, mod in encoder.named_modules():
        if isinstance(mod, nn.ModuleList) and name.endswith(_LAYER_LISTS):
            return mod
    raise TypeError(f"{type(encoder).__name__}: no encoder layer list found (looked for "
                    f"{', '.join(_LAYER_LISTS)})")


def hidden_size(encoder: nn.Module) -> int:
    cfg = encoder.config
    return int(getattr(cfg, "hidden_size", None) or cfg.d_model)


class TriggerRuntime:
    """The triggers, keys, matcher, table and hooks attached to one text encoder."""

    def __init__(self, encoder: nn.Module, tokenizer: Any, triggers: Sequence[str],
                 options: TriggerOptions):
        self.encoder, self.tokenizer, self.options = encoder, tokenizer, options
        self.triggers = list(triggers)
        self.keys, self.owner = build_keys(tokenizer, self.triggers, options.max_order)
        self.matcher = TriggerMatcher(self.keys)
        ref = next(encoder.parameters())
        self.table = build_table(len(self.keys), hidden_size(encoder), options).to(ref.device)
        self._member: torch.Tensor | None = None
        self._handles: list[Any] = []
        self.last_member: torch.Tensor | None = None  # the last call's matches, for inspection

    def attach(self) -> None:
        site = self.options.site
        self._handles.append(self.encoder.register_forward_pre_hook(self._match, with_kwargs=True))
        if site.startswith("layer:"):
            layers = encoder_layers(self.encoder)
            i = int(site[6:])
            if not -len(layers) <= i < len(layers):
                raise ValueError(f"site {site!r}: the encoder has {len(layers)} layers")
            self._handles.append(layers[i].register_forward_hook(self._layer_out))
        self._handles.append(self.encoder.register_forward_hook(self._encoder_out))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.table.parameters())

    # -- hooks ------------------------------------------------------------------------------------
    def _match(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is None:
            raise ValueError("a text encoder with trigger tables needs input_ids: triggers are "
                             "matched on token ids (inputs_embeds alone cannot be matched)")
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        with torch.no_grad():
            member = self.matcher(ids, mask)  # [b, t, K]
        self.last_member = member
        self._member = member if bool(member.any()) else None

    def _add(self, h: torch.Tensor) -> torch.Tensor:
        member = self._member
        if member is None:
            return h  # nothing matched: the encoder's own tensor, bit for bit
        y = self.table(h, member.to(h.device))  # [b, t, d]
        return torch.where(member.any(-1, keepdim=True).to(h.device), h + y, h)

    def _layer_out(self, module: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            return self._add(output)
        return (self._add(output[0]), *output[1:])

    def _encoder_out(self, module: nn.Module, args: tuple, output: Any):
        member, self._member = self._member, None
        if member is None or self.options.site.startswith("layer:"):
            return None
        self._member = member
        try:
            if self.options.site == "last":
                if isinstance(output, tuple):
                    return (self._add(output[0]), *output[1:])
                output["last_hidden_state"] = self._add(output["last_hidden_state"])
                return output
            hs = None if isinstance(output, tuple) else output.get("hidden_states")
            if hs is None:
                raise ValueError("site 'hidden:-2' needs hidden_states: call the encoder with "
                                 "output_hidden_states=True and return_dict=True")
            output["hidden_states"] = (*hs[:-2], self._add(hs[-2]), hs[-1])
            return output
        finally:
            self._member = None

    def describe(self) -> dict[str, Any]:
        return {"triggers": self.triggers, "keys": [list(k) for k in self.keys], "owner": self.owner,
                "options": asdict(self.options), "encoder_class": type(self.encoder).__name__,
                "parameters": sum(p.numel() for p in self.parameters())}


# -- public API -----------------------------------------------------------------------------------

def inject_triggers(encoder: nn.Module, tokenizer: Any, triggers: Sequence[str],
                    options: TriggerOptions | None = None, **option_fields: Any) -> TriggerRuntime:
    """Attach trigger tables to ``encoder`` (frozen: its weights stop taking gradients)."""
    if trigger_runtime(encoder, required=False) is not None:
        raise ValueError("this encoder already has trigger tables; eject_triggers(encoder) first")
    opts = options if options is not None else TriggerOptions(**option_fields)
    return _install(encoder, TriggerRuntime(encoder, tokenizer, triggers, opts))


def _install(encoder: nn.Module, rt: TriggerRuntime) -> TriggerRuntime:
    rt.attach()
    encoder.requires_grad_(False)
    encoder.__dict__["trigger_runtime"] = rt  # not a submodule: state dict and fingerprint unchanged
    return rt


def eject_triggers(encoder: nn.Module) -> nn.Module:
    """Remove the hooks; the encoder is as it was (it stays frozen)."""
    trigger_runtime(encoder).detach()
    encoder.__dict__.pop("trigger_runtime")
    return encoder


def trigger_runtime(encoder: nn.Module, required: bool = True) -> TriggerRuntime | None:
    if required and "trigger_runtime" not in encoder.__dict__:
        raise ValueError(f"{type(encoder).__name__} has no trigger tables (call inject_triggers)")
    return encoder.__dict__.get("trigger_runtime")


def save_triggers(encoder: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``triggers.safetensors`` (table tensors + JSON header with both fingerprints)."""
    rt = trigger_runtime(encoder)
    meta = {"format": FORMAT, **rt.describe(), "base": base_fingerprint(encoder),
            "tokenizer": tokenizer_fingerprint(rt.tokenizer)}
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in rt.table.state_dict().items()}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    publish(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"triggers": json.dumps(meta)}))
    return out / WEIGHTS


def load_triggers(encoder: nn.Module, tokenizer: Any, directory: str | os.PathLike,
                  check_base: bool = True) -> TriggerRuntime:
    """Inject the saved tables into ``encoder``; every check runs before the encoder is touched."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"no trigger adapter at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("triggers", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        raise AdapterMismatch(f"{path} is not a trigger adapter of format {FORMAT}")
    if check_base:
        _check_base(meta["base"], base_fingerprint(encoder))
    got = tokenizer_fingerprint(tokenizer)
    if got != meta["tokenizer"]:
        raise AdapterMismatch(f"the adapter was trained with another tokenizer (fingerprint "
                              f"{meta['tokenizer']}, this one {got}): its keys are that "
                              "tokenizer's ids")
    opts = TriggerOptions(**meta["options"])
    keys, _ = build_keys(tokenizer, meta["triggers"], opts.max_order)
    if [list(k) for k in keys] != meta["keys"]:
        raise AdapterMismatch("the triggers tokenise to other keys with this tokenizer")
    rt = TriggerRuntime(encoder, tokenizer, meta["triggers"], opts)
    expected = rt.table.state_dict()
    if set(expected) != set(tensors) or any(expected[k].shape != tensors[k].shape for k in tensors):
        raise AdapterMismatch("adapter tensors do not fit: " + _diff(
            {k: tuple(v.shape) for k, v in tensors.items()},
            {k: tuple(v.shape) for k, v in expected.items()}))
    rt.table.load_state_dict(tensors)
    if trigger_runtime(encoder, required=False) is not None:
        eject_triggers(encoder)
    return _install(encoder, rt)


__all__ = ["TriggerRuntime", "eject_triggers", "encoder_layers", "inject_triggers", "load_triggers",
           "save_triggers", "trigger_runtime"]
