"""numba for the package's compiled CPU kernels (module/kernels.py, training/row_kernels.py): the
decorator they share and the LLVM operations numba does not spell. Import only from those kernel
files, which are themselves imported on first use (importing numba costs ~0.5 s)."""

from __future__ import annotations

import types as types_

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def kernel(parallel: bool = False):
    """numba.njit, cached on disk next to the source (or in numba's user cache where that is
    read-only) under names of this numba's version (see _named); with no writable place at all,
    compiled again in each process (~1 s).

    A parallel kernel also carries ``.serial``, the same loops compiled without threads, for
    callers that run on one thread: numba's thread pool, once started, keeps a worker spinning
    after each parallel loop, and beside other single-threaded processes (`engram compare`'s
    workers) that took the cores from them (training ran 10x slower).

    No fastmath: IEEE arithmetic, so a kernel's bits do not depend on how LLVM optimised it.
    numba links a copy of each kernel a kernel calls (a parallel loop's body too) into the caller
    and optimises it again; a process that compiled them runs the callees as first compiled, one
    that loaded the caller from the cache runs the copies. With reassociation allowed the two
    vectorised their sums differently (gradients parted by ~1e-5: serial twins against parallel
    kernels when one came from the cache and the other was compiled, the failure CI saw twice).
    Its price: the gate's sums over a row stay sequential, 5-12% of the kernels' own time
    (docs/speed.md)."""
    # error_model="numpy": a float division may not raise, so the loops vectorise (5x here).
    opts = dict(nogil=True, error_model="numpy")

    def wrap(fn):
        compiled = _njit(_named(fn, ""), parallel=parallel, **opts)
        if parallel:
            # a name of its own: numba's disk cache is keyed by it, not by the options
            compiled.serial = _njit(_named(fn, "_serial"), parallel=False, **opts)
        return compiled
    return wrap


# numba names a function's cache files by its qualified name and keeps one index per name, which
# it discards when another numba version wrote it. Two versions over one source tree (vLLM's venv
# has its own numba and shares this package, README) would each recompile what the other wrote
# and, running at once (pytest-xdist beside vLLM's tests), could load the other's files: numba
# 0.65's LLVM refuses 0.68's bitcode ("Unknown attribute kind"), and older bitcode may compile to
# other bits. A version tag in the name keeps each version's files apart, as CPython's cpython-311
# tag does for .pyc files.
_TAG = "numba_" + "".join(c if c.isalnum() else "_" for c in numba.__version__)


def _named(fn, suffix: str):
    """fn as a function whose qualified name carries ``suffix`` and numba's version (_TAG)."""
    named = types_.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix,
                                fn.__defaults__, fn.__closure__)
    named.__qualname__ = f"{fn.__qualname__}{suffix}.{_TAG}"
    named.__doc__, named.__module__ = fn.__doc__, fn.__module__
    return named


def _njit(fn, **opts):
    try:
        return numba.njit(cache=True, **opts)(fn)
    except RuntimeError:  # no writable cache place (read-only install, no home)
        return numba.njit(**opts)(fn)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c rounded once, as torch's CPU lerp_ and addcmul_ compute it."""
    def codegen(context, builder, sig, args):
        return builder.fma(*args)
    return a(a, b, c), codegen


@intrinsic
def pow2(typingctx, k):
    """2^k as float32 for an int32 k in [-126, 127], built from its bits (vectorises; ldexp and a
    table lookup do not)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.int32), codegen


def cached(module: str) -> bool:
    """Whether this numba version has compiled a kernel of ``module`` (a module's file, e.g.
    ``engram/module/kernels.py``) into its disk cache here: its index files beside the source or in
    numba's user cache. False means the next run compiles them (~20 s, docs/speed.md)."""
    from pathlib import Path

    src = Path(module)
    places = [src.parent / "__pycache__"]
    if numba.config.CACHE_DIR:
        places.append(Path(numba.config.CACHE_DIR))
    pattern = f"{src.stem}.*.{_TAG}*.nbi"
    return any(next(p.rglob(pattern), None) is not None for p in places if p.is_dir())
