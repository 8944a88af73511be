"""``python -m engram.cli``, as ``engram``."""

from . import run

raise SystemExit(run())
