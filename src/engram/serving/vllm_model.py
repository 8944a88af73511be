"""The reference LM with Engram as a vLLM model (imported by vLLM only, through the plugin).

vLLM owns scheduling, the paged KV cache, sampling and the OpenAI server; this class owns the
model: ``engram.serving.paged.PagedLM`` on vLLM's flat token batch, with vLLM's paged
``Attention`` as its attention and the per-request n-gram and conv history in slots addressed by
vLLM's own block table and slot mapping (design note: serving/slots.py). Weights, tables and the
tier they are read from come from an ``engram export-hf`` directory (artifacts/export.py); the
tier (any of ``engram.tables.registry.TIERS``) can be changed per server with
``--hf-overrides '{"engram_serving": {"tier": "file"}}'``.

Shape legend: n scheduled tokens of the step, h heads, e head dim, W tokenizer vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context

from ..artifacts.run import load_dense_state
from .hf_export import open_export
from .paged import PagedLM
from .slots import StepLayout


class EngramLMForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        out_dir = Path(vllm_config.model_config.model)
        hf = vllm_config.model_config.hf_config
        # the one runtime: tables on their tier, dense weights, id maps, unseen-token policy
        runtime = open_export(out_dir, getattr(hf, "engram_serving", None))
        self.paged = PagedLM(runtime)
        mc = runtime.model.config
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        self.attn = nn.ModuleList([
            Attention(mc.n_head, mc.head_dim, scale=mc.head_dim ** -0.5, num_kv_heads=mc.n_head,
                      cache_config=cache, prefix=f"{prefix}attn.{i}" if prefix == "" else
                      f"{prefix}.attn.{i}")
            for i in range(mc.n_layer)])

    # -- vLLM's model interface --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.paged.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None):
        if input_ids is None:
            raise ValueError("Engram reads token ids (its n-grams); inputs_embeds alone cannot work")
        layout, n = self._layout(positions)
        hidden = self.paged(input_ids[:n], positions[:n], layout, self._attend)  # [n, d]
        if n < input_ids.numel():  # the engine padded the batch
            hidden = torch.cat([hidden, hidden.new_zeros(input_ids.numel() - n, hidden.shape[1])])
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.paged.logits(hidden_states)  # [k, W]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the runtime loaded them when it opened the export; loaded again, since the engine may
        # have moved or re-initialised parameters after __init__ (its loader's contract)
        lm = self.paged.lm
        dense = {k: v for k, v in weights if not k.startswith("engram.")}
        load_dense_state(lm, dense, outside=lm.config.engram_layers)
        return {name for name, _ in self.named_parameters()}

    # -- glue --------------------------------------------------------------------------------------
    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: StepLayout | None) -> torch.Tensor:
        n, h, e = q.shape
        return self.attn[i](q.reshape(n, h * e), k.reshape(n, h * e),
                            v.reshape(n, h * e)).view(n, h, e)

    def _layout(self, positions: torch.Tensor) -> tuple[StepLayout | None, int]:
        meta, _, kv_cache, slot_mapping = get_attention_context(self.attn[0].layer_name)
        if meta is None or kv_cache.numel() == 0:  # profiling / dummy run: no history
            return None, positions.numel()
        n = int(meta.num_actual_tokens)
        reqs = int(meta.seq_lens.numel())
        slots = (meta.slot_mapping if slot_mapping is None else slot_mapping)[:n]
        self.paged.ensure_slots(kv_cache.shape[0] * self.block_size)
        layout = StepLayout(positions[:n].cpu(), meta.query_start_loc[:reqs + 1].cpu(),
                            meta.block_table[:reqs].cpu(), slots.cpu(), self.block_size)
        return layout, n
