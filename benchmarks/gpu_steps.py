"""The steps of benchmarks/gpu_check.py: each takes its parsed arguments and returns its figures,
raising on a failed check (gpu_check.py records the error and goes on with the next step).

Shape legend (module step): b batch, t positions, m branches, d hidden size.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = [
    "tests/retrieval/test_hashing.py::test_same_on_cuda",
    "tests/tables/test_tiers.py::test_pinned_and_prefetch_deliver_rows_on_the_device",
    "tests/tables/test_prefetch.py::test_prefetch_to_cuda_from_host_and_device_pinned_tables"]
# With CUDA present these files run other code: a PinnedTable defaults to the device, and a
# process group picks its backend by the GPUs there are.
CUDA_AWARE_FILES = ["tests/tables/test_tiers.py", "tests/tables/test_prefetch.py",
                    "tests/serving/test_loader.py", "tests/serving/test_generate.py",
                    "tests/tables/test_sharded.py", "tests/training/test_distributed.py"]
# Seconds a step may take under --isolate (estimated H200 time x 3-10, covering a cold start)
LIMIT_S = {"hashing": 90, "module": 150, "train": 180, "precision": 300, "tiers": 120,
           "cuda_tests": 240, "ddp": 300, "sharded": 300}


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
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


# -- steps ----------------------------------------------------------------------------------------
def check_hashing(args) -> dict:
    from engram import EngramConfig, NgramHasher, build_compression
    from engram.training.corpus import DataConfig, build_corpus

    comp = build_compression()
    corpus = build_corpus(DataConfig(max_chars=200_000))
    n = 256 if args.quick else 1024
    x = torch.from_numpy(corpus.train[: 8 * n].astype("int64")).view(8, n)
    out = {}
    for name, cfg in (("demo-v1", EngramConfig.demo_v1()), ("v4.1", EngramConfig.v4_1())):
        h = NgramHasher(cfg, comp)
        cpu = h.hash(x)
        gpu = h.hash(x.to(args.device))
        same = all(torch.equal(cpu[k], gpu[k].cpu()) for k in cpu)
        if not same:
            raise AssertionError(f"{name}: CUDA hash ids differ from CPU")
        t = timed_cuda(lambda: h.hash(x.to(args.device)), repeat=10)
        out[name] = {"equal": same, "tokens_per_s_device": x.numel() / t}
    return out


def nrel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||, in float64 on the CPU (METHOD.md's measure)."""
    ref = ref.detach().cpu().double()
    return float((a.detach().cpu().double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _fwd_bwd(mod, h, ids, gy) -> dict[str, torch.Tensor]:
    """y, dh and every parameter's gradient (a sparse one as its coalesced values) of one call."""
    for p in mod.parameters():
        p.grad = None
    hh = h.to(mod.table.weight.device, mod.table.weight.dtype, copy=True).requires_grad_()
    y = mod(hh, ids.to(hh.device))
    y.backward(gy.to(hh.device, hh.dtype))
    grads = {n: p.grad.coalesce().values() if p.grad.is_sparse else p.grad
             for n, p in mod.named_parameters() if p.grad is not None}
    return {"y": y.detach(), "dh": hh.grad, **grads}


def check_module(args) -> dict:
    """Against a float64 CPU reference (the torch path): the demo gate's forward, and the gradients
    with the paper's plain sigmoid gate. The demo gate's signed square root clamps |s| at 1e-6, so
    its derivative jumps from 0 to 500 there: at the demo's shapes a few positions land on either
    side by rounding alone and dominate dh and the key gradients (measured on CPU, float32 vs
    float64: 1.4e-2; with the sigmoid gate 1.3e-6). Both gates run the same autograd Functions."""
    import copy

    from engram import EngramConfig, EngramState, build_engram
    from engram.retrieval.primes import prime_table_sizes

    cfg = EngramConfig.demo_v1(engram_vocab_size=[64_000, 64_000])
    lid = cfg.layer_ids[0]
    sizes = [p for order in prime_table_sizes(cfg)[lid] for p in order]
    b, t, m, d = (2, 64, 4, 256) if args.quick else (4, 512, 4, 1024)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, n, (b, t), generator=g) for n in sizes], -1)
    torch.manual_seed(0)
    base = build_engram(cfg, lid, d, m, conv_init="default", sparse=True)
    h, gy = torch.randn(b, t, m, d), torch.randn(b, t, m, d)
    ref = copy.deepcopy(base).double()  # float64 takes the torch path
    with torch.no_grad():
        y_demo = ref(h.double(), ids)
    ref.gate = "paper"
    want = _fwd_bwd(ref, h.double(), ids, gy)
    del ref
    out = {"shape_btmd": [b, t, m, d]}
    runs = [("cpu_float32", "cpu", torch.float32, 2e-3, 2e-3),
            ("float32", args.device, torch.float32, 2e-3, 2e-3),  # 2e-3: TF32 in cuDNN's conv
            ("bfloat16", args.device, torch.bfloat16, 5e-2, 1e-1)]
    for name, device, dtype, tol_y, tol_g in runs:
        dev = copy.deepcopy(base).to(device, dtype)
        dev.kernels = name != "cpu_float32"  # the baseline: torch's path, no numba compile
        idd = ids.to(device)
        with torch.no_grad():
            err_y = nrel(dev(h.to(device, dtype), idd), y_demo)
        dev.gate = "paper"
        errs = {k: nrel(v, want[k]) for k, v in _fwd_bwd(dev, h, ids, gy).items()}
        dev.gate = "demo"
        bad = {k: v for k, v in errs.items() if not v < tol_g}
        if not err_y < tol_y or bad:
            raise AssertionError(f"{name} on {device}: relative error y {err_y:.2e} (demo gate), "
                                 f"gradients over {tol_g:.0e} (sigmoid gate): {bad}")
        res = out[name] = {"rel_err_y": err_y, "rel_err_grad_max": max(errs.values()),
                           "rel_err_dh": errs["dh"], "rel_err_grads": errs}
        if name == "cpu_float32":
            continue
        hd = h.to(device, dtype, copy=True).requires_grad_()
        gyd = gy.to(device, dtype)

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
        res.update(fwd_bwd_tokens_per_s=b * t / timed_cuda(fwd_bwd, 10),
                   fwd_tokens_per_s=b * t / timed_cuda(fwd, 10),
                   decode_step_ms=timed_cuda(decode, 50) * 1e3)
    return out


def _on(tensors, device: str) -> bool:
    return all(x.device.type == device for x in tensors if isinstance(x, torch.Tensor))


def check_train(args) -> dict:
    from engram.studies.compare import CompareConfig, budget, variant_configs
    from engram.training.corpus import build_corpus
    from engram.training.train import TrainConfig, build_run, evaluate, train_step

    steps = 20 if args.quick else 60
    base = budget(TrainConfig(out_dir="/tmp/engram-gpu-check", eval_batches=4),
                  CompareConfig(steps=steps, eval_batches=4))
    corpus = build_corpus(base.data_config())
    configs = variant_configs(base, corpus.vocab_size)
    out = {}
    for name in ("dense", "engram", "moe"):
        cfg = configs[name]
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
            raise AssertionError(f"{name}: loss did not fall on {args.device}: {losses[0]:.3f} -> "
                                 f"{losses[-1]:.3f}")
        val = evaluate(run)
        # State is made lazily at the first step, after the model moved: it must follow the rows.
        states = [s for o in run.optim.optimizers for s in o.state.values()]
        if not math.isfinite(val) or not all(_on(s.values(), args.device) for s in states):
            raise AssertionError(f"{name}: val loss {val} / optimiser state off the device")
        tables = run.optim.tables
        out[name] = {"first_loss": losses[0], "last_loss": losses[-1], "val_loss": val,
                     "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(times[3:]),
                     "row_adam_kernel_steps": None if tables is None else tables.kernel_steps}
    for name in ("engram", "moe"):
        out[f"{name}_over_dense_tokens_per_s"] = (out[name]["tokens_per_s"]
                                                  / out["dense"]["tokens_per_s"])
    return out


