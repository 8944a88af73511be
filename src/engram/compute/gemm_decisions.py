"""Where engram/compute/gemm.py keeps its measured routes between processes: a JSON file in the user's
cache, keyed by machine (CPU, torch version) and bucket, written atomically and decided under a
file lock, so concurrent first uses agree and a later run on the machine repeats bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from ..files import publish_text

# The file's format. 2: oneDNN's weight gradient changed (gemm._grad_weight, ~10x cheaper at the
# adaptive head's tail), so decisions timed before it are measured again.
VERSION = 2


def cache_path() -> Path:
    """The decisions file: $ENGRAM_GEMM_CACHE, else gemm_routes.json in $ENGRAM_CACHE (else
    $XDG_CACHE_HOME/engram, ~/.cache/engram)."""
    if os.environ.get("ENGRAM_GEMM_CACHE"):
        return Path(os.environ["ENGRAM_GEMM_CACHE"])
    root = os.environ.get("ENGRAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engram")
    return Path(root) / "gemm_routes.json"


def read(path: Path, machine: str) -> dict:
    """``machine``'s decisions in a decisions file ({} when absent, unreadable or corrupt)."""
    try:
        data = json.loads(path.read_text())
        return data["machines"].get(machine, {}) if data.get("version") == VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write(path: Path, machine: str, key: str, record: dict) -> None:
    """Add or replace ``machine``'s decision for bucket ``key``, keeping the file's other entries
    (a file of another format, or unreadable, is started afresh)."""
    try:
        data = json.loads(path.read_text())
        assert data.get("version") == VERSION and isinstance(data.get("machines"), dict)
    except (OSError, ValueError, AssertionError):
        data = {"version": VERSION, "machines": {}}
    data["machines"].setdefault(machine, {})[key] = record
    publish_text(path, json.dumps(data, indent=1, sort_keys=True))


def paths() -> list[Path]:
    """Where the decisions may live: the user's cache, else a private folder in the temp dir."""
    tmp = Path(tempfile.gettempdir()) / f"engram-{os.getuid() if hasattr(os, 'getuid') else 0}"
    return [cache_path(), tmp / "gemm_routes.json"]


@contextlib.contextmanager
def locked():
    """The first writable decisions file, held exclusively (fcntl) while one process decides;
    None where neither place is writable (the decision then stays in this process)."""
    for path in paths():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_name(path.name + ".lock"), "a")
        except OSError:
            continue
        with lock:
            try:
                import fcntl
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            except (ImportError, OSError):
                pass  # no locking here: concurrent first measurements may disagree
            yield path
        return
    yield None
