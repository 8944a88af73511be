"""One prepared check for a lent CUDA machine (never in CI; no GPU on the development machine).

    python benchmarks/gpu_check.py --json benchmarks/results/gpu/check.json

Runs, each as one step that records pass/fail, its time and figures (a failing step does not stop
the others; the exit status is 1 if any failed):

1. ``cuda_tests``: the CUDA-marked tests (pytest -k on the tests that skip without CUDA).
2. ``hashing``: NgramHasher on CUDA == on CPU (demo-v1 and v4.1 profiles, a real corpus batch).
3. ``module``: the Engram module at the demo's shapes on CUDA (fp32 and bf16): forward+backward
   == CPU within tolerance, fused gradients == plain autograd, tokens/s; decode step latency.
4. ``train``: a short training run of the compare-size Engram model on CUDA: loss falls, tokens/s.
5. ``tiers``: a pinned host table and a side-stream prefetch vs an in-memory CUDA table: same rows,
   lookup latency.
6. ``sharded``: the NCCL sharded lookup (benchmarks/sharded.py) when more than one GPU is visible.

Sized to finish in a few minutes on one H200 (``--quick`` for less). Without CUDA it says so and
exits 2 after writing the JSON (``{"cuda": false, ...}``), so a scripted run fails clearly.
``--device cpu --quick`` runs the same steps' logic on the CPU at small sizes (how the script itself
is tested without a GPU; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = ["tests/retrieval/test_hashing.py::test_same_on_cuda",
              "tests/tables/test_tiers.py::test_pinned_and_prefetch_deliver_rows_on_the_device"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_cuda(fn, repeat: int, warmup: int = 3) -> float:
    """Median seconds per call, synchronising around each."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _env() -> dict:
    import os
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


# -- steps ----------------------------------------------------------------------------------------
def check_cuda_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", *CUDA_TESTS]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    tail = (p.stdout + p.stderr)[-3000:]
    if p.returncode != 0 or "skipped" in p.stdout.splitlines()[-1]:
        raise AssertionError(f"CUDA tests failed or skipped (rc {p.returncode}):\n{tail}")
    return {"tests": CUDA_TESTS, "summary": p.stdout.strip().splitlines()[-1]}


def check_hashing(args) -> dict:
    from engram import EngramConfig, NgramHasher, build_compression
    from engram.training.corpus import DataConfig, build_corpus

    comp = build_compression()
    corpus = build_corpus(DataConfig(max_chars=200_000))
    n = 256 if args.quick else 1024
    x = torch.from_numpy(corpus.train[: 8 * n].astype("int64")).view(8, n)
    out = {}
    for name, cfg in (("demo-v1", EngramConfig.demo_v1()),
                      ("v4.1", EngramConfig.v4_1())):
        h = NgramHasher(cfg, comp)
        cpu = h.hash(x)
        gpu = h.hash(x.to(args.device))
        same = all(torch.equal(cpu[k], gpu[k].cpu()) for k in cpu)
        if not same:
            raise AssertionError(f"{name}: CUDA hash ids differ from CPU")
        t = timed_cuda(lambda: h.hash(x.to(args.device)), repeat=10)
        out[name] = {"equal": same, "tokens_per_s_device": x.numel() / t}
    return out


def check_module(args) -> dict:
    from engram import EngramConfig, EngramState, build_engram
    from engram.retrieval.primes import prime_table_sizes

    cfg = EngramConfig.demo_v1(engram_vocab_size=[64_000, 64_000])
    lid = cfg.layer_ids[0]
    sizes = [p for order in prime_table_sizes(cfg)[lid] for p in order]
    b, t, m, d = (2, 64, 4, 256) if args.quick else (4, 512, 4, 1024)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, n, (b, t), generator=g) for n in sizes], -1)
    torch.manual_seed(0)
    cpu = build_engram(cfg, lid, d, m, conv_init="default", sparse=True)
    h = torch.randn(b, t, m, d)
    gy = torch.randn(b, t, m, d)
    hc = h.clone().requires_grad_()
    cpu(hc, ids).backward(gy)
    out = {}
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2)):
        dev = build_engram(cfg, lid, d, m, conv_init="default", sparse=True)
        dev.load_state_dict(cpu.state_dict())
        dev = dev.to(args.device, dtype)
        hd = h.to(args.device, dtype, copy=True).requires_grad_()  # a leaf of its own
        idd, gyd = ids.to(args.device), gy.to(args.device, dtype)
        y = dev(hd, idd)
        y.backward(gyd)
        with torch.no_grad():
            ref = cpu(h, ids)
        err = float((y.detach().float().cpu() - ref).abs().max() / ref.abs().max())
        gerr = float((hd.grad.float().cpu() - hc.grad).abs().max() / hc.grad.abs().max())
        # The demo gate's signed square root has an unbounded derivative at s = 0, so in bf16 dh
        # is far from fp32 in plain autograd too (measured on CPU: 0.98 plain, 0.58 ours): bf16 dh
        # is recorded, not checked.
        if not (err < tol and (dtype == torch.bfloat16 or gerr < tol * 5)):
            raise AssertionError(f"{dtype}: CUDA vs CPU relative error y {err:.2e}, dh {gerr:.2e}")

        def fwd_bwd():
            hd.grad = None
            dev(hd, idd).backward(gyd)
            dev.zero_grad(set_to_none=True)

        def fwd():
            with torch.no_grad():
                dev(hd, idd)
        st = EngramState()
        with torch.no_grad():
            dev(hd[:, :8], idd[:, :8], state=st)

        def decode():
            with torch.no_grad():
                dev(hd[:, 8:9], idd[:, 8:9], state=EngramState(conv=st.conv))
        tb, tf = timed_cuda(fwd_bwd, 10), timed_cuda(fwd, 10)
        out[str(dtype).split(".")[-1]] = {
            "rel_err_y": err, "rel_err_dh": gerr, "fwd_bwd_tokens_per_s": b * t / tb,
            "fwd_tokens_per_s": b * t / tf, "decode_step_ms": timed_cuda(decode, 50) * 1e3}
    return out


def check_train(args) -> dict:
    from engram.studies.compare import CompareConfig, budget, variant_configs
    from engram.training.corpus import build_corpus
    from engram.training.train import TrainConfig, build_run, train_step

    steps = 20 if args.quick else 60
    base = budget(TrainConfig(out_dir="/tmp/engram-gpu-check"), CompareConfig(steps=steps))
    corpus = build_corpus(base.data_config())
    out = {}
    for name in ("dense", "engram"):
        cfg = variant_configs(base, corpus.vocab_size)[name]
        run = build_run(cfg, corpus)
        run.model.to(args.device)
        losses, times = [], []
        for i in range(steps):
            run.step = i
            run.optim.set_lr(cfg.lr)
            sync()
            t0 = time.perf_counter()
            losses.append(train_step(run))
            sync()
            times.append(time.perf_counter() - t0)
        if not all(math.isfinite(x) for x in losses) or not losses[-1] < losses[0] - 0.5:
            raise AssertionError(f"{name}: loss did not fall on CUDA: {losses[0]:.3f} -> "
                                 f"{losses[-1]:.3f}")
        out[name] = {"first_loss": losses[0], "last_loss": losses[-1], "tokens_per_s":
                     cfg.batch_size * cfg.seq_len / statistics.median(times[3:])}
    out["engram_over_dense_tokens_per_s"] = (out["engram"]["tokens_per_s"]
                                             / out["dense"]["tokens_per_s"])
    return out


