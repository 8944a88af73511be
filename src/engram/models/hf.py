"""Engram inside a pretrained Hugging Face causal LM (Llama/Qwen/Mistral family, GPT-2).

``inject(model, config, tokenizer=tok)`` adds one ``Engram`` per chosen decoder layer and two
kinds of forward hooks, so the model keeps its class, its ``forward``/``generate`` API and its
state-dict keys:

- a pre-hook on the decoder stack (``LlamaModel``, ``GPT2Model``) reads ``input_ids`` and the 2-D
  ``attention_mask`` and computes the hash ids (spec 1; house style: hash ids come from token ids
  only, never from hidden states);
- a pre-hook on each chosen decoder layer adds the residual, ``H <- H + Y`` (spec 2.9).

Hooks, not wrapper modules: a wrapper would rename every weight of the layer (``layers.1.layer.*``),
so ``save_pretrained``/``from_pretrained`` and HF code that reads layer attributes
(``decoder_layer.attention_type``) would break. HF checkpoints ``forward`` and not ``__call__``
under gradient checkpointing, so the hooks also stay outside the checkpoint.

Cached generation keeps the n-gram history. The state a decode step needs (the last N-1 compressed
tokens of each row and each layer's conv context: the one decode state,
``models/cache.DecodeGroup``) lives beside the KV cache object it belongs to: a call with no cache
or an empty one starts a new sequence, a call with a cache continues the state saved for that very
cache, and anything else is refused instead of silently hashing without history. Beam search
reorders it through ``_reorder_cache``. Dead positions (attention mask 0, e.g. left padding) hash
like a sequence start and feed zeros to the short conv, so a left-padded row gets the same Engram
output as the unpadded row.

Identity at start: the value projection starts at zero (LoRA's B = 0), so
``Y = alpha * 0 + conv(0) = 0`` and the logits equal the base model's; its gradient (which sees e
and alpha) is not zero, so the first step moves it and the tables, keys and conv follow from the
second step on.

Shape legend: b batch, t new positions of this call, d hidden size, H hash heads per layer.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import UserError
from ..module import Engram, EngramState, build_engram
from ..retrieval.compress import Compression, build_compression
from ..retrieval.config import EngramConfig
from ..retrieval.hashing import NgramHasher
from .cache import DecodeGroup, InjectedCache

# -- per-family adapters: where the decoder stack and its layers are ------------------------------

def _llama_like(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, int]:
    base = model.model if hasattr(model, "model") else model  # *ForCausalLM or the bare *Model
    return base, base.layers, model.config.hidden_size


def _gpt2(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, int]:
    base = model.transformer if hasattr(model, "transformer") else model
    return base, base.h, model.config.n_embd


ADAPTERS: dict[str, Callable[[nn.Module], tuple[nn.Module, nn.ModuleList, int]]] = {
    **{f"{fam}{kind}": _llama_like for fam in ("Llama", "Mistral", "Qwen2", "Qwen3")
       for kind in ("ForCausalLM", "Model")},
    "GPT2LMHeadModel": _gpt2, "GPT2Model": _gpt2,
}


def decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, int]:
    """(decoder stack module, its decoder layers, hidden size), found by the model's class."""
    for cls in type(model).__mro__:  # a subclass of a supported class is supported too
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__](model)
    raise TypeError(f"engram.models.hf does not support {type(model).__name__}; supported classes: "
                    f"{', '.join(sorted(ADAPTERS))}")


# -- options and per-sequence state ---------------------------------------------------------------

@dataclass
class InjectOptions:
    # Gate: "paper" or "demo"; None takes the profile's default.
    gate: str | None = None
    # Short conv on or off; None takes the profile's default (on for demo-v1, off for v4.1).
    conv: bool | None = None
    # Table init std; small so a row's first updates (RowAdam at 5x lr) are large relative to it.
    init_std: float = 0.02
    # Sparse row gradients for the tables (RowAdam needs them).
    sparse: bool = True

    def structural(self) -> dict[str, Any]:
        """The fields that change the function, which an adapter must match."""
        return {"gate": self.gate, "conv": self.conv}


