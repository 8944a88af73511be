"""The reference LM with Engram as a transformers model: ``AutoModelForCausalLM.from_pretrained(OUT)``
on a directory written by ``engram export-hf`` (artifacts/export.py), with no trust_remote_code
once ``engram`` is imported (serving/hf_auto.py registers the classes). ``generate()``, pipelines,
PEFT and lm-evaluation-harness then work on it as on any causal LM.

What transformers sees: a causal LM over the tokenizer's ids (``vocab_size`` W, the run's
tokenizer in OUT/tokenizer.json). What runs is the one runtime (serving/runtime.py) on the model's
own ids, with hash ids computed from token ids outside the model.

Padding: the reference model has no padding mask (see serving/generate.py), so a padded batch is
never run as one [b, t] tensor. Rows are grouped by their unpadded span; each group runs as
``engram generate`` runs it, from position 0 with its own KV cache (``DecodeCache``), n-gram
history (``HashStream``) and conv state (``EngramState``), and its outputs are put back in the
padded layout. A padded row therefore gets exactly the tokens it gets alone (tested). Decode steps
run each group once; the groups of one batch are ``EngramCache``, the ``cache`` generate()
hands back to every step (a ``DynamicCache`` cannot hold n-gram history or conv state).

Tables: on the tier config.json's ``engram_serving`` names, overridden with the vLLM plugin's keys:
``from_pretrained(OUT, engram_serving={"tier": "file", "cache_fraction": 0.05})``.

Shape legend: b rows, t new positions, g rows of one group, s positions of a group, k kept logit
positions, d model width, V model vocabulary, W tokenizer vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.cache import DecodeGroup
from ..models.model import EngramLM, ModelOutput
from ..retrieval.hashing import NgramHasher
from .hf_config import EngramLMConfig
from .hf_load import check_config, load_export, save_export
from .runtime import Runtime, row_spans

IGNORE = -100  # label left out of the loss (transformers' convention)


class EngramCache:
    """generate()'s cache: per group of equally long rows, its KV cache, n-gram history and conv
    state. ``seen`` counts the padded positions so far (what transformers calls the length)."""

    is_compileable = False
    is_linear = (False,)

    def __init__(self, groups: list[DecodeGroup], seen: int):
        self.groups, self.seen = groups, seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def batch_size(self) -> int:
        return sum(g.rows.numel() for g in self.groups)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row i takes old row ``beam_idx[i]`` (beam search); rows stay in their source's group."""
        src = beam_idx.long().cpu()
        where = torch.empty(self.batch_size, 2, dtype=torch.long)  # old row -> (group, index)
        for gi, g in enumerate(self.groups):
            where[g.rows, 0] = gi
            where[g.rows, 1] = torch.arange(g.rows.numel())
        kept = []
        for gi, g in enumerate(self.groups):
            new = torch.nonzero(where[src, 0] == gi).flatten()  # new rows drawn from this group
            if new.numel():
                g.keep(where[src[new], 1])
                g.rows = new
                kept.append(g)
        self.groups = kept


