"""Dense float32 matrix multiplies on CPU: torch's BLAS (MKL) or oneDNN, whichever this machine
runs faster at each shape, measured once.

torch's CPU wheel multiplies float32 matrices with MKL, which dispatches its fast kernels by CPU
vendor; oneDNN ships in the same wheel. Neither wins everywhere: on an AMD EPYC (Zen 5, AVX-512)
oneDNN ran 1.45-2.5x faster on one thread at every shape this package trains with, on another
(Zen 3, AVX2) it was the slower one (training at 0.91x MKL's tokens/s). So the route is timed, not
read off the vendor: ``linear`` sends a float32 CPU product to oneDNN, forward and backward, where
its shape bucket's route says so, and to ``F.linear`` otherwise.

Backends (``ENGRAM_GEMM`` or ``set_backend``): ``auto`` (the default: measured), ``torch``
(always ``F.linear``), ``onednn`` (oneDNN for every product of at least ``MIN_MACS``
multiply-adds). Under ``auto`` a shape bucket's route is decided on its first product (or ahead,
``prepare``) by a short timing (``measure``, ~0.1 s) of its forward and both backward
products on both backends, interleaved, each product's fastest sample; oneDNN only where it is at
least ``MARGIN`` faster, else torch's own default. The decision is then fixed for the process and
kept in a JSON file in the user's cache (``gemm_decisions.cache_path``; keyed by CPU, torch
version, thread count and bucket): later runs on this machine reuse it, so they repeat bit for
bit. It is also exported in ``ENGRAM_GEMM_ROUTES``, so spawned workers take their parent's
decisions; one no process has made yet is measured by one process at a time under a file lock, and
the others read it. A decision measured while the machine was busy (load average above its cores)
is used, and marked: the first process that finds the machine quiet measures it again. With no
writable cache (nor temp dir) the decisions live in the process.

So the cache's decisions change with the machine's history, and with them a product's summation
order. A training run therefore keeps the routes its products took (``record``: the buckets this
process routed, bucket -> route) and puts them back on resume before any product runs
(``install``, or ``pinned`` for a block; training/settings.py): those buckets then take the
recorded route whatever the cache now says. ``ENGRAM_GEMM`` = torch / onednn still overrides them.

Results agree with MKL's to float32 rounding (summation order differs), not to the bit; oneDNN's
are bit-identical from call to call, and on 1 or 2 threads on the AMD EPYC measured (tested).

Shape legend:
    n rows (tokens: every leading dimension of x flattened), i in features, o out features.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import gemm_decisions as decisions
from .machine import cpu_id

BACKENDS = ("auto", "torch", "onednn")
# Under ~2M multiply-adds (a decode step's few rows) a product takes tens of microseconds either
# way and oneDNN's per-call cost outweighs its faster loops (8 x 128 x 384 ran at 0.66x MKL's
# speed on the Zen 5): torch's, unmeasured (a decode would otherwise time a bucket per length).
MIN_MACS = 1 << 21
MARGIN = 1.10  # oneDNN / torch speed needed to leave torch's default (noise is ~5% here)
MEASURE_MACS = 1 << 25  # a timed product's size: a bucket's rows are capped to fit it ...
MEASURE_ROWS = 64  # ... but not below this many rows (the per-row regime, not a decode's)
ROUNDS = 11  # interleaved samples of each product per decision, at most ...
MEASURE_S = 0.1  # ... while they take under this many seconds (at least 5)
ROUTES_ENV = "ENGRAM_GEMM_ROUTES"  # the decisions, handed to spawned workers

_chosen: str | None = None  # set_backend's choice or ENGRAM_GEMM's, read once
_table: dict[str, str] = {}  # bucket key -> 'torch' / 'onednn', fixed once decided
_loaded = False  # _table holds ENGRAM_GEMM_ROUTES' and the cache file's decisions
_mine: set[str] = set()  # buckets this process's products took under 'auto', or installed: record()


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"GEMM backend must be one of {BACKENDS}, got {name!r} "
                         "(set by ENGRAM_GEMM or engram.compute.gemm.set_backend)")
    if name == "onednn" and not _onednn_available():
        raise RuntimeError("GEMM backend 'onednn': this torch build has no oneDNN "
                           "(torch.backends.mkldnn.is_available() is False)")
    return name


def backend() -> str:
    """The backend in force: 'auto' (measured per shape), 'torch' or 'onednn' (recorded with
    runs and benchmarks; ``routes`` says what 'auto' decided)."""
    global _chosen
    if _chosen is None:
        _chosen = _check(os.environ.get("ENGRAM_GEMM", "auto"))
    return _chosen


def set_backend(name: str | None) -> str | None:
    """Choose the backend for this process ('auto', 'torch', 'onednn'; None: ENGRAM_GEMM's);
    returns the previous choice."""
    global _chosen
    previous, _chosen = _chosen, None if name is None else _check(name)
    return previous


@contextlib.contextmanager
def using(name: str | None):
    """The backend ``name`` inside the block (benchmarks and tests compare the two); None leaves
    the backend as it is."""
    if name is None:
        yield
        return
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def resolve() -> str:
    """At a job's start: read ENGRAM_GEMM (a bad name fails here, not at the first product) and the
    decisions already made on this machine; returns the backend."""
    name = backend()
    _load()
    return name


# -- the measured route ---------------------------------------------------------------------------

def _pow2(x: int) -> int:
    """The power of two nearest x on a log scale (x in [0.71, 1.41) times it)."""
    p = 1 << (max(x, 1).bit_length() - 1)
    return 2 * p if x * x >= 2 * p * p else p


def _shape(n: int, i: int, o: int) -> tuple[int, int, int]:
    """The bucket's shape (the one timed): each size rounded to the nearest power of two (a
    product just over MIN_MACS is timed near its own size, not at half of it), rows capped where
    the product would pass MEASURE_MACS (the speed ratio has levelled off there)."""
    i, o = _pow2(i), _pow2(o)
    return min(_pow2(n), max(MEASURE_ROWS, _pow2(MEASURE_MACS // (i * o)))), i, o


def bucket(n: int, i: int, o: int) -> str:
    """The bucket of an n x i -> o product on the current thread count, e.g. '1t 1024x128x256'."""
    return "{}t {}x{}x{}".format(torch.get_num_threads(), *_shape(n, i, o))


@functools.cache
def _machine() -> str:
    return f"{cpu_id()} | torch {torch.__version__}"


def _load() -> None:
    """Once per process: the parent's decisions (ENGRAM_GEMM_ROUTES), else the cache file's; all
    handed on to this process's workers."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        env = json.loads(os.environ.get(ROUTES_ENV) or "{}")
        inherited = env.get("routes", {}) if env.get("machine") == _machine() else {}
    except (ValueError, AttributeError):
        inherited = {}
    quiet = not _busy()
    for path in decisions.paths():
        for key, rec in decisions.read(path, _machine()).items():
            if _usable(rec, quiet):
                _table.setdefault(key, rec["route"])
    _table.update({k: v for k, v in inherited.items() if v in ("torch", "onednn")})
    if _table:
        _export()