@dataclass
class _Call:
    """What the layer hooks need during one forward of the decoder stack."""
    ids: dict[int, torch.Tensor]  # {layer: [b, t, H]}
    alive: torch.Tensor | None  # [b, t] bool, None when every position is alive
    convs: dict[int, EngramState] | None  # None: no cache, no state kept
    pending: DecodeGroup | None = None  # a state to bind to the cache the forward creates


class EngramRuntime:
    """Everything ``inject`` attached: hasher, modules, hooks and the per-cache decode states."""

    def __init__(self, model: nn.Module, config: EngramConfig, compression: Compression,
                 options: InjectOptions, tables: dict[int, Any] | None = None):
        self.model, self.config, self.compression, self.options = model, config, compression, options
        self.tables = tables or {}  # {layer: a tier's store}; others get in-memory tables
        self.base, layers, self.hidden_size = decoder_stack(model)
        self.hasher = NgramHasher(config, compression)
        self.layers = {lid: layers[lid] for lid in config.layer_ids}
        self.engrams: dict[int, Engram] = {}
        self._handles: list[Any] = []
        self._states: dict[int, tuple[weakref.ref, DecodeGroup]] = {}  # id(cache) -> state
        self._call: _Call | None = None
        self._given: _Call | None = None
        self._signature = inspect.signature(self.base.forward)

    # -- hooks ------------------------------------------------------------------------------------
    def attach(self) -> None:
        ref = next(self.model.parameters())
        for lid, layer in self.layers.items():
            eng = build_engram(self.config, lid, self.hidden_size, gate=self.options.gate,
                               conv=self.options.conv, sparse=self.options.sparse,
                               init_std=self.options.init_std,
                               table=self.tables.get(lid, "memory"))
            zero_value(eng)
            eng.to(device=ref.device, dtype=ref.dtype)
            layer.engram = eng  # registered under the layer: base keys stay as they were
            self.engrams[lid] = eng
            self._handles.append(layer.register_forward_pre_hook(partial(self._layer_hook, lid),
                                                                 with_kwargs=True))
        self._handles.append(self.base.register_forward_pre_hook(self._stack_hook, with_kwargs=True))
        self._handles.append(self.base.register_forward_hook(self._stack_done, with_kwargs=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self.layers.values():
            del layer.engram
        self._states.clear()

    @contextmanager
    def given(self, ids: dict[int, torch.Tensor],
              convs: dict[int, EngramState] | None) -> Iterator[None]:
        """Inside the block the decoder stack uses these hash ids ({layer: [b, t, H]}) and conv
        states instead of hashing its input_ids: for a caller that hashes on its side and keeps
        the decode state in a cache of its own (the one runtime: models/injected.py)."""
        self._given = _Call(ids, None, convs)
        try:
            yield
        finally:
            self._given = None

    def _stack_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._given is not None:
            self._call = self._given
            return
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        ids = bound.get("input_ids")
        if ids is None:
            raise ValueError("an Engram-injected model needs input_ids: hash ids come from token ids "
                             "(inputs_embeds alone cannot be hashed)")
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got {tuple(ids.shape)}")
        b, t = ids.shape
        mask = bound.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise ValueError("Engram needs the 2-D attention mask (which positions are padding); "
                                 "got a prepared 4-D mask: use the default dynamic cache")
            mask = mask[:, -t:]  # generate passes the mask of past + new positions
        cache = bound.get("cache", bound.get("past_key_values", extra.get("past_key_values")))
        use_cache = bound.get("use_cache", extra.get("use_cache"))
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", False)
        alive = None if mask is None or bool(mask.all()) else mask.bool()

        state = None
        if cache is not None and cache.get_seq_length() > 0:
            state = self._lookup(cache)
            if state is None or state.cache.pos != cache.get_seq_length() or \
                    state.stream.history.shape[0] != b:
                raise RuntimeError(
                    f"this KV cache holds {cache.get_seq_length()} positions whose token history "
                    "Engram does not know (a cache made before inject(), or cropped, expanded or "
                    "reordered outside generate): rerun the prompt without a cache")
        elif cache is not None or use_cache:
            # The one decode state (models/cache.py); transformers holds the KV cache itself.
            state = DecodeGroup(list(range(b)), InjectedCache(
                None, {lid: EngramState() for lid in self.engrams}, 0, b),
                self.hasher.stream(b, ids.device))
        pending = None
        if state is None:
            hashed = self.hasher.hash(ids, mask)
        else:
            hashed = state.stream.step(ids, mask)
            state.cache.pos += t
            if cache is not None:
                self._bind(cache, state)
            else:
                pending = state  # the stack creates its cache inside forward: bind it afterwards
        self._call = _Call(hashed, alive, None if state is None else state.cache.engram, pending)

    def _stack_done(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call, self._call = self._call, None
        if call is not None and call.pending is not None:
            cache = _find_cache(output)
            if cache is not None:
                self._bind(cache, call.pending)

    def _layer_hook(self, layer_id: int, module: nn.Module, args: tuple, kwargs: dict):
        call = self._call
        if call is None:
            raise RuntimeError("an Engram decoder layer ran outside its model's forward; call the "
                               "model (or its decoder stack), not a layer alone")
        h = args[0] if args else kwargs["hidden_states"]  # [b, t, d]
        state = call.convs[layer_id] if call.convs is not None else None
        # Dead positions (padding) feed the conv zeros, what it sees before a sequence start.
        alive = None if call.alive is None else call.alive.to(h.device)
        y = self.engrams[layer_id](h, call.ids[layer_id].to(h.device), state=state,
                                   alive=alive)  # [b, t, d]
        if args:
            return (h + y, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h + y}

    # -- state per cache --------------------------------------------------------------------------
    def _bind(self, cache: Any, state: DecodeGroup) -> None:
        # Keyed by identity with a weak reference: a cache that is gone takes its state with it.
        for k in [k for k, (r, _) in self._states.items() if r() is None]:
            del self._states[k]
        self._states[id(cache)] = (weakref.ref(cache), state)

    def _lookup(self, cache: Any) -> DecodeGroup | None:
        entry = self._states.get(id(cache))
        return entry[1] if entry is not None and entry[0]() is cache else None

    def reorder_cache(self, cache: Any, beam_idx: torch.Tensor, inner: Callable | None = None):
        """generate()'s beam-search hook: reorder the KV cache and our state alike."""
        state = self._lookup(cache)
        if inner is not None:
            cache = inner(cache, beam_idx)
        else:
            cache.reorder_cache(beam_idx)
        if state is not None:
            state.keep(beam_idx)  # its n-gram history and conv contexts (kv: transformers')
            self._bind(cache, state)
        return cache

    # -- inspection -------------------------------------------------------------------------------
    def engram_parameters(self) -> list[nn.Parameter]:
        return [p for e in self.engrams.values() for p in e.parameters()]

    def describe(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "options": asdict(self.options),
                "model_class": type(self.model).__name__, "compressed_vocab": len(self.compression)}


def zero_value(engram: Engram) -> None:
    """Zero the value projection so the module's output starts at exactly zero (see the top)."""
    with torch.no_grad():
        if engram.fused:
            engram.kv_proj.weight[: engram.hidden_size].zero_()  # rows [0, d) make v
        else:
            engram.value_proj.weight.zero_()
            engram.value_proj.bias.zero_()


def _find_cache(output: Any) -> Any:
    from transformers.cache_utils import Cache

    values = output.values() if hasattr(output, "values") else output
    return next((v for v in values if isinstance(v, Cache)), None)


# -- public API -----------------------------------------------------------------------------------

def inject(model: nn.Module, config: EngramConfig, layer_ids: list[int] | None = None,
           tokenizer: Any = None, *, compression: Compression | None = None,
           options: InjectOptions | None = None, tables: dict[int, Any] | None = None,
           **option_fields: Any) -> nn.Module:
    """Add Engram to ``model`` in place and return it.

    ``config``: the retrieval config; ``layer_ids`` (if given) replaces ``config.layer_ids``.
    ``tokenizer``: the model's own tokenizer; its compression P feeds the hasher.
    ``compression``: a prebuilt ``Compression`` instead of ``tokenizer``.
    ``options`` or ``option_fields``: ``InjectOptions`` (gate, conv, init_std, sparse).
    ``tables``: {layer: store} rows already on a tier (an adapter's table files), so no table of
    those layers is allocated in memory.
    """
    if engram_runtime(model, required=False) is not None:
        raise ValueError("this model already has Engram injected; eject(model) first")
    base, layers, _ = decoder_stack(model)
    if layer_ids is not None:
        config = config.replace(layer_ids=list(layer_ids))
    bad = [i for i in config.layer_ids if i >= len(layers)]
    if bad:
        raise UserError(f"layer_ids {bad} out of range: {type(model).__name__} has {len(layers)} "
                         "decoder layers")
    if compression is None:
        if tokenizer is None:
            raise ValueError("inject needs the model's tokenizer (or a compression): Engram hashes "
                             "that tokenizer's ids")
        compression = build_compression(tokenizer)
    vocab = model.get_input_embeddings().num_embeddings
    if compression.raw_vocab_size > vocab:
        raise ValueError(f"the tokenizer has {compression.raw_vocab_size} ids but the model embeds "
                         f"{vocab}: is it this model's tokenizer?")
    if config.compressed_vocab_size is None:
        config = config.replace(compressed_vocab_size=len(compression))
    opts = options if options is not None else InjectOptions(**option_fields)
    runtime = EngramRuntime(model, config, compression, opts, tables)
    runtime.attach()
    model.engram_runtime = runtime
    if hasattr(model, "generate"):
        # generate() calls the model's _reorder_cache when it has one (beam search).
        inner = getattr(model, "_reorder_cache", None)
        model._reorder_cache = partial(runtime.reorder_cache, inner=inner)
    # save_pretrained keeps writing the base checkpoint (from_pretrained of the plain class loads
    # it); the memory ships separately as an adapter (engram.artifacts.adapter.save_engram).
    keys = {f"{n}" for n, _ in model.named_parameters() if ".engram." in f".{n}"}
    model._keys_to_ignore_on_save = set(getattr(model, "_keys_to_ignore_on_save", None) or ()) | keys
    runtime.ignored_keys = keys
    return model


def eject(model: nn.Module) -> nn.Module:
    """Undo ``inject``: remove the modules and hooks; the base model is as it was."""
    runtime = engram_runtime(model)
    runtime.detach()
    model._keys_to_ignore_on_save = set(model._keys_to_ignore_on_save) - runtime.ignored_keys
    if "_reorder_cache" in model.__dict__:
        del model.__dict__["_reorder_cache"]
    del model.engram_runtime
    return model


def engram_runtime(model: nn.Module, required: bool = True) -> EngramRuntime | None:
    rt = model.__dict__.get("engram_runtime")
    if rt is None and required:
        raise ValueError(f"{type(model).__name__} has no Engram injected (call engram.models.hf.inject)")
    return rt


def freeze_base(model: nn.Module) -> list[nn.Parameter]:
    """Train only the memory: every non-Engram parameter stops taking gradients."""
    mine = {id(p) for p in engram_runtime(model).engram_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in mine)
    return [p for p in model.parameters() if p.requires_grad]


__all__ = ["ADAPTERS", "EngramRuntime", "InjectOptions", "decoder_stack", "eject",
           "engram_runtime", "freeze_base", "inject", "zero_value"]