class EngramLMForCausalLM(PreTrainedModel, GenerationMixin):
    """An ``engram export-hf`` directory as a transformers causal LM (see the module docstring).

    ``lm``, ``hasher`` and ``vocab`` [V] (model id -> tokenizer id) are the parts; without them
    (``from_config``) a freshly initialised model on DeepSeek's tokenizer, its first V ids.
    """

    config_class = EngramLMConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: EngramLMConfig, lm: EngramLM | None = None,
                 hasher: NgramHasher | None = None, vocab: Any = None,
                 runtime: Runtime | None = None):
        super().__init__(config)
        check_config(config)
        if runtime is None:
            if lm is None:
                lm, hasher, vocab = _fresh(config)
            runtime = Runtime.from_parts(lm, hasher, vocab, raw_vocab_size=config.vocab_size,
                                         eos_id=getattr(config, "eos_token_id", None))
        self.runtime = runtime  # the one path: hashing, id maps, unseen tokens (serving/runtime.py)
        self.lm, self.hasher, self.vocab_map = runtime.model, runtime.hasher, runtime.ids
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() keeps the EngramCache forward returns

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # EngramLM.init_weights initialises everything, in one place

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.lm.embed

    # -- loading and saving ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *model_args: Any,
                        config: EngramLMConfig | None = None,
                        engram_serving: dict[str, Any] | None = None, dtype: Any = None,
                        torch_dtype: Any = None, device_map: Any = None,
                        **kwargs: Any) -> EngramLMForCausalLM:
        """Load an export: dense weights from model.safetensors, tables from its table files on
        the tier ``engram_serving`` (merged over config.json's) names. Local directories only."""
        if model_args:
            raise TypeError(f"unexpected positional arguments {model_args}")
        if device_map not in (None, "cpu"):
            raise ValueError("device_map is not supported: load, then .to(device)")
        return load_export(cls, pretrained_model_name_or_path, config, engram_serving,
                           dtype if dtype is not None else torch_dtype, kwargs)

    def save_pretrained(self, save_directory: str | Path, *args: Any,
                        is_main_process: bool = True, **kwargs: Any) -> None:
        """Write an export (``engram export-hf``'s layout: config, dense weights, table files,
        tokenizer) that ``from_pretrained`` and the vLLM plugin load back."""
        if is_main_process:
            save_export(self, save_directory)

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: EngramCache | None = None,
                past_key_values: EngramCache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                inputs_embeds: torch.Tensor | None = None, return_dict: bool | None = None,
                position_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids [b, t] tokenizer ids, attention_mask [b, past + t] (left padding; right
        padding too without a cache) -> logits [b, k, W]. Positions count each row's own tokens,
        so ``position_ids`` are not needed; they and ``token_type_ids`` (tokenizers return them)
        are ignored."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("Engram hashes the token ids (its n-grams): pass input_ids, not "
                             "inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, EngramCache):
            if cache.get_seq_length() > 0:
                raise TypeError(f"{type(cache).__name__} cannot hold Engram's n-gram history and "
                                "conv state; continue with the EngramCache a forward returned")
            cache = None  # an empty cache a caller made: ours replaces it
        if use_cache is None:  # training (labels) keeps no cache, and may pad on the right
            use_cache = labels is None and getattr(self.config, "use_cache", True)
        b, t = input_ids.shape
        mask = (torch.ones(b, t, dtype=torch.bool) if attention_mask is None
                else attention_mask[:, -t:].bool().cpu())  # [b, t] the new positions
        raw = input_ids.cpu()
        hidden = torch.zeros(b, t, self.config.hidden_size, dtype=self.lm.embed.weight.dtype,
                             device=self.device)  # [b, t, d]; padding stays 0
        aux = []
        if cache is None:
            groups = []
            for (a, s), rows in row_spans(mask, left_only=use_cache).items():
                rows = torch.tensor(rows)
                group = None
                if use_cache:
                    group = self.runtime.new_group(rows)
                    groups.append(group)
                out = self.runtime.forward(raw[rows, a:a + s], group)
                hidden[rows.to(self.device), a:a + s] = out.hidden
                aux.append(out.aux_loss)
            cache = EngramCache(groups, t) if use_cache else None
        else:
            if not bool(mask.all()):
                raise ValueError("padding inside a continued sequence: only a new batch may be "
                                 "padded (on the left)")
            if cache.batch_size != b:
                raise ValueError(f"{b} rows given, the cache holds {cache.batch_size}")
            for group in cache.groups:
                out = self.runtime.forward(raw[group.rows], group, warn=False)  # ids it generated
                hidden[group.rows.to(self.device)] = out.hidden
                aux.append(out.aux_loss)
            cache.seen += t
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and \
            logits_to_keep > 0 else (logits_to_keep if isinstance(logits_to_keep, torch.Tensor)
                                     else slice(None))
        logits = self.runtime.raw_logits(hidden[:, keep])  # [b, k, W]
        loss = None if labels is None else self._loss(hidden, labels, mask, aux)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
              aux: list[torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross entropy over labels [b, t] (unshifted, as transformers passes
        them; -100 and padding left out) + the MoE balancing loss of the groups."""
        targets = labels[:, 1:].cpu()
        local = self.vocab_map.to_local(targets)
        keep = (targets != IGNORE) & mask[:, 1:]
        if bool((keep & (local < 0)).any()):
            raise ValueError("labels hold token ids the model never saw: it gives them no "
                             "probability (set those labels to -100)")
        y = torch.where(keep, local, IGNORE).to(self.device)
        out = ModelOutput(hidden[:, :-1], hidden.new_zeros(()), head=self.lm.logits)
        nll = self.lm.token_nll(out, y, ignore_index=IGNORE)
        return nll.sum() / keep.sum().clamp(min=1) + sum(aux) / max(len(aux), 1)

    # -- generation --------------------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 **kwargs: Any) -> Any:
        """transformers' generate(), after the one context check (``Runtime.fit_prompts``): a
        request longer than the model's context is refused before any work, in one line."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 0:
            gc = generation_config if generation_config is not None else self.generation_config
            new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
            if new is None:
                new = kwargs.get("max_length", getattr(gc, "max_length", 20)) - ids.shape[1]
            # the widest (left-padded) row decides; its prompt is never cut here
            self.runtime.fit_prompts([[0] * ids.shape[1]], max(int(new), 0))
        return super().generate(inputs, generation_config, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any
                                      ) -> dict[str, Any]:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        new = kwargs.get("next_sequence_length")
        if new is None and isinstance(cache, EngramCache):  # older transformers: no slicing hint
            new = input_ids.shape[1] - cache.seen
        return {"input_ids": input_ids if new is None else input_ids[:, -new:],
                "attention_mask": kwargs.get("attention_mask"), "cache": cache,
                "use_cache": kwargs.get("use_cache"), "logits_to_keep": 1}


_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else \
    "past_key_values"  # transformers 5.x renamed past_key_values


def _fresh(config: EngramLMConfig) -> tuple[EngramLM, NgramHasher | None, torch.Tensor]:
    """A freshly initialised model of ``config`` (``from_config``) on DeepSeek's tokenizer."""
    from ..models.model_config import ModelConfig
    from ..retrieval.compress import build_compression, default_tokenizer
    from ..retrieval.config import EngramConfig

    d = dict(config.engram_model)
    d["engram"] = None if d.get("engram") is None else EngramConfig.from_dict(d["engram"])
    mc = ModelConfig.from_dict(d)
    if getattr(config, "engram_nine", None):
        raise ValueError("an Engram-Nine model needs its hot index: load it with from_pretrained")
    hasher = None if mc.engram is None else NgramHasher(mc.engram,
                                                        build_compression(default_tokenizer()))
    return EngramLM(mc).eval(), hasher, torch.arange(mc.vocab_size)

