"""lm-evaluation-harness on an ``engram export-hf`` directory or an ``engram finetune`` adapter: the
model type ``engram``.

lm-eval 0.4 has no plugin entry points: a model type exists once its module is imported
(``@register_model``). ``engram lm-eval ARGS`` (cli/serving.py) imports this module and hands ARGS
to lm-eval's own command line, so its options, task files and output are lm-eval's; ``--model
engram`` is added when no model is named:

    engram lm-eval --model_args pretrained=OUT,tier=file --tasks wikitext --include_path DIR

model_args: ``pretrained`` (an export, or an adapter: base model + Engram, tables in memory), the
tier keys of ``engram_serving`` (``tier``, ``cache_fraction``, ``prefetch``), ``batch_size``,
``max_length`` (default: the model's), ``device``.

How each request type is scored (the model is EngramLMForCausalLM, serving/hf_model.py):
- ``loglikelihood_rolling``: each document after EOS (the token that precedes every document in
  training) in rolling windows, by ``Runtime.score_documents``, what ``engram eval
  --per_document`` reports (tested equal). Unseen ids are context only, as there.
- ``loglikelihood``: context + continuation cut to the last ``max_length + 1`` tokens, one forward
  by the runtime's scorer (``Runtime.score_windows``); a continuation token the run never saw has probability 0
  (log-likelihood -inf), since leaving it out would favour continuations the model cannot write.
- ``generate_until``: the runtime's Generator (``engram generate``'s decoding; greedy unless the
  task samples), cut at the first stop string.
Rows are never padded into one tensor for scoring: batches hold requests of one length.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..serving.hf_model import EngramLMForCausalLM


@register_model("engram")
class EngramHarnessLM(TemplateLM):
    def __init__(self, pretrained: str, tier: str | None = None,
                 cache_fraction: float | None = None, prefetch: bool | None = None,
                 batch_size: int | str = 16, max_length: int | None = None,
                 device: str | None = None, max_gen_toks: int = 256, **kwargs: Any):
        super().__init__()

        unknown = sorted(k for k in kwargs if k not in ("max_batch_size", "trust_remote_code"))
        if unknown:
            raise ValueError(f"model_args {unknown} are not arguments of the engram model type "
                             "(pretrained, tier, cache_fraction, prefetch, batch_size, "
                             "max_length, device, max_gen_toks)")
        # checked by the export's reader: an unknown tier is refused with the known ones
        serving = {k: v for k, v in (("tier", tier), ("cache_fraction", cache_fraction),
                                     ("prefetch", prefetch)) if v is not None}
        from ..artifacts.adapter import detect as is_adapter

        if is_adapter(pretrained):  # `engram finetune`'s folder: the runtime opens it as is
            from ..serving.loader import open_model

            self.runtime = open_model(pretrained, **serving)
            self._eot = self.runtime.eos_id
        else:
            model = EngramLMForCausalLM.from_pretrained(pretrained, engram_serving=serving)
            self.runtime = model.runtime  # the one path every request goes through
            self._eot = model.config.eos_token_id
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's default device; its hf model falls back the same way
        if device not in (None, "cpu"):
            self.runtime.to(device)
        self.tokenizer = self.runtime.tokenizer
        self.batch_size = 16 if batch_size in (None, "auto") else int(batch_size)
        self.max_length = int(max_length or self.runtime.max_seq_len)
        if self.max_length > self.runtime.max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds the model's max_seq_len="
                             f"{self.runtime.max_seq_len}")
        self.max_gen_toks = int(max_gen_toks)

    # -- tokens ------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self._eot)  # ends every training document

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids  # as training did

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- requests ----------------------------------------------------------------------------------
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        docs = [self.tok_encode(r.args[0]) for r in requests]
        out = self.runtime.score_documents(docs, self.eot_token_id, self.max_length,
                                           self.batch_size)
        return [d["loglikelihood"] for d in out]

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        rt = self.runtime
        streams = [np.asarray((list(ctx) + list(cont))[-(self.max_length + 1):], dtype=np.int64)
                   for _, ctx, cont in requests]
        n_cont = [len(cont) for *_, cont in requests]
        plan = sorted(((i, 0, len(s) - 1, n) for i, (s, n) in enumerate(zip(streams, n_cont))),
                      key=lambda w: w[2])  # one batch shape per length
        _, unseen = rt.local_ids(torch.from_numpy(np.concatenate(streams)))  # warned once
        greedy = [True] * len(streams)
        total, _ = rt.score_windows(streams, plan, self.max_length, self.batch_size,
                                    per_row=True, greedy=greedy)
        out, end = [], 0
        for i, s in enumerate(streams):
            end += len(s)
            if bool(unseen[end - min(n_cont[i], len(s) - 1):end].any()):
                out.append((float("-inf"), False))  # the run cannot write this continuation
            else:
                out.append((-total[i], greedy[i]))
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for key, idx in groups.items():
            kw = dict(requests[idx[0]].args[1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kw.pop("do_sample", False)) or float(kw.get("temperature", 0) or 0) > 0
            for a in range(0, len(idx), self.batch_size):
                batch = idx[a:a + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in batch], max_new, sample, kw)
                for i, text in zip(batch, texts):
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[i] = text
        return out

    def _generate(self, contexts: list[str], max_new: int, sample: bool,
                  kw: dict[str, Any]) -> list[str]:
        from ..serving.generate import GenerationConfig, Generator

        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in "
                             f"max_length={self.max_length}")
        eos = self.eot_token_id
        prompts = [(self.tok_encode(c) or [eos])[-room:] for c in contexts]
        temperature = float(kw.get("temperature") or 1.0) if sample else 0.0
        cfg = GenerationConfig(max_new_tokens=max_new, temperature=temperature, stop_ids=(eos,))
        return [self.tok_decode(t) for t in Generator(self.runtime, config=cfg).generate(
            prompts).tokens]