def _busy() -> bool:
    """More runnable processes than cores (the 1-minute load average): a timing then measures the
    contention as much as the backends (two oneDNN threads waiting on a descheduled one ran 18x
    slower than MKL here on 2 busy cores, at a shape where they are 2.1x faster alone)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return False


def _usable(rec: object, quiet: bool) -> bool:
    """A cached decision is taken as it is, except one measured on a busy machine once the machine
    is quiet: that one is measured again (and replaced), so contention is never kept for good."""
    return (isinstance(rec, dict) and rec.get("route") in ("torch", "onednn")
            and not (rec.get("busy") and quiet))


def _export() -> None:
    os.environ[ROUTES_ENV] = json.dumps({"machine": _machine(), "routes": _table},
                                        separators=(",", ":"))


def measure(n: int, i: int, o: int, rounds: int = ROUNDS) -> dict:
    """Time the three products of an n x i -> o layer (y = x W^T, dX = dY W, dW = dY^T X) through
    torch and through oneDNN on the current thread count. Rounds (5 to ``rounds``, ~MEASURE_S)
    interleave the backends, in alternating order; each product's time is its fastest sample (of
    ~0.2 ms where the product is shorter): load from other processes only ever adds time, and on
    a shared machine it adds a lot (medians moved 5x between runs at a load of 8 on 2 cores, the
    fastest samples 5%). Random inputs from a private generator: the global RNG (and so a seeded
    run) is untouched."""
    g = torch.Generator().manual_seed(0)
    x, w, gy = (torch.randn(*s, generator=g) for s in ((n, i), (o, i), (n, o)))
    products = {"torch": (lambda: F.linear(x, w), lambda: gy.mm(w), lambda: gy.t().mm(x)),
                "onednn": (lambda: _mm(x, w), lambda: _mm(gy, w.t()), lambda: _grad_weight(gy, x))}

    def clock(fn, reps):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    with torch.no_grad():
        reps, best = {}, {}
        for name, fns in products.items():  # warm (oneDNN builds its primitives) and size
            for j, fn in enumerate(fns):
                fn()
                best[name, j] = clock(fn, 1)
                reps[name, j] = max(1, min(64, round(2e-4 / max(best[name, j], 1e-7))))
        t0 = time.perf_counter()
        for r in range(rounds):  # at least 5, and no more once MEASURE_S has passed
            if r >= 5 and time.perf_counter() - t0 > MEASURE_S:
                break
            for name in ("torch", "onednn")[:: 1 if r % 2 else -1]:
                for j, fn in enumerate(products[name]):
                    best[name, j] = min(best[name, j], clock(fn, reps[name, j]))
    t = {name: sum(best[name, j] for j in range(3)) for name in products}
    ratio = t["torch"] / t["onednn"]
    return {"route": "onednn" if ratio >= MARGIN else "torch", "onednn_speedup": round(ratio, 3),
            "torch_ms": round(t["torch"] * 1e3, 4), "onednn_ms": round(t["onednn"] * 1e3, 4)}


def _decide(n: int, i: int, o: int) -> str:
    _load()
    key = bucket(n, i, o)
    if key not in _table:
        with decisions.locked() as path:
            # decided meanwhile by another process?
            rec = decisions.read(path, _machine()).get(key) if path else None
            busy = _busy()
            if not _usable(rec, not busy):
                rec = {**measure(*_shape(n, i, o)), "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "busy": busy}
                if path is not None:
                    with contextlib.suppress(OSError):
                        decisions.write(path, _machine(), key, rec)
        _table[key] = rec["route"]
        _export()
    _mine.add(key)
    return _table[key]


def route(n: int, i: int, o: int) -> str:
    """'torch' or 'onednn': where an n x i -> o float32 CPU product goes on the current thread
    count (a bucket's first call under 'auto' measures it; decided once, then fixed)."""
    name = backend()
    if name == "torch" or n * i * o < MIN_MACS or not _onednn_available():
        return "torch"
    return "onednn" if name == "onednn" else _decide(n, i, o)


def routes() -> dict[str, str]:
    """The decisions this process knows, bucket -> route (recorded beside results)."""
    _load()
    return dict(sorted(_table.items()))


def used() -> dict[str, str]:
    """The routes this process's products took under 'auto' (bucket -> route, ``prepare``'s
    included) and those ``install`` fixed: what a run records to take them again."""
    return {k: _table[k] for k in sorted(_mine) if k in _table}


def record() -> dict:
    """A run's record of its products' routes: the backend in force, this machine, ``used``."""
    return {"backend": backend(), "machine": _machine(), "routes": used()}


def install(routes: dict[str, str]) -> None:
    """Fix the route of each bucket in ``routes`` (bucket -> 'torch' / 'onednn') for this process,
    whatever the cache file or a parent process decided: a run's recorded routes, put back so a
    resumed run takes the summation order it took before. Handed on to workers like a measured
    decision; the cache file is left as it is. Other buckets are decided as before."""
    bad = {k: v for k, v in routes.items() if v not in ("torch", "onednn")}
    if bad:
        raise ValueError(f"GEMM routes must be 'torch' or 'onednn', got {bad}")
    _load()  # later loads would not override these: _load runs once
    _table.update(routes)
    _mine.update(routes)
    _export()


def reuse(rec: dict | None) -> bool:
    """``install`` a run's ``record`` when it was made on this machine (CPU and torch
    version: elsewhere its timings say nothing, and the bits differ anyway); returns whether."""
    if not rec or rec.get("machine") != _machine() or not isinstance(rec.get("routes"), dict):
        return False
    install(rec["routes"])
    return True


@contextlib.contextmanager
def pinned(routes: dict[str, str]):
    """``install`` ``routes`` inside the block; the process's decisions as they were after."""
    _load()
    table, mine = dict(_table), set(_mine)
    install(routes)
    try:
        yield
    finally:
        _table.clear()
        _table.update(table)
        _mine.clear()
        _mine.update(mine)
        _export()


def prepare(module: nn.Module, rows: Iterable[int]) -> dict[str, str]:
    """At model build: decide the route of every ``Linear`` in ``module`` at each row count in
    ``rows`` (tokens per forward: batch x sequence) on the current thread count, so no forward
    measures; products sized by the data (MoE experts, adaptive-softmax tails) are decided on
    first use. A parent calls this before spawning workers with the workers' thread count set;
    they inherit the decisions. Returns them, bucket -> route."""
    rows = list(rows)
    done = {}
    for m in module.modules():
        if isinstance(m, Linear):
            for n in rows:
                if n * m.in_features * m.out_features >= MIN_MACS:
                    done[bucket(n, m.in_features, m.out_features)] = route(
                        n, m.in_features, m.out_features)
    return done


# -- the products ---------------------------------------------------------------------------------

def _routes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False  # F.linear handles (or refuses) the rest
    if not all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
               for t in (x, weight, bias)):
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False  # autocast's products, and a compiled graph's (the compiler picks its own)
    return route(x.shape[:-1].numel(), weight.shape[1], weight.shape[0]) == "onednn"


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [r, k] @ b_t.T [k, c] (+ bias [c]) by oneDNN; any strides."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


def _grad_weight(gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X [o, i], as (X^T dY)^T: oneDNN copies a strided first operand whole (dY^T cost 10x
    the product at the adaptive head's ~30k-output cluster), not a second. Same bits on the Zen 4
    measured (tests/test_gemm.py); laid out as the weight, so autograd keeps it as it is."""
    return _mm(x.t(), gy.t()).t().contiguous()  # [i, n] @ [n, o] -> [i, o] -> [o, i]


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with all three products (forward, dx, dW) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])  # [n, i]
        ctx.save_for_backward(x2, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return _mm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])  # [..., o]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g2 = gy.reshape(-1, weight.shape[0])  # [n, o]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(g2, weight.t()).view(ctx.x_shape)  # [n, o] @ [o, i]
        if ctx.needs_input_grad[1]:
            gw = _grad_weight(g2, x2)  # [o, i]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)  # [o]
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN where the route says so (see the module's docstring)."""
    if _routes(x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose product goes through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def adopt(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear inside ``module`` (torch's own modules included, e.g. the adaptive
    softmax's) becomes a ``Linear`` in place: only the forward changes, not the parameters."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
    return module
