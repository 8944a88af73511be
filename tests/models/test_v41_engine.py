"""The v4.1 profile against vLLM 0.32.0's own DeepSeek-V4.1 Engram code (its Triton kernels under
Triton's interpreter, on CPU): compression map, primes, multipliers and offsets of the real sizes,
hash ids (flat batch of requests, chunked prefill with lookback ids, dead image positions), the FP8
row lookup against every tier, the post-projection gate and the token mask, the engine's weight
loader on our export, and the table-memory formula. Equal to the bit where the engine is exact,
to float32 rounding where it computes.

vLLM runs in its own process (tests/models/v41_engine_check.py), with ``ENGRAM_VLLM_PYTHON``
(.ci/run makes that venv) or this Python if it imports vllm, and Triton from
``ENGRAM_TRITON_PATH`` (CI installs it there, outside vLLM's venv) or that Python's own. Skipped
cleanly without either.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("ENGRAM_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") is not None else None)
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed (see README)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "report.json"
    paths = [str(ROOT / "src"), os.environ.get("ENGRAM_TRITON_PATH", ""),
             os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "TRITON_INTERPRET": "1"}
    done = subprocess.run([VLLM_PYTHON, str(ROOT / "tests/models/v41_engine_check.py"), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    if "skip" in rep:
        pytest.skip(f"the engine's kernels cannot run here: {rep['skip']}")
    return rep


def _ok(report, step):
    assert step not in report["errors"], report["errors"][step]


def test_compression_map_equals_the_engines(report):
    _ok(report, "token_map")
    assert report["token_map"] == {"v_prime": 99092, "ours": 99092, "equal": True}


def test_real_v41_layout_and_table_memory_equal_the_engines(report):
    _ok(report, "layout")
    lay = report["layout"]
    assert lay["primes_equal"] and lay["rows_equal"] and lay["offsets_equal"]
    assert lay["multipliers_equal"] and lay["per_layer_equal"]
    assert lay["engine_bytes"] == lay["our_bytes"] == 202_758_032_400  # FP8 + E8M0, both layers


def test_hash_ids_of_a_flat_batch_with_lookback_and_dead_positions(report):
    _ok(report, "hashes")
    h = report["hashes"]
    assert h["requests"] == 4 and h["dead"] > 0 and h["columns"] == 24
    assert h["equal"], f"{h['mismatches']} of {h['tokens'] * 2 * 24} ids differ"
    assert h["single_requests_equal"] == [True] * 4  # and each request launched alone


def test_fp8_lookup_of_an_imported_table_equals_the_engines_on_every_tier(report):
    _ok(report, "lookup_and_gate")
    assert set(report["lookup"]) == {"memory", "file", "pinned", "shared", "pool"}
    for tier, r in report["lookup"].items():
        assert r == {"fp32_equals_engine_bf16": True, "bf16_equal": True}, tier


def test_post_projection_gate_and_token_mask_equal_the_engines(report):
    _ok(report, "lookup_and_gate")
    gate = dict(report["gate"])
    old = gate.pop("old_v41_default_paper_gate_max_abs")
    assert len(gate) == 8
    for case, r in gate.items():
        assert r["max_abs"] < 2e-6, (case, r)  # float32 rounding (outputs are O(1))
        assert r["masked_untouched"] in (None, True), case
    assert old > 1e-2  # the check can fail: the profile's previous default was far off


def test_the_engines_weight_loader_takes_our_export(report):
    _ok(report, "lookup_and_gate")
    assert report["weight_loader_takes_our_export"]