def check_precision(args) -> dict:
    """``--precision bf16`` and ``--compile`` on the device: compare's Engram model trained the
    same steps from the same init in fp32, bf16 and bf16 compiled; losses fall and agree, the
    tables are bf16 on the device, RowAdam's and AdamW's state float32 on the device; tokens/s."""
    import dataclasses

    from engram.studies.compare import CompareConfig, budget, variant_configs
    from engram.tables.store import MemoryTable
    from engram.training.corpus import build_corpus
    from engram.training.train import (
        TrainConfig,
        build_run,
        evaluate,
        lr_at,
        train_step,
    )

    steps, warm = (12, 3) if args.quick else (40, 4)
    base = budget(TrainConfig(out_dir="/tmp/engram-gpu-check", eval_batches=4,
                              device=args.device), CompareConfig(steps=steps, eval_batches=4))
    if args.quick and args.device == "cpu":  # the rehearsal: a small model compiles in seconds
        base = dataclasses.replace(base, n_layer=2, d_model=64, seq_len=64, batch_size=8,
                                   max_chars=300_000, table_size=4_000)
    corpus = build_corpus(base.data_config())
    eng = variant_configs(base, corpus.vocab_size)["engram"]
    runs = {"fp32": dataclasses.replace(eng, precision="fp32"),
            "bf16": dataclasses.replace(eng, precision="bf16"),
            "bf16_compiled": dataclasses.replace(eng, precision="bf16", compile=True)}
    out = {}
    for name, cfg in runs.items():
        run = build_run(cfg, corpus)
        losses, times = [], []
        for i in range(steps):
            run.step = i
            run.optim.set_lr(lr_at(i, cfg))
            sync()
            t0 = time.perf_counter()
            losses.append(train_step(run))
            sync()
            times.append(time.perf_counter() - t0)
        val = evaluate(run)
        tables = [m.weight for m in run.model.modules() if isinstance(m, MemoryTable)]
        want = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        states = [v for o in run.optim.optimizers for st in o.state.values() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step"]
        if not all(math.isfinite(x) for x in [*losses, val]) or not losses[-1] < losses[0] - 0.5:
            raise AssertionError(f"{name}: loss did not fall on {args.device}: {losses}")
        if not tables or any(t.dtype != want or t.device.type != args.device for t in tables):
            raise AssertionError(f"{name}: tables {[(t.dtype, t.device) for t in tables]}")
        if any(v.dtype != torch.float32 or v.device.type != args.device for v in states):
            raise AssertionError(f"{name}: optimiser state not float32 on {args.device}")
        out[name] = {"first_loss": losses[0], "last_loss": losses[-1], "val_loss": val,
                     "first_step_s": times[0],
                     "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(times[warm:])}
    for name in ("bf16", "bf16_compiled"):
        # bf16 tracks fp32 (CPU, tests/training/test_precision.py: within 1e-2 nats over 40
        # steps of a tiny model); here a 5x looser bound for the larger model and the GPU kernels.
        gap = abs(out[name]["val_loss"] - out["fp32"]["val_loss"])
        out[f"{name}_val_gap"] = gap
        out[f"{name}_over_fp32_tokens_per_s"] = (out[name]["tokens_per_s"]
                                                 / out["fp32"]["tokens_per_s"])
        if not gap < 0.05:
            raise AssertionError(f"{name} validation loss {out[name]['val_loss']:.4f} is {gap:.4f} "
                                 f"from fp32's {out['fp32']['val_loss']:.4f}")
    return out


def check_ddp(args) -> dict:
    """``engram train`` under torchrun, one rank per GPU (NCCL), bf16 (and compiled, without
    --quick), sharded tables; on the CPU rehearsal 2 ranks over gloo. Skipped with one GPU."""
    n = torch.cuda.device_count() if args.device == "cuda" else 2
    if n < 2:
        return {"skipped": f"{n} GPU visible; a DDP step over NCCL needs 2 or more"}
    world = min(n, 8)
    out = Path(tempfile.mkdtemp()) / "ddp"
    steps = 6 if args.quick else 20
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "engram", "train", f"--out_dir={out}",
           f"--device={args.device}", "--precision=bf16", f"--steps={steps}", "--warmup=2",
           f"--batch_size={4 * world}", f"--eval_every={steps}", f"--ckpt_every={steps}",
           "--log_every=1", *([] if args.quick else ["--compile"]),
           *(["--n_layer=2", "--d_model=64", "--seq_len=64", "--max_chars=300000",
              "--table_size=4000"] if args.device == "cpu" else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S["ddp"],
                       env=_env())
    if p.returncode != 0:
        raise AssertionError(f"torchrun failed (rc {p.returncode}):\n"
                             f"{(p.stdout + p.stderr)[-3000:]}")
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((out / "config.json").read_text())
    losses = [r["loss"] for r in rec]
    if (len(rec) != steps or not all(math.isfinite(x) for x in losses)
            or cfg.get("world_size") != world or cfg["precision"] != "bf16"):
        raise AssertionError(f"torchrun run: {len(rec)} records, losses {losses}, config {cfg}")
    last = json.loads(p.stdout.strip().splitlines()[-1])
    return {"world": world, "backend": "nccl" if args.device == "cuda" else "gloo",
            "compile": not args.quick, "first_loss": losses[0], "last_loss": losses[-1],
            "val_loss": rec[-1].get("val_loss"), "tok_s": last.get("tok_s"),
            "seconds_with_start": time.perf_counter() - t0}


def check_tiers(args) -> dict:
    from engram.tables.cache import CachedTable
    from engram.tables.prefetch import PrefetchTable
    from engram.tables.store import MemoryTable
    from engram.tables.host import PinnedTable

    torch.manual_seed(0)
    rows_n, dim = (100_000, 64) if args.quick else (2_000_000, 64)
    weight = MemoryTable(rows_n, dim).weight.detach()
    on_gpu = weight.to(args.device)
    host = PinnedTable(weight, device="cpu")  # pinned with CUDA: the prefetcher's DMA source
    pinned = PinnedTable(weight, device=args.device)
    pre = {"prefetch_side_stream": PrefetchTable(host, device=args.device),
           "prefetch_cached": PrefetchTable(CachedTable(host, rows_n // 20, device=args.device),
                                            device=args.device),
           "prefetch_device_pinned": PrefetchTable(pinned, device=args.device)}
    batches = [torch.randint(0, rows_n, (8, 512, 16)) for _ in range(12)]
    for r in batches[:2]:
        if not torch.equal(pinned.lookup(r).cpu(), weight[r]):
            raise AssertionError("pinned table rows differ from in-memory")

    def on_gpu_lookup(r):
        return torch.nn.functional.embedding(r.to(args.device, non_blocking=True), on_gpu)

    def loop(lookup, prefetch=None, check=False):
        def fn():
            if prefetch:
                prefetch(batches[0])
            for i, r in enumerate(batches):
                if prefetch and i + 1 < len(batches):
                    prefetch(batches[i + 1])  # the next batch's rows, while this one runs
                got = lookup(r)
                # on the device, right after the lookup: a copy not waited for shows here
                if check and not torch.equal(got, on_gpu_lookup(r)):
                    raise AssertionError(f"batch {i}: rows differ from the in-memory table")
                got.sum()
        return fn

    n = len(batches)
    ms = {"in_memory_cuda": timed_cuda(loop(on_gpu_lookup), 5, 1) / n * 1e3,
          "pinned_host": timed_cuda(loop(pinned.lookup), 5, 1) / n * 1e3}
    stats = {}
    for name, table in pre.items():
        loop(table.lookup, table.prefetch, check=True)()
        ms[name] = timed_cuda(loop(table.lookup, table.prefetch), 5, 1) / n * 1e3
        s = table.stats
        stats[name] = {"used": s.used, "sync": s.sync, "inline": s.inline, "wait_s": s.wait_s}
        table.close()
    return {"rows": rows_n, "dim": dim, "rows_per_batch": batches[0].numel(), "lookup_ms": ms,
            "prefetch_stats": stats}


def check_cuda_tests(args) -> dict:
    xml = Path(tempfile.mkdtemp()) / "junit.xml"
    alone = [c for c in CUDA_TESTS if c.split("::")[0] not in CUDA_AWARE_FILES]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *alone, *CUDA_AWARE_FILES]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S["cuda_tests"],
                       env=_env())
    tail = (p.stdout + p.stderr)[-3000:]
    if not xml.exists():
        raise AssertionError(f"pytest wrote no report (rc {p.returncode}):\n{tail}")
    failed, skipped, names = [], [], set()
    cases = list(ET.parse(xml).iter("testcase"))
    for case in cases:
        names.add(case.get("name").split("[")[0])
        node = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(node)
        elif case.find("skipped") is not None:
            skipped.append(node)
    marked = {c.split("::")[1] for c in CUDA_TESTS}
    cuda_skipped = [s for s in skipped if s.split("::")[1].split("[")[0] in marked]
    res = {"summary": (p.stdout.strip().splitlines() or [""])[-1], "tests": len(cases),
           "failed": failed, "skipped": skipped}
    if (failed or p.returncode not in (0, 1) or marked - names
            or (cuda_skipped and args.device == "cuda")):
        raise AssertionError(f"CUDA tests: {len(failed)} failed {failed}, CUDA-marked skipped "
                             f"{cuda_skipped}, not found {sorted(marked - names)} "
                             f"(rc {p.returncode}):\n{tail}")
    return res


def check_sharded(args) -> dict:
    n = torch.cuda.device_count()
    if n < 2 or args.device != "cuda":
        return {"skipped": f"{n} GPU visible; NCCL sharding needs 2 or more"}
    out = Path(tempfile.mkdtemp()) / "sharded.json"
    cmd = [sys.executable, "benchmarks/sharded.py", "--world", str(min(n, 8)), "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S["sharded"],
                       env=_env())
    if p.returncode != 0:
        raise AssertionError(f"sharded benchmark failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(out.read_text())


STEPS = {"hashing": check_hashing, "module": check_module, "train": check_train,
         "precision": check_precision, "tiers": check_tiers, "cuda_tests": check_cuda_tests,
         "ddp": check_ddp, "sharded": check_sharded}
