"""What a comparison over seeds supports, beyond the project's rule (common.RULE): a paired 95%
interval of the per-seed gains, tokens to a target loss, and how many seeds a verdict would need.

The rule (difference > 2x the largest seed spread) judges a difference against the spread of the
runs themselves; a seed changes both the initialisation and the batch order, and it is the same for
every variant, so the per-seed differences are paired and their own spread is the one that
matters for the sign. Both are reported; neither replaces the other.

Tokens to target (as the nanoGPT speedrun reports a gain): the fraction of the baseline's tokens
at which a variant's validation curve first reaches the baseline's final validation loss.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; 1.96 beyond the table.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060,
        2.056, 2.052, 2.048, 2.045, 2.042)
# Expected range (max - min) of n draws of a normal, in standard deviations (d2 of quality
# control charts): what the project's rule's "largest seed spread" grows like with more seeds.
D2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078,
      12: 3.258, 15: 3.472, 20: 3.735}


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); sd 0 for one value."""
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def paired_interval(gains: Sequence[float]) -> dict[str, Any] | None:
    """The 95% t-interval of the mean of paired per-seed gains; None below two seeds. ``excludes
    zero`` is the interval's verdict (the sign of the gain is supported)."""
    if len(gains) < 2:
        return None
    m, sd = mean_sd(gains)
    half = t975(len(gains) - 1) * sd / math.sqrt(len(gains))
    return {"mean": m, "sd": sd, "low": m - half, "high": m + half, "seeds": len(gains),
            "excludes_zero": m - half > 0 or m + half < 0}


def interval_text(iv: dict[str, Any] | None, unit: str = "") -> str:
    """A ``paired_interval`` as reports write it: ``[low, high]{unit}: excludes zero`` (or
    includes zero); ``n/a (one seed)`` for None."""
    if iv is None:
        return "n/a (one seed)"
    side = "excludes zero" if iv["excludes_zero"] else "includes zero"
    return f"[{iv['low']:+.4f}, {iv['high']:+.4f}]{unit}: {side}"


def tokens_to_target(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first token count at which the curve [(tokens, loss)] reaches ``target``, linear
    between evaluations; None when it never does."""
    prev = None
    for tokens, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(tokens)
            t0, l0 = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def mean_curve(histories: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[float, float]]:
    """The mean validation curve [(tokens, loss)] of runs that evaluated at the same tokens."""
    curves = [[(h["tokens"] if "tokens" in h else 0, h["val_loss"]) for h in hist
               if "val_loss" in h] for hist in histories]
    n = min(len(c) for c in curves)
    return [(curves[0][i][0], sum(c[i][1] for c in curves) / len(curves)) for i in range(n)]


def seeds_needed(gains: Sequence[float], spreads: Sequence[float], max_seeds: int = 20
                 ) -> dict[str, Any]:
    """At the measured effect and spreads, the seeds each verdict would need.

    Paired interval: the smallest n whose 95% interval, at the measured mean and sd of the gains,
    excludes zero. The rule: its spread is a range over seeds, which grows with their number
    (``D2``), so more seeds do not help it: what it needs is a per-run sd below
    gain / (2 x d2(n)); given here as the per-run sd that would resolve it at 3 seeds, against
    the measured one (estimated as spread / d2(seeds))."""
    out: dict[str, Any] = {}
    if len(gains) >= 2:
        m, sd = mean_sd(gains)
        need = next((n for n in range(2, max_seeds + 1)
                     if abs(m) - t975(n - 1) * sd / math.sqrt(n) > 0), None)
        out["paired_interval_seeds"] = need  # None: more than max_seeds
    k = len(gains)
    if k >= 2 and k in D2 and spreads:
        run_sd = max(spreads) / D2[k]
        m = abs(sum(gains) / k)
        out["rule_run_sd_measured"] = run_sd
        out["rule_run_sd_needed_at_3_seeds"] = m / (2 * D2[3])
    return out
