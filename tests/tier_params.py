"""The (tier, front) pairs the every-tier tests run over: each registered tier bare and behind
the hot cache + prefetch (tables.cache.CachedTable under tables.prefetch.PrefetchTable).

Mooncake behind the cache is slow-marked (``-m slow`` runs it): each open of that tier starts
mooncake_master and a client on loopback (~4 s of a test on a Zen 4: ~2.5 s to listen and
mount the segment, ~1.8 to close), and the cache + prefetch front is the same code over every
tier's store, run over the other tiers in the default run; Mooncake bare stays there."""

import pytest

from engram.tables.registry import TIERS

FRONTS = ("bare", "cache+prefetch")


def tier_fronts(tiers=TIERS) -> list:
    """``pytest.param(tier, front)`` for ``@pytest.mark.parametrize("tier,front", ...)``."""
    return [pytest.param(t, f, id=f"{t}-{f}",
                         marks=pytest.mark.slow if t == "mooncake" and f != "bare" else ())
            for t in tiers for f in FRONTS]
