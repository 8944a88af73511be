"""The Engram module at the official demo's shapes: ours vs a plain port of the demo's module.

    python benchmarks/module.py [--json benchmarks/results/module.json] [--profile] [--smoke]

Shapes of engram_demo_v1.py: hidden 1024, hc_mult 4, N = 3, 8 heads x 2 orders, 512 per order
(d_mem 1024), batch 4 x 512. Tables are smaller than the demo's 10.3M rows (--table_size per order,
default 64k: ~1M rows x 64), so the benchmark fits a shared machine; row ids are uniform per head.
Everything runs interleaved in one process (one call of each variant per round, medians), so load
from other processes hits all alike. Variants:

- ``demo``: a plain port of the official demo's module (dense nn.Embedding with offsets, per-branch
  key/norm loops, torch.stack, nn.Conv1d with symmetric padding then a slice), written here only;
  its products go where torch sends them (MKL), as the official code's would.
- ``demo_gemm``: the same port with its nn.Linear's through engram.compute.gemm (the module's GEMM path), so
  ``ours`` / ``demo_gemm`` compares the two modules at equal matrix-multiply speed.
- ``ours``: engram.Engram as training builds it (sparse row gradient of the table; on CPU in
  float32 the gate and conv run as compiled kernels, module/fused.py).
- ``ours_dense``: the same with a dense table gradient (like the demo's nn.Embedding).
- ``ours_torch``: ``ours`` without the compiled kernels (``kernels=False``: the gate and conv as
  eager torch ops, GateFn + ConvFn; what other devices and dtypes run).
- ``ours_mkl``: ``ours`` with every product through torch's default BLAS (``F.linear``; MKL),
  whatever engram/compute/gemm.py's backend: what the GEMM route buys (the same as ``ours`` where the
  backend is ``torch``).
- ``gemm``: the same module's GEMMs alone (value + 4 keys as one [c -> 5d] matmul with bias), as the
  module runs them (engram.compute.gemm.linear: oneDNN where the backend is ``onednn``).
- ``gemm_mkl``: the same GEMMs through ``F.linear``.

- ``compiled`` (with --compile only): the same computation written as plain torch ops (gate, norms,
  conv as shifted multiply-adds) and given to ``torch.compile`` (inductor, C++ on CPU), so inductor
  fuses the elementwise work; compile time is recorded apart. An evaluation, not a library option.

Goals (issue 16): ours fwd+bwd >= 3x demo; ours fwd+bwd within 1.3x of gemm; forward >= 2x demo.
Also: the decode step (t = 1, with EngramState) latency. The load average of the machine before and
after is recorded (``load_avg``): the ratios are interleaved, the absolute tokens/s are not robust.

The process runs with the allocator settings `engram compare` gives its workers
(engram.training.train.ALLOCATOR_ENV: freed memory is kept, so each call's 32 MiB activations do
not page-fault in again); --no_allocator_env measures without them. Both apply to every variant.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from engram import EngramConfig, EngramState, build_engram
from engram.compute import gemm, machine
from engram.retrieval.primes import prime_table_sizes
from engram.training.train import ALLOCATOR_ENV
from record import with_allocator_env, write_json  # benchmarks/record.py: the script's folder is on sys.path


# -- the official demo's module, ported plainly (engram_demo_v1.py) ------------------------------
class DemoShortConv(nn.Module):
    def __init__(self, hidden_size, kernel_size=4, dilation=1, norm_eps=1e-5, hc_mult=4):
        super().__init__()
        self.hc_mult = hc_mult
        total = hidden_size * hc_mult
        self.conv = nn.Conv1d(total, total, kernel_size, groups=total, bias=False,
                              padding=(kernel_size - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult)])
        self.act_fn = nn.SiLU()

    def forward(self, x):
        B, T, G, C = x.shape
        x_norm = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(G)], dim=-1)
        y = self.act_fn(self.conv(x_norm.transpose(1, 2))[..., :T])
        return y.transpose(1, 2).view(B, T, G, C).contiguous()


class DemoEngram(nn.Module):
    def __init__(self, head_sizes, head_dim, d_mem, hidden, hc_mult, kernel, dilation):
        super().__init__()
        self.hidden, self.hc_mult = hidden, hc_mult
        offsets = [0]
        for n in head_sizes[:-1]:
            offsets.append(offsets[-1] + n)
        self.register_buffer("offsets", torch.tensor(offsets))
        self.embedding = nn.Embedding(sum(head_sizes), head_dim)
        self.short_conv = DemoShortConv(hidden, kernel, dilation, hc_mult=hc_mult)
        self.value_proj = nn.Linear(d_mem, hidden)
        self.key_projs = nn.ModuleList([nn.Linear(d_mem, hidden) for _ in range(hc_mult)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(hidden) for _ in range(hc_mult)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(hidden) for _ in range(hc_mult)])

    def forward(self, hidden_states, hash_ids):
        embeddings = self.embedding(hash_ids + self.offsets).flatten(start_dim=-2)
        gates = []
        for i in range(self.hc_mult):
            normed_key = self.norm1[i](self.key_projs[i](embeddings))
            normed_query = self.norm2[i](hidden_states[:, :, i, :])
            gate = (normed_key * normed_query).sum(dim=-1) / math.sqrt(self.hidden)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gates.append(gate.sigmoid().unsqueeze(-1))
        gates = torch.stack(gates, dim=2)
        value = gates * self.value_proj(embeddings).unsqueeze(2)
        return value + self.short_conv(value)


# -- the module as plain ops, for torch.compile (--compile) ----------------------------------------
def plain_engram(e, w, bias, h, w1, w2, norm_w, conv_w, eps1, eps2, eps, dilation):
    """Y of the demo profile from gathered rows e [b, t, c] and hidden h [b, t, m, d]."""
    b, t, m, d = h.shape
    kv = F.linear(e, w, bias)  # [b, t, (m+1)*d]
    v, k = kv[..., :d], kv[..., d:].unflatten(-1, (m, d))

    def rms(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    s = (rms(k, eps1) * w1 * rms(h, eps2) * w2).sum(-1) / math.sqrt(d)  # [b, t, m]
    alpha = (s.abs().clamp_min(1e-6).sqrt() * s.sign()).sigmoid()
    vt = alpha.unsqueeze(-1) * v.unsqueeze(2)  # [b, t, m, d]
    ctx = (conv_w.shape[-1] - 1) * dilation
    xp = F.pad((rms(vt, eps) * norm_w).flatten(-2), (0, 0, ctx, 0))  # [b, ctx + t, m*d]
    y = sum(xp[:, j * dilation: j * dilation + t] * conv_w[:, 0, j]
            for j in range(conv_w.shape[-1]))
    return vt + F.silu(y).view(b, t, m, d)


def plain_args(mod, e, h):
    w, bias = mod.kv_weights()
    sc = mod.short_conv
    eps = [n.eps if n.eps is not None else torch.finfo(h.dtype).eps
           for n in (mod.norm1[0], mod.norm2[0], sc.norms[0])]
    return (e, w, bias, h, torch.stack([n.weight for n in mod.norm1]),
            torch.stack([n.weight for n in mod.norm2]), torch.stack([n.weight for n in sc.norms]),
            sc.conv.weight, *eps, sc.dilation)


# -- timing ---------------------------------------------------------------------------------------
def interleaved(fns: dict, rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each fn, calling them in turn each round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def build(args):
    cfg = EngramConfig.demo_v1(engram_vocab_size=[args.table_size] * (args.max_ngram - 1),
                               max_ngram_size=args.max_ngram, n_embed_per_ngram=args.d_ngram,
                               n_head_per_ngram=args.heads)
    lid = cfg.layer_ids[0]
    sizes = [p for order in prime_table_sizes(cfg)[lid] for p in order]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, n, (args.batch, args.seq), generator=g) for n in sizes], -1)
    torch.manual_seed(0)
    ours = build_engram(cfg, lid, args.hidden, args.hc_mult, conv_init="default", sparse=True)
    ours_dense = build_engram(cfg, lid, args.hidden, args.hc_mult, conv_init="default")
    ours_torch = build_engram(cfg, lid, args.hidden, args.hc_mult, conv_init="default", sparse=True)
    ours_torch.kernels = False
    demo = DemoEngram(sizes, cfg.head_dim, cfg.d_mem, args.hidden, args.hc_mult, cfg.kernel_size,
                      cfg.max_ngram_size)
    # The same weights everywhere, so all variants compute the same Y (checked below).
    ours_dense.load_state_dict(ours.state_dict())
    ours_torch.load_state_dict(ours.state_dict())
    sd = {k.replace("table.weight", "embedding.weight"): v for k, v in ours.state_dict().items()}
    demo.load_state_dict(sd, strict=False)
    demo.embedding.weight.data.copy_(ours.table.weight.data)
    demo_gemm = copy.deepcopy(demo)
    gemm.adopt(demo_gemm)
    return cfg, ids, {"demo": demo, "demo_gemm": demo_gemm, "ours": ours, "ours_dense": ours_dense,
                      "ours_torch": ours_torch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--hc_mult", type=int, default=4)
    ap.add_argument("--max_ngram", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d_ngram", type=int, default=512)
    ap.add_argument("--table_size", type=int, default=64_000, help="rows per head, before primes")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--decode_rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print and record a profile of ours")
    ap.add_argument("--no_allocator_env", action="store_true",
                    help="measure without compare's allocator settings")
    ap.add_argument("--compile", action="store_true",
                    help="also time a torch.compile'd plain-ops version (compile time recorded)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round each (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq, args.hidden, args.d_ngram, args.heads = 1, 16, 64, 32, 2
        args.table_size, args.rounds, args.warmup, args.decode_rounds = 500, 1, 0, 2
    if not args.no_allocator_env:
        with_allocator_env()
    torch.set_num_threads(args.threads)
    cfg, ids, mods = build(args)
    b, t, m, d = args.batch, args.seq, args.hc_mult, args.hidden
    h = torch.randn(b, t, m, d, requires_grad=True)
    gy = torch.randn(b, t, m, d)
    with torch.no_grad():
        ref = mods["demo"](h, ids)
        for k in ("demo_gemm", "ours", "ours_dense", "ours_torch"):
            torch.testing.assert_close(mods[k](h, ids), ref, rtol=1e-4, atol=1e-4)

    e = torch.randn(b, t, cfg.d_mem, requires_grad=True)  # the gathered rows, for GEMM-only
    w, bias = (x.detach().requires_grad_() for x in mods["ours"].kv_weights())

    mods["ours_mkl"] = mods["ours"]
    backends = {"ours_mkl": "torch"}  # the others: the backend in force

    def fwd_bwd(name):
        def fn():
            with gemm.using(backends.get(name)):
                mods[name](h, ids).backward(gy)
            mods[name].zero_grad(set_to_none=True)
            h.grad = None
        return fn

    def gemm_fwd_bwd(lin):
        def fn():
            lin(e, w, bias).backward(torch.ones(b, t, (m + 1) * d))
            e.grad = w.grad = bias.grad = None
        return fn

    def fwd(name):
        def fn():
            with torch.no_grad(), gemm.using(backends.get(name)):
                mods[name](h, ids)
        return fn

    def gemm_fwd(lin):
        def fn():
            with torch.no_grad():
                lin(e, w, bias)
        return fn

    lins = {"gemm": gemm.linear, "gemm_mkl": F.linear}
    train_fns = {k: fwd_bwd(k) for k in mods} | {k: gemm_fwd_bwd(v) for k, v in lins.items()}
    fwd_fns = {k: fwd(k) for k in mods} | {k: gemm_fwd(v) for k, v in lins.items()}
    compile_s = {}
    if args.compile:
        ours = mods["ours"]
        compiled = torch.compile(plain_engram, dynamic=False)

        def compiled_fwd_bwd():
            compiled(*plain_args(ours, ours.read(ids), h)).backward(gy)
            ours.zero_grad(set_to_none=True)
            h.grad = None

        def compiled_fwd():
            with torch.no_grad():
                compiled(*plain_args(ours, ours.read(ids), h))
        for name, fn in (("fwd_bwd", compiled_fwd_bwd), ("fwd", compiled_fwd)):
            t0 = time.perf_counter()
            fn()  # the first call compiles
            compile_s[name] = time.perf_counter() - t0
        with torch.no_grad():
            torch.testing.assert_close(compiled(*plain_args(ours, ours.read(ids), h)), ref,
                                       rtol=1e-4, atol=1e-4)
        train_fns["compiled"], fwd_fns["compiled"] = compiled_fwd_bwd, compiled_fwd
    load_before = os.getloadavg()
    tb = interleaved(train_fns, args.rounds, args.warmup)
    tf = interleaved(fwd_fns, args.rounds, args.warmup)
    n = b * t

    # Decode: one new position with the conv context carried in EngramState (no recompute).
    ours = mods["ours"]
    state = EngramState()
    with torch.no_grad():
        ours(h[:, :8].detach(), ids[:, :8], state=state)
        h1, i1 = h[:, 8:9].detach(), ids[:, 8:9]
        e1 = ours.read(i1)

        def decode():
            ours(h1, i1, state=EngramState(conv=state.conv))

        def decode_gemm():
            gemm.linear(e1, *ours.kv_weights())
        dec = interleaved({"ours": decode, "gemm": decode_gemm}, args.decode_rounds, 10)

    res = {
        "config": vars(args) | {"d_mem": cfg.d_mem, "table_rows": ours.table.num_rows},
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_ENV},
        "cpu": machine.cpu_id(), "gemm_backend": gemm.backend(),
        "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        "fwd_bwd_tokens_per_s": {k: n / v for k, v in tb.items()},
        "fwd_tokens_per_s": {k: n / v for k, v in tf.items()},
        "fwd_bwd_ours_over_demo": tb["demo"] / tb["ours"],
        "fwd_bwd_ours_time_over_gemm": tb["ours"] / tb["gemm"],
        "fwd_ours_over_demo": tf["demo"] / tf["ours"],
        "same_gemms_ours_over_demo": {"fwd_bwd": tb["demo_gemm"] / tb["ours"],
                                      "fwd": tf["demo_gemm"] / tf["ours"],
                                      "fwd_bwd_mkl": tb["demo"] / tb["ours_mkl"]},
        "fwd_ours_time_over_gemm": tf["ours"] / tf["gemm"],
        "kernels_speedup": {"fwd_bwd": tb["ours_torch"] / tb["ours"],
                            "fwd": tf["ours_torch"] / tf["ours"]},
        "gemm_route_speedup": {"fwd_bwd": tb["ours_mkl"] / tb["ours"],
                               "fwd": tf["ours_mkl"] / tf["ours"],
                               "gemm_alone_fwd_bwd": tb["gemm_mkl"] / tb["gemm"]},
        "decode_step_ms": {k: v * 1e3 for k, v in dec.items()},
        "goals": {"fwd_bwd_over_demo>=3": tb["demo"] / tb["ours"] >= 3,
                  "fwd_bwd_over_gemm<=1.3": tb["ours"] / tb["gemm"] <= 1.3,
                  "fwd_over_demo>=2": tf["demo"] / tf["ours"] >= 2},
    }
    if args.compile:
        res["compiled"] = {"compile_s": compile_s, "fwd_bwd_time_over_ours": tb["compiled"] / tb["ours"],
                           "fwd_time_over_ours": tf["compiled"] / tf["ours"],
                           "fwd_bwd_time_over_gemm": tb["compiled"] / tb["gemm"]}
    for k in tb:
        print(f"{k:>10}: fwd+bwd {n / tb[k]:8,.0f} tok/s   fwd {n / tf[k]:9,.0f} tok/s")
    if args.compile:
        c = res["compiled"]
        print(f"torch.compile: {c['compile_s']['fwd_bwd']:.0f} s + {c['compile_s']['fwd']:.0f} s to "
              f"compile; time / ours: fwd+bwd {c['fwd_bwd_time_over_ours']:.2f}x, fwd "
              f"{c['fwd_time_over_ours']:.2f}x")
    print(f"ours / demo port: fwd+bwd {res['fwd_bwd_ours_over_demo']:.2f}x (goal >= 3), fwd "
          f"{res['fwd_ours_over_demo']:.2f}x (goal >= 2); ours time / GEMMs alone: fwd+bwd "
          f"{res['fwd_bwd_ours_time_over_gemm']:.2f}x (goal <= 1.3), fwd "
          f"{res['fwd_ours_time_over_gemm']:.2f}x")
    sg = res["same_gemms_ours_over_demo"]
    print(f"ours / demo port at equal GEMMs: fwd+bwd {sg['fwd_bwd']:.2f}x (both on the GEMM route), "
          f"{sg['fwd_bwd_mkl']:.2f}x (both on MKL), fwd {sg['fwd']:.2f}x")
    print(f"compiled kernels vs the torch path (ours_torch): fwd+bwd "
          f"{res['kernels_speedup']['fwd_bwd']:.2f}x, fwd {res['kernels_speedup']['fwd']:.2f}x")
    print(f"GEMM route ({res['gemm_backend']}) vs F.linear (MKL): ours fwd+bwd "
          f"{res['gemm_route_speedup']['fwd_bwd']:.2f}x, fwd {res['gemm_route_speedup']['fwd']:.2f}x; "
          f"the GEMMs alone fwd+bwd {res['gemm_route_speedup']['gemm_alone_fwd_bwd']:.2f}x; CPU: "
          f"{res['cpu']}")
    print(f"decode step (t=1, batch {b}): ours {dec['ours'] * 1e3:.3f} ms, its GEMM alone "
          f"{dec['gemm'] * 1e3:.3f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                train_fns["ours"]()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(table)
        res["profile_ours_fwd_bwd_3_calls"] = table
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
