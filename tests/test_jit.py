"""engram/compute/jit.py: the kernels' disk cache is this numba's own, so two numba versions over one source
tree (vLLM's venv, README) neither recompile what the other wrote nor load it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")
import engram  # noqa: E402
from engram.compute import jit  # noqa: E402
from engram.module import kernels  # noqa: E402

PACKAGE = Path(engram.__file__).parent  # the whole package: the probe imports engram.module
# one call of a small kernel; prints numba's version, the cache's folder, its hits and misses
PROBE = ("import numba, numpy as np; from engram.module import kernels; "
         "kernels.exp_neg(np.float32(1.0)); s = kernels.exp_neg.stats; "
         "print(numba.__version__, s.cache_path, sum(s.cache_hits.values()), "
         "sum(s.cache_misses.values()))")


def test_cache_files_carry_numbas_version():
    kernels.exp_neg(np.float32(1.0))
    tag = jit._TAG
    assert numba.__version__.replace(".", "_") in tag
    files = os.listdir(kernels.exp_neg.stats.cache_path)
    assert any(f.startswith(f"kernels.exp_neg.{tag}-") and f.endswith(".nbi") for f in files), files
    # the serial twin of a parallel kernel: its own name, the same tag
    assert kernels.backward.serial.py_func.__qualname__ == f"backward_serial.{tag}"


def _probe(python: str, src: Path) -> tuple[str, int, int]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    version, path, hits, misses = out.stdout.split()
    assert Path(path).is_relative_to(src), path  # the copy's, not an installed engram's
    return version, int(hits), int(misses)


def test_two_numba_versions_keep_their_own_cache(tmp_path):
    """Our numba and vLLM's venv's (ENGRAM_VLLM_PYTHON, when its numba is another version) take
    turns over one copy of the package: each compiles once, then loads its own files. Before the
    tag each turn found the other's index and compiled again."""
    other = os.environ.get("ENGRAM_VLLM_PYTHON")
    if not other:
        pytest.skip("no second Python (ENGRAM_VLLM_PYTHON) to bring another numba")
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "engram", ignore=shutil.ignore_patterns("__pycache__"))
    ours, theirs = _probe(sys.executable, src), _probe(other, src)
    if ours[0] == theirs[0]:
        pytest.skip(f"both Pythons have numba {ours[0]}")
    assert ours[1:] == (0, 1) and theirs[1:] == (0, 1)  # a fresh copy: each compiles
    assert _probe(sys.executable, src)[1:] == (1, 0)  # ...and then loads its own
    assert _probe(other, src)[1:] == (1, 0)


def test_cached_tells_a_compiled_module_from_a_fresh_one(tmp_path):
    """jit.cached: what `engram train` asks before its first step (one line for the one-time
    compile, issue 50). A module whose kernel ran has index files; a copy never run has none."""
    import subprocess
    import sys
    from engram.compute import jit
    mod = tmp_path / "tiny_kernels.py"
    mod.write_text("from engram.compute.jit import kernel\n\n@kernel()\ndef twice(x):\n    return 2 * x\n")
    assert not jit.cached(str(mod))
    subprocess.run([sys.executable, "-c", "import tiny_kernels; tiny_kernels.twice(3)"],
                   cwd=tmp_path, check=True, env={**__import__("os").environ,
                                                  "PYTHONPATH": str(tmp_path)})
    assert jit.cached(str(mod))
