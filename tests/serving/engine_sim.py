"""A miniature paged engine for tests: what vLLM's scheduler does to a model, in 80 lines."""

import numpy as np
import torch
import torch.nn.functional as F

from engram.serving.slots import SlotHistory, StepLayout


class MiniEngine:
    """Just enough of a paged engine: blocks from a shuffled free list, at most ``chunk`` new
    tokens per request per step, full prompt blocks shared by later requests with the same
    prefix (prefix cache), and optional preemption (blocks freed, request recomputed)."""

    def __init__(self, paged, block_size=4, num_blocks=400, chunk=5, seed=0):
        self.paged, self.bs, self.chunk = paged, block_size, chunk
        rng = np.random.default_rng(seed)
        self.free = [int(b) for b in rng.permutation(num_blocks)]
        self.attn = TorchPagedAttention(paged.lm.config.n_layer, paged.lm.config.n_head,
                                        paged.lm.config.head_dim)
        paged.ensure_slots(num_blocks * block_size)
        self.attn.ensure_slots(num_blocks * block_size)
        self.cached: dict[tuple, int] = {}  # full block's token prefix -> block id
        self.reqs = []
        self.prefix_hits = 0

    def add(self, prompt, max_new):
        r = {"tokens": list(prompt), "n_prompt": len(prompt), "max_new": max_new, "done": 0,
             "blocks": [], "out": []}
        for k in range((len(prompt) - 1) // self.bs):  # reuse cached full blocks (leave 1 token)
            block = self.cached.get(tuple(prompt[:(k + 1) * self.bs]))
            if block is None:
                break
            r["blocks"].append(block)
            r["done"] = (k + 1) * self.bs
            self.prefix_hits += 1
        self.reqs.append(r)

    def preempt(self, i):
        r = self.reqs[i]
        self.free += [b for b in r["blocks"] if b not in self.cached.values()]
        r["blocks"], r["done"] = [], 0

    def _slot(self, r, p):
        while len(r["blocks"]) <= p // self.bs:
            r["blocks"].append(self.free.pop())
        return r["blocks"][p // self.bs] * self.bs + p % self.bs

    def step(self):
        live = [r for r in self.reqs if len(r["out"]) < r["max_new"]]
        if not live:
            return False
        raw, pos, slots, starts = [], [], [], [0]
        for r in live:
            n = min(self.chunk, len(r["tokens"]) - r["done"])
            for p in range(r["done"], r["done"] + n):
                raw.append(r["tokens"][p])
                pos.append(p)
                slots.append(self._slot(r, p))
            starts.append(len(raw))
        width = max(len(r["blocks"]) for r in live)
        table = torch.tensor([r["blocks"] + [0] * (width - len(r["blocks"])) for r in live])
        layout = StepLayout(torch.tensor(pos), torch.tensor(starts), table, torch.tensor(slots),
                            self.bs)
        hidden = self.paged(torch.tensor(raw), torch.tensor(pos), layout, self.attn)
        for j, r in enumerate(live):
            r["done"] += starts[j + 1] - starts[j]
            if r["done"] == r["n_prompt"] and r["done"] == len(r["tokens"]):  # prompt finished
                for k in range(r["n_prompt"] // self.bs):
                    self.cached.setdefault(tuple(r["tokens"][:(k + 1) * self.bs]), r["blocks"][k])
            if r["done"] == len(r["tokens"]):  # caught up: sample the next token
                tok = int(self.paged.logits(hidden[starts[j + 1] - 1][None]).argmax())
                r["tokens"].append(tok)
                r["out"].append(tok)
        return True


class TorchPagedAttention:
    """Paged causal attention in plain torch: K and V per slot, each request attends to its own
    positions 0..p through the block table. The engine-free stand-in for vLLM's Attention."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int):
        self.keys = [SlotHistory(n_head * head_dim, torch.float32) for _ in range(n_layer)]
        self.values = [SlotHistory(n_head * head_dim, torch.float32) for _ in range(n_layer)]
        self.n_head, self.head_dim = n_head, head_dim

    def ensure_slots(self, num_slots: int) -> None:
        for hist in self.keys + self.values:
            hist.ensure(num_slots)

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layout: StepLayout | None) -> torch.Tensor:
        n, h, e = q.shape
        if layout is None:  # every token alone: attends to itself
            return v
        self.keys[i].write(layout.slot_mapping, k.reshape(n, h * e))
        self.values[i].write(layout.slot_mapping, v.reshape(n, h * e))
        out = torch.empty_like(q)
        for r in range(layout.lengths.numel()):
            a, b = int(layout.query_start[r]), int(layout.query_start[r + 1])
            last = int(layout.positions[b - 1])
            slots = layout.slot_of(torch.full((last + 1,), r), torch.arange(last + 1))  # [L]
            keys = self.keys[i].read(slots).view(-1, h, e).transpose(0, 1)  # [h, L, e]
            vals = self.values[i].read(slots).view(-1, h, e).transpose(0, 1)
            qr = q[a:b].transpose(0, 1)  # [h, t, e]
            mask = torch.arange(last + 1)[None, :] <= layout.positions[a:b, None]  # [t, L]
            out[a:b] = F.scaled_dot_product_attention(qr, keys.to(q.dtype), vals.to(q.dtype),
                                                      attn_mask=mask).transpose(0, 1)
        return out
