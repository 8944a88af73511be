"""Per-request Engram history inside a paged serving engine, addressed like its KV cache.

A serving engine (vLLM) flattens all requests of a step into one token batch and feeds a decode step
only its newest token, yet position p of a request needs the request's token ids at p-1..p-N+1 (its
suffix n-grams, paper 2.2) and the short conv's normalised inputs at ``p-(k-1)*dilation .. p-1``
(2.3). Both are kept per KV *slot*, not per request: every position of every request is written
once to the physical slot the engine's block table assigns it (``slot_mapping``), and a lookback
reads the slot of (request, p-j) through the same block table. This is the design of vLLM's own DeepSeek-V4.1
Engram (its ``hash_cache``), extended here to the conv context that V4.1 lacks:

- chunked prefill: a chunk's lookbacks read the slots the previous chunk wrote;
- prefix-cache hits: a request that reuses cached blocks reuses their slots, which hold the same
  token ids and the same conv inputs (same prefix, same hidden states), so nothing is recomputed;
- preemption: a preempted request's blocks are freed and recomputed, rewriting their slots;
- no request can read another's history: a slot belongs to one block, a block to one prefix.
SGLang keeps a per-request token table (req_to_token) instead; slots need no request ids, which
the engine's model interface does not expose.

Shape legend: n scheduled tokens of the step, R requests in it, B blocks per row of the block
table, S slots (= blocks x block size), w values per slot, j lookback depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """Where a step's tokens sit: their requests, positions and slots."""

    positions: torch.Tensor  # [n] absolute position of each token in its request
    query_start: torch.Tensor  # [R+1] first token of each request in the flat batch
    block_table: torch.Tensor  # [R, B] physical block of each logical block
    slot_mapping: torch.Tensor  # [n] physical slot each token's KV (and history) is written to
    block_size: int

    def __post_init__(self) -> None:
        n = self.positions.numel()
        starts = self.query_start.long()
        # [n] request row of each token (tokens of a request are contiguous and in order)
        self.request = torch.searchsorted(starts[1:], torch.arange(n), right=True)
        self.lengths = (starts[1:] - starts[:-1])  # [R]
        self.first_position = self.positions[starts[:-1].clamp(max=max(n - 1, 0))]  # [R]
        if n and not torch.equal(self.slot_of(self.request, self.positions.long()),
                                 self.slot_mapping.long()):
            raise RuntimeError("the engine's block table and slot mapping disagree about where this "
                               "step's tokens live (block size "
                               f"{self.block_size}); Engram history cannot be paged safely")

    def slot_of(self, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Slots of (request row, position) pairs; -1 where position < 0."""
        p = position.clamp(min=0)
        block = self.block_table.long()[request, p // self.block_size]
        return torch.where(position >= 0, block * self.block_size + p % self.block_size, -1)

    def slots_before_tokens(self, depth: int) -> torch.Tensor:
        """[n, depth] slots of positions p-depth..p-1 of each token's own request (-1 before 0)."""
        back = torch.arange(depth, 0, -1)  # [j] depth..1
        pos = self.positions.long()[:, None] - back  # [n, j]
        return self.slot_of(self.request[:, None].expand_as(pos), pos)

    def slots_before_requests(self, depth: int) -> torch.Tensor:
        """[R, depth] slots of the depth positions just before each request's chunk."""
        back = torch.arange(depth, 0, -1)
        pos = self.first_position.long()[:, None] - back  # [R, j]
        rows = torch.arange(pos.shape[0])[:, None].expand_as(pos)
        return self.slot_of(rows, pos)

    def groups(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(token indices, request rows, chunk length) to run as one [b, t] batch: all one-token
        (decode) requests together, each longer chunk on its own."""
        out = []
        decode = torch.nonzero(self.lengths == 1).flatten()
        if decode.numel():
            out.append((self.query_start[decode].long(), decode, 1))
        for r in torch.nonzero(self.lengths > 1).flatten().tolist():
            a, b = int(self.query_start[r]), int(self.query_start[r + 1])
            out.append((torch.arange(a, b), torch.tensor([r]), b - a))
        return out


class SlotHistory:
    """One value (or vector of ``width``) per slot; slot -1 reads ``fill``."""

    def __init__(self, width: int | None, dtype: torch.dtype, fill: float | int = 0):
        self.width, self.dtype, self.fill = width, dtype, fill
        self.data: torch.Tensor | None = None  # [S] or [S, w]

    def ensure(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if self.data is None or self.data.shape[0] != num_slots:
            shape = (num_slots,) if self.width is None else (num_slots, self.width)
            self.data = torch.full(shape, self.fill, dtype=self.dtype, device=device)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        if self.data is None:
            raise RuntimeError("SlotHistory.ensure(num_slots) must run before the first write")
        self.data[slots.long()] = values.to(self.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> values [...] (or [..., w]); ``fill`` where a slot is -1."""
        if self.data is None:
            raise RuntimeError("SlotHistory.ensure(num_slots) must run before the first read")
        s = slots.long()
        out = self.data[s.clamp(min=0)]
        dead = (s < 0) if self.width is None else (s < 0)[..., None]
        return torch.where(dead, torch.as_tensor(self.fill, dtype=self.dtype), out)
