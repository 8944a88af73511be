"""Writing a benchmark's results: the JSON file, its folder made first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, results: Any, indent: int = 2) -> None:
    """``results`` as JSON at ``path``, its folders made as needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent))
