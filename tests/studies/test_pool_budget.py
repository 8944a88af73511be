"""`engram pool-budget` end to end on a tiny model: the windows are the hooked t_exec sums, a read
that fits with nothing injected stops fitting when latency is injected (break-even where the model
of the sweep puts it), the outputs are written, and the command line takes every field."""

import dataclasses
import json

import pytest
import torch

from engram.cli import main
from engram.cli.registry import TIER_OPTIONS
from engram.studies.pool_budget import PoolBudgetConfig, run_pool_budget
from engram.training.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool")
    pc = PoolBudgetConfig(out_dir=str(out), tiers=("memory", "pool", "file_cold", "pool_fp8"),
                          reps=3,
                          batch=2, prefill_len=64, decode_context=16, cache_fraction=0.0,
                          inject_us=(0.0, 100_000.0), inflight=1_000_000,  # one round trip
                          pool_path=str(out / "pool"))
    n = torch.get_num_threads()
    torch.set_num_threads(pc.threads)  # the entry point's setting (`engram pool-budget`)
    try:
        s = run_pool_budget(pc, TrainConfig(max_chars=30_000, engram_layers=(1, 2),
                                            table_size=3000))
    finally:
        torch.set_num_threads(n)
    assert s["threads"] == pc.threads  # the count in force, recorded
    return s, out


def test_outputs_written(summary):
    s, out = summary
    saved = json.loads((out / "budget.json").read_text())
    assert set(saved["modes"]) == {"prefill", "decode"}
    assert (out / "budget.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "Engram layer 1, window" in report and "break-even" in report


def test_real_v41_table_arithmetic(summary):
    """The real DeepSeek-V4.1 tables, as vLLM sizes its host memory: rows x (256 + 256 / 32) B in
    FP8 with E8M0 scales (spec section 3's row counts; tests/models/test_v41_engine.py checks
    the same numbers against the engine's own EngramLayout and formula)."""
    from engram.studies.pool_budget import v41_lines

    t = json.loads((summary[1] / "budget.json").read_text())["v41_tables"]
    assert {k: v["rows"] for k, v in t["layers"].items()} == {"1": 384_006_168, "14": 384_016_682}
    assert t["layers"]["1"]["fp8+e8m0"] == 384_006_168 * 264
    assert t["total"]["fp8+e8m0"] == 768_022_850 * 264 == 202_758_032_400
    # GGUF Q8_0 / Q4_0 blocks too (issue 47): 256 values in 8 blocks of 32, an fp16 scale each
    assert t["row_bytes"] == {"fp8+e8m0": 264, "fp8+fp32": 288, "bf16": 512, "fp32": 1024,
                              "int8": 272, "int4": 144}
    assert t["total"]["int4"] == 768_022_850 * 144
    assert "layer 14: 384,016,682 rows, FP8 + E8M0 101,380,404,048 B" in "\n".join(
        v41_lines(summary[0]["v41_tables"]))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_windows_and_injected_latency_move_the_verdict(summary, mode):
    m = summary[0]["modes"][mode]
    t = m["t_exec_us"]
    for lid, lay in m["layers"].items():
        assert lay["window_us"] == pytest.approx(t["embed"] + sum(t["blocks"][:lid]))
        assert lay["tiers"]["memory"]["fits"] and lay["tiers"]["pool"]["fits"]
        be = lay["break_even"]["pool"]
        lat0, lat1 = be["latency_us"]
        assert lat0 < lay["window_us"] < lat1  # 0 injected: fits; 100 ms injected: does not
        assert 0 < be["measured_us"] < 100_000 and be["trips"] == 1
        # One trip: the injection adds at least itself (a sleep can overshoot on a loaded machine,
        # so no timing tolerance here), and the break-even is where the measured line crosses
        # the window: the margin the injection eats.
        assert lat1 - lat0 >= 100_000 * 0.999
        assert be["measured_us"] == pytest.approx((lay["window_us"] - lat0) / (lat1 - lat0)
                                                  * 100_000, rel=1e-6)
        assert be["measured_us"] <= (lay["window_us"] - lat0) * 1.001
        assert be["model_us"] == pytest.approx(lay["window_us"] - lat0, rel=1e-6)
    assert m["layers"][2]["window_us"] > m["layers"][1]["window_us"]  # deeper: a wider window


def test_fp8_tiers_are_timed_and_judged(summary):
    """An FP8 + E8M0 tier gets its read timed, its verdict and its bandwidth in its own bytes
    per row (head dim + head dim / 32, against fp32's 4 x head dim)."""
    s, out = summary
    head_dim = s["row_bytes"] // 4
    assert s["tier_row_bytes"]["pool_fp8"] == head_dim + head_dim // 32
    for m in s["modes"].values():
        for lay in m["layers"].values():
            t = lay["tiers"]["pool_fp8"]
            assert t["latency_us"] > 0 and t["fits"] == (t["latency_us"] < lay["window_us"])
        bw = m["bandwidth"]
        assert bw["tier_row_bytes"] == {**{k: 4 * head_dim for k in ("memory", "pool",
                                                                     "file_cold")},
                                        "pool_fp8": head_dim + head_dim // 32}
        fp8_need = bw["required_GBps"] * (head_dim + head_dim // 32) / (4 * head_dim)
        assert bw["tier_headroom"]["pool_fp8"] == pytest.approx(bw["tier_GBps"]["pool_fp8"]
                                                                / fp8_need)
    report = (out / "report.md").read_text()
    assert "| pool_fp8 |" in report and "least bandwidth headroom" in report


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pool-budget", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for cls in (PoolBudgetConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if cls is TrainConfig and f.name in TIER_OPTIONS:  # one run's choice, not a study's
                continue
            assert f"--{f.name}" in text
    assert "reads in flight per round trip" in text


def test_bad_options_are_clear_errors(capsys):
    with pytest.raises(SystemExit) as e:  # not one of the valid values: argparse, one line
        main(["pool-budget", "--modes=train", "--out_dir=/tmp/never"])
    assert e.value.code == 2 and "(choose from prefill, decode)" in capsys.readouterr().err
    assert main(["pool-budget", "--tiers", "memory,nvme"]) == 2
    assert "unknown tiers ['nvme']" in capsys.readouterr().err
