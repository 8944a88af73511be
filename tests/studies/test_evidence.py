"""The evidence a comparison reports beside the project's rule: paired intervals, tokens to target,
seeds needed."""

import math

import pytest

from engram.studies.evidence import (
    interval_text,
    mean_curve,
    paired_interval,
    seeds_needed,
    t975,
    tokens_to_target,
)


def test_paired_interval_is_the_t_interval_of_the_gains():
    # issue 33's recorded gains: mean 0.1555, sd 0.0777 over 3 seeds -> t(2) = 4.303
    gains = [0.1028, 0.2447, 0.1190]
    i = paired_interval(gains)
    sd = math.sqrt(sum((g - i["mean"]) ** 2 for g in gains) / 2)
    assert i["mean"] == pytest.approx(0.15550, abs=1e-5) and i["sd"] == pytest.approx(sd)
    half = 4.303 * sd / math.sqrt(3)
    assert (i["low"], i["high"]) == pytest.approx((i["mean"] - half, i["mean"] + half))
    assert i["excludes_zero"] is False  # [-0.037, +0.349]: those three seeds do not settle it
    assert paired_interval([0.10, 0.11, 0.12])["excludes_zero"] is True
    assert paired_interval([-0.10, -0.11, -0.12])["excludes_zero"] is True  # either sign
    assert paired_interval([0.1]) is None
    assert t975(1) == 12.706 and t975(200) == 1.96


def test_tokens_to_target_interpolates_between_evaluations():
    curve = [(0, 10.0), (100, 8.0), (200, 6.0), (300, 5.0)]
    assert tokens_to_target(curve, 7.0) == pytest.approx(150.0)
    assert tokens_to_target(curve, 8.0) == 100.0
    assert tokens_to_target(curve, 11.0) == 0.0
    assert tokens_to_target(curve, 4.0) is None
    hist = [[{"step": 0, "val_loss": 10.0}, {"tokens": 100, "loss": 9.0, "val_loss": 8.0}],
            [{"step": 0, "val_loss": 12.0}, {"tokens": 100, "loss": 9.0, "val_loss": 6.0}]]
    assert mean_curve(hist) == [(0, 11.0), (100, 7.0)]


def test_seeds_needed_at_the_measured_effect():
    need = seeds_needed([0.1028, 0.2447, 0.1190], [0.0835, 0.0835, 0.0533])
    # sd 0.0777, mean 0.1555: t(n-1) x sd / sqrt(n) < mean first at n = 4 (3.182 x 0.0389)
    assert need["paired_interval_seeds"] == 4
    assert need["rule_run_sd_measured"] == pytest.approx(0.0835 / 1.693)
    assert need["rule_run_sd_needed_at_3_seeds"] == pytest.approx(0.1555 / (2 * 1.693), rel=1e-3)
    assert seeds_needed([0.1, -0.1, 0.1, -0.1], [0.2])["paired_interval_seeds"] is None


def test_interval_text_says_whether_the_sign_is_supported():
    # no-compress's per-seed deltas in benchmarks/results/ablate/: small, but the same sign in
    # every seed; orders234's: as small a mean, signs that disagree
    assert interval_text(paired_interval([0.0151, 0.0121, 0.0100])) == \
        "[+0.0060, +0.0188]: excludes zero"
    assert interval_text(paired_interval([-0.0303, 0.0283, -0.0159])).endswith("includes zero")
    assert interval_text(paired_interval([0.05])) == "n/a (one seed)"
    assert interval_text(paired_interval([0.2, 0.1]), " nats").endswith("] nats: includes zero")
