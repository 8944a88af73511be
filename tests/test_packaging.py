"""`python -m build` makes a wheel and an sdist of the distribution torch-engram; the wheel installs
with its dependencies in a fresh venv, then the sdist over it, and each passes the smoke test:
`import engram` (its version read from the installed distribution), `engram --version`,
`engram demo`. Slow (a venv and its dependencies): .ci/run runs it with `-m slow`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parent.parent
DIST = "torch-engram"


def run(*cmd, **kw):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1500,
                          **kw)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def version_of_pyproject() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]


@pytest.mark.slow
def test_wheel_and_sdist_install_in_a_fresh_venv(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    # The sdist first, then the wheel built from it: a file missing from the sdist fails here.
    run(sys.executable, "-m", "build", "--outdir", dist, REPO)
    version = version_of_pyproject()
    (wheel,) = dist.glob(f"torch_engram-{version}-*.whl")
    (sdist,) = dist.glob(f"torch_engram-{version}.tar.gz")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)  # no system site packages: only what we declare
    py, engram = venv / "bin" / "python", venv / "bin" / "engram"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["ENGRAM_CACHE"] = str(tmp_path / "cache")
    # This torch build, so pip never fetches another (on x86_64 PyPI's are CUDA builds, GBs).
    torch_req = f"torch=={torch.__version__}"
    for artifact, deps in ((wheel, True), (sdist, False)):
        args = ["install", "-q", artifact, torch_req] if deps else \
            ["install", "-q", "--no-deps", "--force-reinstall", artifact]
        run(py, "-m", "pip", *args, env=env, cwd=tmp_path)
        run(py, "-m", "pip", "check", env=env, cwd=tmp_path)
        out = run(py, "-c", "import engram, sys; print(engram.__version__, engram.__file__); "
                  "assert 'transformers' not in sys.modules", env=env, cwd=tmp_path)
        got_version, path = out.split()
        assert got_version == version and str(venv) in path  # the installed copy, not the repo
        assert run(engram, "--version", env=env, cwd=tmp_path).strip() == f"engram {version}"
        demo = run(engram, "demo", env=env, cwd=tmp_path)
        assert "gate" in demo.lower(), demo[-2000:]
    show = run(py, "-m", "pip", "show", DIST, env=env, cwd=tmp_path)
    assert f"Name: {DIST}" in show and "Requires:" in show