def check_tiers(args) -> dict:
    from engram.tables.prefetch import PrefetchTable
    from engram.tables.store import MemoryTable
    from engram.tables.tiers import PinnedTable

    torch.manual_seed(0)
    rows_n, dim = (100_000, 64) if args.quick else (2_000_000, 64)
    mem = MemoryTable(rows_n, dim)
    weight = mem.weight.detach()
    on_gpu = weight.to(args.device)
    pinned = PinnedTable(weight, device=args.device)
    pre = PrefetchTable(PinnedTable(weight, device="cpu"), device=args.device)
    batches = [torch.randint(0, rows_n, (8, 512, 16)) for _ in range(12)]
    for r in batches[:2]:
        want = weight[r]
        if not torch.equal(pinned.lookup(r).cpu(), want):
            raise AssertionError("pinned table rows differ from in-memory")
        pre.prefetch(r)
        if not torch.equal(pre.lookup(r).cpu(), want):
            raise AssertionError("prefetched rows differ from in-memory")

    def loop(lookup, prefetch=None):
        def fn():
            if prefetch:
                prefetch(batches[0])
            for i, r in enumerate(batches):
                if prefetch and i + 1 < len(batches):
                    prefetch(batches[i + 1])  # the next batch's rows, while this one runs
                lookup(r.to(args.device, non_blocking=True) if lookup is on_gpu_lookup else r).sum()
        return fn

    def on_gpu_lookup(r):
        return torch.nn.functional.embedding(r, on_gpu)
    t_mem = timed_cuda(loop(on_gpu_lookup), 5, 1)
    t_pin = timed_cuda(loop(pinned.lookup), 5, 1)
    t_pre = timed_cuda(loop(pre.lookup, pre.prefetch), 5, 1)
    n = len(batches)
    return {"rows": rows_n, "dim": dim, "lookup_ms": {"in_memory_cuda": t_mem / n * 1e3,
            "pinned_host": t_pin / n * 1e3, "prefetch_side_stream": t_pre / n * 1e3},
            "prefetch_used": pre.stats.used}


def check_sharded(args) -> dict:
    n = torch.cuda.device_count()
    if n < 2 or args.device != "cuda":
        return {"skipped": f"{n} GPU visible; NCCL sharding needs 2 or more"}
    out = Path("/tmp/engram-gpu-sharded.json")
    cmd = [sys.executable, "benchmarks/sharded.py", "--world", str(min(n, 8)), "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    if p.returncode != 0:
        raise AssertionError(f"sharded benchmark failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(out.read_text())


STEPS = {"cuda_tests": check_cuda_tests, "hashing": check_hashing, "module": check_module,
         "train": check_train, "tiers": check_tiers, "sharded": check_sharded}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--only", default=",".join(STEPS), help="comma-separated steps to run")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, a shorter training run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: test this script's logic without a GPU (figures mean nothing)")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        ap.error(f"unknown steps {unknown}; choose from {list(STEPS)}")
    res = {"cuda": torch.cuda.is_available(), "torch": torch.__version__,
           "python": platform.python_version(), "steps": {}}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not res["cuda"]:
        res["error"] = "no CUDA device: this check needs a GPU (torch.cuda.is_available() is False)"
        path.write_text(json.dumps(res, indent=2))
        print(res["error"], file=sys.stderr)
        return 2
    res["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    res["device_count"] = torch.cuda.device_count()
    sys.path.insert(0, str(ROOT / "src"))
    t_all = time.perf_counter()
    for name in only:
        t0 = time.perf_counter()
        try:
            out = {"ok": True, **STEPS[name](args)}
        except Exception as e:  # one failing step must not hide the others' results
            out = {"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        out["seconds"] = time.perf_counter() - t0
        res["steps"][name] = out
        print(f"{name:>10}: {'ok' if out['ok'] else 'FAILED'} ({out['seconds']:.1f} s)"
              + ("" if out["ok"] else f"  {out['error']}"), flush=True)
        path.write_text(json.dumps(res, indent=2))  # partial results survive a timeout
    res["seconds"] = time.perf_counter() - t_all
    res["ok"] = all(s["ok"] for s in res["steps"].values())
    path.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
