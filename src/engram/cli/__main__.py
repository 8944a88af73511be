"""``python -m engram.cli``, as ``engram``."""

from . import main

raise SystemExit(main())
