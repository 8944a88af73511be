"""What the benchmarks share: writing results (the JSON file, its folder made first), the process
settings compare's workers run with, and the small model of every ``--smoke`` run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# --smoke: a model and corpus small enough for CI (the code paths, not the figures)
SMOKE = dict(max_chars=30_000, n_layer=2, d_model=32, n_head=2, table_size=997,
             n_embed_per_ngram=32, n_head_per_ngram=2, engram_layers=(0,))


def write_json(path: str | Path, results: Any, indent: int = 2) -> None:
    """``results`` as JSON at ``path``, its folders made as needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent))


def with_allocator_env() -> None:
    """Run under compare's workers' allocator settings (engram.training.train.ALLOCATOR_ENV: freed
    memory kept). glibc reads them at start-up only, so without them the script starts again."""
    from engram.training.train import ALLOCATOR_ENV

    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
