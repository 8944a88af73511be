"""The tiers of benchmarks/offload.py: one reference model served from its own tables in memory
(``model``, the baseline), from every tier of the tier registry that opens on this machine
(``engram.tables.registry``: memory, file, pinned, shared, pool, sharded, mooncake; by their
registry names), and from the file tier behind the hot cache + prefetch (``file_cached``; with its
pages evicted before every timed call, ``file_cold_cached``; also announcing the next batch,
``file_cold_cached_lookahead``), and the prefill / decode timing loops that run them side by side.

Kept apart from the script so that it reads in one sitting: this module builds and times the tiers,
offload.py measures gather, hit rate and the beyond-RAM table, and writes the JSON.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engram import EngramConfig, EngramLM, ModelConfig, NgramHasher
from engram.serving.loader import load_dense_state
from engram.tables.prefetch import prefetch_batch
from engram.tables.registry import REGISTRY, open_tier
from engram.tables.tiers import FileTable

BASELINE = "model"  # the trained model's own tables, in memory: every ratio is against it


def reference_model(table_gb: float, vocab_size: int) -> ModelConfig:
    """6 layers, d=256, Engram at layers 1 and 4 (N=3, 8 heads per order, head dim 64); the table
    size per head is chosen so the two layers' fp32 tables total ``table_gb`` GiB."""
    per_head = int(table_gb * 2**30 / (2 * 16 * 64 * 4))
    ecfg = EngramConfig(engram_vocab_size=[per_head, per_head], max_ngram_size=3,
                        n_embed_per_ngram=512, n_head_per_ngram=8, layer_ids=[1, 4], pad_id=1)
    return ModelConfig(vocab_size=vocab_size, n_layer=6, d_model=256, n_head=4, max_seq_len=512,
                       tie_embeddings=True, engram=ecfg, table_init_std=0.02)


