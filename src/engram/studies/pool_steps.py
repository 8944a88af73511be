"""The model and serving steps the pool budget measures, and t_exec per layer by forward hooks.

A step is what a serving engine runs at once: the prefill of b sequences of t tokens, or one
decode step of b sequences with their prompts already in the KV cache. Hash ids come from the
token ids before the step (they are what makes prefetch possible, paper section 2.5): the runtime
prepares each step (``Runtime.prepare``) and the clock times its ``run`` alone.

Shape legend: b batch, t positions of the step, H hash heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..models.cache import DecodeGroup
from ..models.model import EngramLM
from ..retrieval.hashing import NgramHasher
from ..serving.runtime import Runtime
from ..training.corpus import Corpus

# -- the model and its steps -----------------------------------------------------------------------

@dataclass
class Setup:
    rt: Runtime  # the model, its hasher and vocabulary: every step goes through it
    corpus: Corpus
    train_config: Any

    @property
    def model(self) -> EngramLM:
        return self.rt.model

    @property
    def hasher(self) -> NgramHasher:
        return self.rt.hasher


def build_setup(run_dir: str | None, tc: Any, seed: int = 0) -> Setup:
    """The run's model (tables in memory), or ``tc``'s model with random weights."""
    from ..retrieval.compress import build_compression
    from ..training.corpus import build_corpus
    from ..training.config import saved_config
    from ..training.train import build_model

    if run_dir is not None:
        from ..serving.loader import open_model

        tc = saved_config(run_dir)
        return Setup(open_model(run_dir), build_corpus(tc.data_config()), tc)
    if not tc.engram:
        raise UserError("the model has no Engram layer (--engram=false): nothing to budget")
    corpus = build_corpus(tc.data_config())
    torch.manual_seed(seed)
    model = build_model(tc, corpus).eval()
    hasher = NgramHasher(tc.engram_config(), build_compression())
    return Setup(Runtime(model, hasher, corpus.ids), corpus, tc)


def steps(setup: Setup, mode: str, batch: int, prefill_len: int, decode_context: int,
          reps: int) -> list[dict]:
    """``reps`` steps of held-out text, prepared by the runtime (hash ids before the step): prefill
    batches, or decode steps after a prompt ("prompt": its prompt, prepared)."""
    rt = setup.rt
    val, c = setup.corpus.val.astype(np.int64), setup.model.config
    b = batch
    t = prefill_len if mode == "prefill" else decode_context + 1
    if t > c.max_seq_len:
        raise UserError(f"{mode} needs {t} positions, the model has max_seq_len={c.max_seq_len}")
    out = []
    for r in range(reps):
        a = (r * b * t) % max(1, val.size - b * t)
        raw = torch.from_numpy(val[a:a + b * t].reshape(b, t))  # [b, t]
        if mode == "prefill":
            out.append({"step": rt.prepare(raw, warn=False)})
        else:
            group = rt.new_group(list(range(b)), 1)  # its n-gram history (caches: per run)
            out.append({"prompt": rt.prepare(raw[:, :-1], group, warn=False),
                        "step": rt.prepare(raw[:, -1:], group, warn=False)})
    return out


def step_group(rt: Runtime, step: dict) -> DecodeGroup | None:
    """A fresh decode cache holding a decode step's prompt (None for a prefill step)."""
    if "prompt" not in step:
        return None
    p = step["prompt"].local
    group = rt.new_group(list(range(p.shape[0])), p.shape[1] + 1)
    rt.run(step["prompt"], group, announce=False)
    return group


@torch.no_grad()
def run_step(rt: Runtime, step: dict) -> tuple[float, float]:
    """One step (a decode prompt goes into a fresh cache first, untimed); -> (forward seconds,
    head seconds for the next token's logits, all serving needs)."""
    group = step_group(rt, step)
    t0 = time.perf_counter()
    out = rt.run(step["step"], group, announce=False)
    t1 = time.perf_counter()
    out.head(out.hidden[:, -1:])
    return t1 - t0, time.perf_counter() - t1


# -- t_exec per layer ------------------------------------------------------------------------------

class LayerClock:
    """Forward hooks timing the embedding, every block and the final norm of one call."""

    def __init__(self, model: EngramLM):
        self.parts = {"embed": model.embed, **{f"block{i}": b for i, b in enumerate(model.blocks)},
                      "norm": model.norm}
        self.times: dict[str, float] = {}
        self._t0: dict[str, float] = {}
        self._handles = []
        for name, mod in self.parts.items():
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def hook(module, args):
            self._t0[name] = time.perf_counter()
        return hook

    def _post(self, name: str):
        def hook(module, args, out):
            self.times[name] = time.perf_counter() - self._t0[name]
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def time_layers(rt: Runtime, batch: list[dict]) -> dict[str, Any]:
    """Median seconds per part (hooked calls) and of whole forwards (plain calls, no hooks).

    Hooked and plain calls alternate step by step, so load from other jobs hits both alike.
    Window of the Engram layer at depth k: embedding + blocks 0..k-1.
    """
    model = rt.model
    parts, plain, head = [], [], []
    for i, step in enumerate([batch[0]] + batch):  # the first is a warm-up
        clock = LayerClock(model)
        try:
            run_step(rt, step)
        finally:
            clock.remove()
        fwd, hd = run_step(rt, step)
        if i:
            parts.append(clock.times)
            plain.append(fwd)
            head.append(hd)
    med = {k: float(np.median([p[k] for p in parts])) for k in parts[0]}
    # Paired by step (the hooked and the plain call ran back to back): load drift cancels.
    ratio = float(np.median([sum(p.values()) / f for p, f in zip(parts, plain)]))
    blocks = [med[f"block{i}"] for i in range(len(model.blocks))]
    return {"embed_s": med["embed"], "block_s": blocks, "norm_s": med["norm"],
            "parts_sum_s": med["embed"] + sum(blocks) + med["norm"], "parts_over_forward": ratio,
            "forward_s": float(np.median(plain)), "head_s": float(np.median(head)),
            "step_s": float(np.median(np.add(plain, head))),
            "window_s": [med["embed"] + sum(blocks[:k]) for k in range(len(blocks))]}


def step_rows(setup: Setup, batch: list[dict]) -> list[dict[int, torch.Tensor]]:
    eng = setup.model.engrams()
    return [{lid: e.rows(s["step"].ids[lid]) for lid, e in eng.items()}  # [b, t, H]
            for s in batch]
