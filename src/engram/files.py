"""Publishing a file atomically: write aside, fsync, rename over the old one.

A reader (another process, a resumed run, a server) sees the old file or the whole new one, never a
torn one; a failed or interrupted write leaves the old file and no temporary behind. Checkpoints,
caches, adapters, exports and table side files all publish this way.

A published file has the permissions any new file gets (0666 less the umask: 0644 under the usual
022), so a server or another user reads a checkpoint or an export as it would a file written in
place; ``tempfile.mkstemp`` would leave it owner-only (0600). Every temporary beside a path comes
from :func:`open_beside`. The foundation layer: it imports nothing else of engram, so every layer
may use it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable


def open_beside(path: str | os.PathLike) -> tuple[int, str]:
    """(fd, name) of a new, empty temporary file in ``path``'s folder, opened for writing, named
    ``.NAME.<random>.tmp``: ``mkstemp``'s contract with the umask's permissions, not 0600."""
    path = Path(path)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:  # O_EXCL: never another process's temporary; mode 0o666 & ~umask, as open() gives
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                           0o666), str(tmp)
        except FileExistsError:
            continue


def publish(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` to fill a temporary file beside ``path``, then make it ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = open_beside(path)
    mode = os.fstat(fd).st_mode & 0o777  # 0o666 less the umask
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # a writer that replaced the file (safetensors: 0600) gets it back
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