def resident_fraction(path: Path) -> float:
    """Share of the file's pages in the page cache (mincore on a fresh mapping; faults nothing)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    n = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    rc = libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
    del arr
    mm.close()
    return float("nan") if rc else float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())


@dataclass
class ServedModel:
    model: EngramLM
    prefetch: bool = False  # announce rows before the forward
    evict: list[FileTable] = field(default_factory=list)  # made cold before every timed call
    lookahead: bool = False  # also announce the next batch's rows (prefill only)


class Tiers:
    """The ways of serving one model. Each cold tier reads its own copy of the table files, so its
    pages can be evicted before every timed call while the other tiers keep theirs mapped."""

    def __init__(self, memory: EngramLM, folders: dict[str, Path], hasher: NgramHasher,
                 counts: dict[int, dict[str, torch.Tensor]], cache_fraction: float,
                 io_threads: int):
        self.memory, self.folders, self.hasher = memory, folders, hasher
        self.counts, self.fraction, self.io_threads = counts, cache_fraction, io_threads
        self.state = memory.state_dict()
        self.skipped: dict[str, str] = {}  # registered tiers that cannot open here, and why

    def _served(self, tier: str, folder: str, cached: bool = False) -> EngramLM:
        """The model with its tables on ``tier`` (registry name) from ``folder``'s files, behind
        the hot cache and prefetch when ``cached``."""
        tables = open_tier(tier, self.folders[folder], self.memory.config.engram, self.hasher,
                           counts=self.counts if cached else None,
                           cache_fraction=self.fraction if cached else 0.0, prefetch=cached,
                           verify=False)
        m = EngramLM(self.memory.config, tables=tables)
        load_dense_state(m, self.state, outside=tables)
        return m.eval()

    def all(self, lookahead: bool, registered: tuple[str, ...] = tuple(REGISTRY)
            ) -> dict[str, ServedModel]:
        """The baseline, the ``registered`` tiers (registry names) that open here, and the file
        tier behind the hot cache and prefetch, warm and cold."""
        out = {BASELINE: ServedModel(self.memory)}
        for name in registered:
            tier = REGISTRY[name]
            why = tier.missing()
            if why:
                self.skipped[name] = why
            else:
                out[name] = ServedModel(self._served(name, "warm"))
        out["file_cached"] = ServedModel(self._served("file", "warm", cached=True), prefetch=True)
        cold = self._served("file", "cold", cached=True)
        out["file_cold_cached"] = ServedModel(cold, True, file_tables(cold))
        if lookahead:
            ahead = self._served("file", "ahead", cached=True)
            out["file_cold_cached_lookahead"] = ServedModel(ahead, True, file_tables(ahead), True)
        return out


def file_tables(model: EngramLM) -> list[FileTable]:
    out = []
    for e in model.engrams().values():
        t = e.table
        while t is not None and not isinstance(t, FileTable):
            t = getattr(t, "inner", None)
        if t is not None:
            out.append(t)
    return out


def close(tiers: dict[str, ServedModel]) -> None:
    """Release every store a served model holds (file mappings, pools, a Mooncake session)."""
    for name, tier in tiers.items():
        if name == BASELINE:
            continue
        for e in tier.model.engrams().values():
            t = e.table
            while t is not None:
                if hasattr(t, "close"):
                    t.close()
                t = getattr(t, "inner", None)


def stats_of(model: EngramLM) -> dict:
    out = {}
    for lid, e in model.engrams().items():
        t, s = e.table, {}
        if hasattr(t, "stats") and hasattr(t.stats, "wait_s"):
            s["prefetch_wait_s"] = round(t.stats.wait_s, 4)
            t = t.inner
        if hasattr(t, "stats") and hasattr(t.stats, "hit_rate"):
            s["cache_hit_rate"] = round(t.stats.hit_rate, 4)
        out[lid] = s
    return out


def _summary(times: dict[str, list[float]], tokens: int) -> tuple[dict, dict]:
    """tok/s per tier from its median round, plus the fastest round and the paired ratios (rounds
    ran all tiers back to back, so load from other jobs on a shared machine cancels in them)."""
    med = {k: tokens / float(np.median(v)) for k, v in times.items()}
    return med, {"best_tok_s": {k: tokens / min(v) for k, v in times.items()},
                 "paired_ratios": _paired(times), "rounds": len(times[BASELINE])}


def _paired(times: dict[str, list[float]]) -> dict[str, float]:
    """Median over rounds of t_memory / t_tier: tiers of one round ran back to back, so load from
    other jobs on the machine cancels out better than in a ratio of medians."""
    mem = np.asarray(times[BASELINE])
    return {k: float(np.median(mem / np.asarray(v))) for k, v in times.items() if k != BASELINE}


@torch.no_grad()
def bench_prefill(tiers: dict[str, ServedModel], corpus, hasher, args) -> tuple[dict, dict]:
    """Each batch through every tier (shuffled order per round); round 0 is an untimed warm-up."""
    from tqdm.auto import tqdm

    val = corpus.val.astype(np.int64)
    b, t = args.prefill_batch, args.prefill_len
    batches = []
    for r in range(args.reps + 1):
        raw = torch.from_numpy(val[r * b * t:(r + 1) * b * t].reshape(b, t))
        batches.append((corpus.to_local(raw), hasher.hash(raw)))
    times = {k: [] for k in tiers}
    same, rng = True, np.random.default_rng(0)
    for r in tqdm(range(args.reps + 1), desc="prefill", leave=False):
        local, ids = batches[r]
        ref = None
        for name in rng.permutation(list(tiers)):  # no tier always runs after the same one
            tier = tiers[name]
            for f in tier.evict:
                f.evict()
            t0 = time.perf_counter()
            if tier.prefetch and not (tier.lookahead and r):  # lookahead: announced last round
                prefetch_batch(tier.model, ids)
            if tier.lookahead and r + 1 < len(batches):
                prefetch_batch(tier.model, batches[r + 1][1])  # read while this batch computes
            logits = tier.model(local, ids).logits
            if r:
                times[name].append(time.perf_counter() - t0)
            same &= ref is None or torch.equal(logits, ref)
            ref = logits
    best, extra = _summary(times, b * t)
    return best, {"same": same, **extra}


@torch.no_grad()
def bench_decode(tiers: dict[str, ServedModel], corpus, hasher, args) -> tuple[dict, dict]:
    """All tiers decode the same prompts in lockstep, one step each in shuffled order (greedy,
    KV cache, n-gram stream, conv state); step 0 is an untimed warm-up."""
    from tqdm.auto import tqdm

    val = corpus.val.astype(np.int64)
    n, plen, steps = args.decode_batch, args.decode_prompt, args.new_tokens
    start = (args.reps + 1) * args.prefill_batch * args.prefill_len
    times = {k: [] for k in tiers}
    same, rng = True, np.random.default_rng(1)
    for rep in range(args.decode_reps):
        a = start + rep * n * plen
        prompt = torch.from_numpy(val[a:a + n * plen].reshape(n, plen))
        state = {}
        for name, tier in tiers.items():
            cache, stream = tier.model.new_cache(n, plen + steps), hasher.stream(n)
            logits = tier.model(corpus.to_local(prompt), stream.step(prompt), cache=cache).logits
            state[name] = [cache, stream, logits[:, -1].argmax(-1), []]
        for s in tqdm(range(steps), desc=f"decode {rep}", leave=False):
            for name in rng.permutation(list(tiers)):
                tier = tiers[name]
                cache, stream, tok, out = state[name]
                for f in tier.evict:
                    f.evict()
                t0 = time.perf_counter()
                raw = corpus.to_raw(tok)[:, None]  # [n, 1]
                ids = stream.step(raw)
                if tier.prefetch:
                    prefetch_batch(tier.model, ids)
                tok = tier.model(corpus.to_local(raw), ids, cache=cache).logits[:, -1].argmax(-1)
                if s:
                    times[name].append(time.perf_counter() - t0)
                state[name][2] = tok
                out.append(tok)
        outs = [torch.stack(v[3]) for v in state.values()]
        same &= all(torch.equal(o, outs[0]) for o in outs)
    best, extra = _summary(times, n)
    return best, {"same": same, **extra}
