"""Valid ranges of config numbers, checked where every config checks itself: its ``__post_init__``.

    def __post_init__(self) -> None:
        check_ranges(self, steps=AT_LEAST_1, lr=POSITIVE, val_fraction=Range(0, 1, True, True))

``check_ranges`` refuses (``UserError``, one line at the command line) every float field that
is not finite (``--lr inf``, ``--grad_clip nan``: a NaN compares false with every bound, so a plain
``x < 0`` test lets it through) and every named field outside its ``Range``; a tuple is
checked element by element, and None passes (it means "the default" wherever a field allows it).

The foundation layer: imports nothing else of engram but errors, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import UserError


@dataclass(frozen=True)
class Range:
    """lo <= x <= hi (open ends with ``lo_open`` / ``hi_open``; None: unbounded)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        if self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi):
            return False
        return True

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "a number"


AT_LEAST_1 = Range(1)  # counts, sizes, intervals
NON_NEGATIVE = Range(0)  # seeds, warmup, optional extras
POSITIVE = Range(0, lo_open=True)  # learning rates, timeouts, scales
FRACTION = Range(0, 1, hi_open=True)  # shares of something that must leave some out: [0, 1)
UNIT = Range(0, 1)  # [0, 1]


def _numbers(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return []


def check_ranges(config: Any, **ranges: Range) -> None:
    """Refuse a non-finite float in any field of dataclass ``config`` and a named field outside
    its range (see the module docstring)."""
    for f in dataclasses.fields(config):
        for x in _numbers(getattr(config, f.name)):
            if isinstance(x, float) and not math.isfinite(x):
                raise UserError(f"{f.name} must be a finite number, got {x}")
    for name, r in ranges.items():
        value = getattr(config, name)
        for x in _numbers(value):
            if not r.holds(x):
                shown = value if not isinstance(value, (tuple, list)) else \
                    ",".join(map(str, value))
                each = "each of " if isinstance(value, (tuple, list)) else ""
                raise UserError(f"{each}{name} must be {r}, got {shown}")


__all__ = ["AT_LEAST_1", "FRACTION", "NON_NEGATIVE", "POSITIVE", "Range", "UNIT", "check_ranges"]
