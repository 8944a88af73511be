"""Publishing a file atomically: write aside, fsync, rename over the old one.

A reader (another process, a resumed run, a server) sees the old file or the whole new one, never a
torn one; a failed or interrupted write leaves the old file and no temporary behind. Checkpoints,
caches, adapters, exports and table side files all publish this way. The foundation layer: it
imports nothing else of engram, so every layer may use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def publish(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` to fill a temporary file beside ``path``, then make it ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def publish_text(path: str | os.PathLike, text: str) -> Path:
    return publish(path, lambda tmp: Path(tmp).write_text(text))


def publish_bytes(path: str | os.PathLike, write: Callable[[object], object]) -> Path:
    """Like :func:`publish`, for writers that take an open binary file (``np.save(f, a)``)."""
    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)
    return publish(path, fill)
