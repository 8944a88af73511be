"""Publishing a file atomically: write aside, fsync, rename over the old one.

A reader (another process, a resumed run, a server) sees the old file or the whole new one, never a
torn one; a failed or interrupted write leaves the old file and no temporary behind. Checkpoints,
caches, adapters, exports and table side files all publish this way.

A published file has the permissions any new file gets (0666 less the umask: 0644 under the usual
022), so a server or another user reads a checkpoint or an export as it would a file written in
place; ``tempfile.mkstemp`` would leave it owner-only (0600). Every temporary beside a path comes
from ``open_beside``.

A disk that refuses a write (full, over quota, read-only, failing: ``DISK_ERRNOS``) fails the
publish with ``engram.errors.DiskError``, one line naming the file, the space it needed where
known and what is free there; the old file stays and the temporary goes. Writers that raise their
own exception for it (safetensors' ``SafetensorError: ... (os error 28)``) are told by the text.
The foundation layer: it imports nothing of engram but errors, so every layer may use it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import DiskError

# A write the disk refuses, with the words each says it in (safetensors and torch raise their own
# exceptions, carrying the OS's text).
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EIO: "input/output error"}
_OS_TEXT = {errno.ENOSPC: ("no space left on device", "os error 28"),
            errno.EDQUOT: ("disk quota exceeded", "os error 122"),
            errno.EROFS: ("read-only file system", "os error 30"),
            errno.EIO: ("input/output error", "os error 5")}


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


def is_temporary(name: str) -> bool:
    """Whether file ``name`` is one of ``open_beside``'s temporaries, or one safetensors makes
    beside the file it writes (Rust's tempfile: ``.tmp`` and 6 letters or digits)."""
    if name.startswith(".tmp") and len(name) == 10 and name[4:].isascii() and name[4:].isalnum():
        return True
    stem = name[:-4].rsplit(".", 1)
    return name.startswith(".") and name.endswith(".tmp") and len(stem) == 2 and \
        len(stem[1]) == 8 and all(c in "0123456789abcdef" for c in stem[1])


def sweep_temporaries(folder: str | os.PathLike, others: str | None = None) -> int:
    """Remove the temporaries (``open_beside``'s ``.NAME.<8 hex>.tmp``) a killed writer left
    in ``folder``; only for the folder's one writer (outputs.writer), who knows no other process
    is filling them. A subfolder holding a file named ``others`` (a marker) is another output,
    with writers of its own (RUN/tables): not entered. Returns how many went."""
    gone = 0
    for dirpath, dirnames, names in os.walk(folder):
        if others is not None:
            dirnames[:] = [d for d in dirnames
                           if not os.path.exists(os.path.join(dirpath, d, others))]
        for name in names:
            if is_temporary(name):
                try:
                    os.unlink(os.path.join(dirpath, name))
                    gone += 1
                except FileNotFoundError:
                    pass
    return gone


def publish(path: str | os.PathLike, write: Callable[[str], object], need: int | None = None
            ) -> Path:
    """Call ``write(tmp_path)`` to fill a temporary file beside ``path``, then make it ``path``;
    ``need``: its size in bytes, when known, for the line a full disk gives (DiskError)."""
    path = Path(path)
    with disk_errors(path, need):
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


def disk_errno(e: BaseException) -> int | None:
    """The errno of ``e`` when it is the disk refusing a write (DISK_ERRNOS), else None."""
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        return e.errno
    if isinstance(e, (OSError, RuntimeError, ValueError)) or type(e).__name__ == "SafetensorError":
        text = str(e).lower()
        for code, words in _OS_TEXT.items():
            if any(w in text for w in words):
                return code
    return None


def disk_error(e: BaseException, path: str | os.PathLike | None,
               need: int | None = None) -> DiskError | None:
    """``e`` as a one-line DiskError naming ``path`` (or the OS's filename), the space ``need``
    and what is free there; None when ``e`` is not a disk's refusal."""
    if isinstance(e, DiskError):
        return e
    code = disk_errno(e)
    if code is None:
        return None
    name = str(path if path is not None else getattr(e, "filename", None) or "a file")
    line = f"{DISK_ERRNOS[code]} writing {name}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free(Path(name))
        parts = ([f"it needs {_size(need)}"] if need else []) + (
            [f"{_size(free)} free there"] if free is not None else [])
        line += f" ({'; '.join(parts)})" if parts else ""
        line += "; nothing partial was published: free some space and run the same command again"
    elif code == errno.EROFS:
        line += "; name a folder on a writable disk"
    else:
        line += "; the disk failed a write (nothing partial was published)"
    return DiskError(code, line, name)


@contextmanager
def disk_errors(path: str | os.PathLike | None, need: int | None = None) -> Iterator[None]:
    """Within the block, a disk's refusal (``disk_error``) becomes a DiskError naming
    ``path``; a DiskError raised deeper (naming its own file) passes as it is."""
    try:
        yield
    except Exception as e:
        d = disk_error(e, path, need)
        if d is None or d is e:
            raise
        raise d from e


def _free(path: Path) -> int | None:
    """Bytes free to this user on the disk holding ``path`` (its nearest existing folder)."""
    for p in [path, *path.parents]:
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def holds(path: str | os.PathLike, data: bytes) -> bool:
    """Whether file ``path`` holds exactly ``data``: a rerun keeps it rather than write it again
    (a published file is whole, so what an interrupted command published is kept)."""
    try:
        if os.path.getsize(path) != len(data):
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def publish_text(path: str | os.PathLike, text: str) -> Path:
    return publish(path, lambda tmp: Path(tmp).write_text(text), need=len(text))


def publish_bytes(path: str | os.PathLike, write: Callable[[object], object],
                  need: int | None = None) -> Path:
    """Like ``publish``, for writers that take an open binary file (``np.save(f, a)``)."""
    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)
    return publish(path, fill, need)


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Digest of a file read in chunks: plain reads, so checking a file larger than memory leaves
    this process's memory flat (memory-mapped pages would count as resident)."""
    h, buf = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; OSError or ValueError (torn, emptied, not UTF-8, not an
    object) for the caller to name in its one line."""
    obj = json.loads(Path(path).read_text())
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj
