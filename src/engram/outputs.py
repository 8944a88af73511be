"""Where a command may write, decided before it does any work.

One rule for every command (``engram.commandline.command.Command`` applies it to what each declares it writes):

- A folder output is a folder the command creates, an empty one, or one that carries the marker of
  its own kind: ``FOLDER/.engram``, a small JSON file (``{"kind": "run", "command": "engram
  train"}``) written when the folder is claimed. Anything else naming it is refused: a file, a path
  under a file, a folder of another kind (``export-hf RUN RUN``: a run is not an export) or one
  holding files engram did not write there. A folder that holds only marked folders (``out`` with
  ``out/sweep`` in it) is taken as the user's own parent of outputs, as is a folder an older engram
  wrote before markers existed (``SIGNATURES``). A folder tied to a source (an export of one
  run, a table folder of one run) records it, and refuses another.
- A file output (``--json FILE``) is a new file or one the same command wrote before (its JSON names
  the command under ``"written_by"``); never a folder, never a path under a file.
- A command that fails (bad input found late, a bug, an interrupt) removes a folder it created
  that still holds nothing but its marker, so bad input leaves the file tree as it was.
- One writer per folder: while a command writes a folder it holds an advisory lock on
  ``FOLDER/.engram.lock`` (``writer``: ``flock``, so the kernel lets go when the process dies,
  however it dies); a second writer is refused in one line naming the holder's pid and command.
  The file is removed when the writer ends; a stale one (a killed writer's) locks nothing and is
  taken over, and the new writer removes the temporaries a killed one left (``.NAME.*.tmp``).
  Readers never look at it: opening a run writes nothing and waits for nobody.

Inputs: ``check_input`` (the path exists) and ``read_text`` (UTF-8 text, no NUL bytes: a
binary file named as text is refused, naming the file).

The foundation layer: imports nothing else of engram but errors and files.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock; one writer per folder is not enforced there
    fcntl = None  # type: ignore[assignment]

from .errors import FolderBusy, InputNotFound, OutputExists, UserError
from .files import disk_errors, is_temporary, publish_text, sweep_temporaries

MARKER = ".engram"  # in every folder a command claimed: {"kind", "command"[, "of"]}
LOCK = ".engram.lock"  # in a folder while a command writes it: {"pid", "command"}, flock'd
FILE = "file"  # the kind of a one-file output
WRITTEN_BY = "written_by"  # the key naming the command in a JSON file output


# A folder of each kind as an engram without markers left it: any one test passing adopts it. A
# model folder's test is its artifacts module's, named "module:function" and imported only when a
# folder without a marker is met (the foundation does not know those folders' file names).
SIGNATURES: dict[str, tuple[Callable[[Path], bool] | str, ...]] = {
    "run": ("engram.artifacts.run:unmarked",),
    "export": ("engram.artifacts.export:unmarked",),
    "analysis": (lambda p: (p / "analysis.json").is_file(),),
    "compare": (lambda p: (p / "results.json").is_file() and (p / "runs").is_dir(),),
    "sweep": (lambda p: (p / "runs").is_dir() and any((p / f).is_file() for f in
                                                      ("allocation.json", "slots.json")),),
    "ablate": (lambda p: (p / "ablate.json").is_file(),),
    "study-nine": (lambda p: (p / "nine.json").is_file(),),
    "study-vision": (lambda p: (p / "vision.json").is_file(),),
    "finetune": (lambda p: (p / "results.json").is_file() and (p / "finetune.png").is_file(),),
    "pool-budget": (lambda p: (p / "budget.json").is_file(),),
    "corpus": (lambda p: (p / "manifest.json").is_file() or (p / "shards").is_dir(),),
}


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The marker of ``folder``, or None when it has none."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        raise UserError(f"{path} is not an engram marker (a JSON object with a kind); remove it "
                        "or name another folder")
    return data


def mark(folder: str | Path, kind: str, command: str, of: str | None = None) -> None:
    """Give ``folder`` the marker of ``kind`` unless it has one."""
    folder = Path(folder)
    if not (folder / MARKER).exists():
        marker = {"kind": kind, "command": command, **({"of": of} if of is not None else {})}
        publish_text(folder / MARKER, json.dumps(marker) + "\n")


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a folder."""
    for p in path.parents:
        if p.exists():
            return None if p.is_dir() else p
    return None


def _writable_above(path: Path, label: str) -> None:
    for p in path.parents:
        if p.exists():
            if not os.access(p, os.W_OK | os.X_OK):
                raise OutputExists(f"{label} {path}: cannot create anything in {p} (permission "
                                   "denied)")
            return


def check_folder(path: str | Path, kind: str, label: str, of: str | None = None) -> bool:
    """Refuse (OutputExists) what ``path`` must not become: see the module docstring. True when
    the folder is already this kind's (a marker or an older engram's signature), False when it
    is absent or free to claim."""
    path = Path(path)
    above = _file_above(path)
    if above is not None:
        raise OutputExists(f"{label} {path}: {above} is a file, so nothing can be written under it")
    if path.exists() and not path.is_dir():
        raise OutputExists(f"{label} {path} is a file, not a folder; name a new or empty folder "
                           "(nothing was written)")
    if not path.exists():
        _writable_above(path, label)
        return False
    marker = read_marker(path)
    if marker is not None:
        if marker["kind"] != kind:
            by = f" (from `{marker['command']}`)" if marker.get("command") else ""
            raise OutputExists(f"{label} {path} holds an engram {marker['kind']}{by}, not "
                               f"{_a(kind)}; name another folder (nothing was written)")
        if of is not None and marker.get("of") not in (None, of):
            raise OutputExists(f"{label} {path} holds {_a(kind)} of {marker['of']}, not of {of}; "
                               "name another folder (nothing was written)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise OutputExists(f"{label} {path}: permission denied")
        return True
    if any(_passes(test, path) for test in SIGNATURES.get(kind, ())):
        return True
    # A killed writer's lock and temporaries are no content: the next writer sweeps them.
    entries = [p for p in path.iterdir() if p.name != LOCK and not is_temporary(p.name)]
    if all(p.is_dir() and (p / MARKER).is_file() for p in entries):
        return False  # empty, or a folder of outputs (out/ with out/sweep): nothing to overwrite
    other = next((k for k, tests in SIGNATURES.items() if any(_passes(t, path) for t in tests)),
                 None)
    if other is not None:
        raise OutputExists(f"{label} {path} holds an engram {other}, not {_a(kind)}; name another "
                           "folder (nothing was written)")
    raise OutputExists(f"{label} {path} is not {_a(kind)} folder: it holds files engram did not "
                       f"write (no {MARKER} marker); name a new or empty folder (nothing was "
                       "written)")


def _passes(test: Callable[[Path], bool] | str, path: Path) -> bool:
    if isinstance(test, str):
        module, name = test.split(":")
        test = getattr(importlib.import_module(module), name)
    return test(path)


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def check_new_folder(path: str | Path, label: str) -> None:
    """Refuse (OutputExists) a folder output that must appear whole: anything but a new or empty
    folder."""
    path = Path(path)
    if not path.is_dir():
        check_folder(path, "new", label)  # a file, a path under a file, no permission
    elif any(path.iterdir()):
        raise OutputExists(f"{label} {path} exists and is not empty; name a new or empty folder "
                           "(nothing was written)")


def claim_folder(path: str | Path, kind: str, command: str, label: str,
                 of: str | None = None, hold: ExitStack | None = None) -> Path | None:
    """``check_folder``, then create the folder (and missing parents), take its writer lock
    into ``hold`` (``writer``; held until ``hold`` closes) when given, and mark it. Returns the
    top folder this call created (for ``release``), None when the folder was there."""
    path = Path(path)
    check_folder(path, kind, label, of)
    created = make_folders(path)
    with ExitStack() as mine:
        try:
            if hold is not None:  # before the marker: of two writers racing for a new folder,
                mine.enter_context(writer(path, label))  # one marks it
            mark(path, kind, command, of)
        except BaseException:  # a full disk, another writer: the folder made here goes again
            mine.close()
            release(created, path)
            raise
        if hold is not None:
            hold.push(mine.pop_all())
    return created


def make_folders(path: Path) -> Path | None:
    """Create folder ``path`` with its missing parents; the top one created, or None."""
    if path.exists():
        return None
    created = path
    while not created.parent.exists():
        created = created.parent
    path.mkdir(parents=True, exist_ok=True)
    return created


_held: dict[str, list[int]] = {}  # lock file -> [fd, depth]: this process's (a lock nests)
COMMAND_LINE: list[str] = []  # the command line a lock names: ``engram CMD ...`` (command.Command)


@contextmanager
def writer(folder: str | Path, label: str = "folder", beside: bool = False) -> Iterator[None]:
    """Hold the one-writer lock of ``folder`` for the block (the module docstring); FolderBusy
    (one line: the holder's pid and command) when another process holds it. ``beside``: the lock
    file is ``.NAME.engram.lock`` next to the folder, for an output that appears whole by a rename
    (nothing may be in it before). Nested holds in one process share the lock."""
    folder = Path(folder)
    path = folder.parent / f".{folder.name}{LOCK}" if beside else folder / LOCK
    key = os.path.realpath(path)
    if fcntl is None:
        yield
        return
    if key in _held:
        _held[key][1] += 1
    else:
        _held[key] = [_lock(path, folder, label), 1]
        if not beside:  # the one writer now: what a killed one was filling is nobody's
            sweep_temporaries(folder, others=MARKER)
    try:
        yield
    finally:
        entry = _held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            try:  # unlinked while held: whoever opens the name next makes a new file
                os.unlink(path)
            except OSError:
                pass
            os.close(entry[0])


def _lock(path: Path, folder: Path, label: str) -> int:
    """An fd holding ``flock(LOCK_EX)`` on the file at ``path`` (its content: this process)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FolderBusy(f"{label} {folder} is being written by {holder}; one writer per "
                             "folder: wait for it to end, or stop it (nothing was written)"
                             ) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the file may have been removed (its holder ended) between open and flock: again
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    line = " ".join(COMMAND_LINE or sys.argv)
    body = json.dumps({"pid": os.getpid(), "command": line[:300]}).encode()
    try:
        with disk_errors(path, len(body) + 1):  # a full disk fails even this: one line
            os.ftruncate(fd, 0)
            os.pwrite(fd, body + b"\n", 0)
    except BaseException:
        try:
            os.unlink(path)
        finally:
            os.close(fd)
        raise
    return fd


def _holder(fd: int) -> str:
    """"pid N (`COMMAND`)" from a held lock file; "another process" before it has written it."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {int(data['pid'])} (`{data['command']}`)"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def release(created: Path | None, path: str | Path) -> None:
    """Remove the folders a failed command created (``created`` down to ``path``) when nothing but
    the marker was written into them."""
    if created is None:
        return
    path = Path(path)
    if not path.is_dir() or any(p.name != MARKER for p in path.iterdir()):
        return
    (path / MARKER).unlink(missing_ok=True)
    for p in [path, *path.parents]:
        try:
            p.rmdir()  # only an empty folder goes
        except OSError:
            return
        if p == created:
            return


def check_file(path: str | Path, command: str, label: str) -> None:
    """Refuse (OutputExists) a file output at ``path`` that is a folder, lies under a file, or
    exists without being ``command``'s earlier output."""
    path = Path(path)
    above = _file_above(path)
    if above is not None:
        raise OutputExists(f"{label} {path}: {above} is a file, so nothing can be written under it")
    if path.is_dir():
        raise OutputExists(f"{label} {path} is a folder; name a file (nothing was written)")
    if not path.exists():
        _writable_above(path, label)
        return
    try:
        ours = json.loads(path.read_text()).get(WRITTEN_BY) == command
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise OutputExists(f"{label} {path} exists and was not written by `{command}`; name a new "
                           "file (nothing was written)")


def write_json(path: str | Path, data: dict[str, Any], command: str, indent: int | None = None
               ) -> Path:
    """Publish ``data`` at ``path`` as JSON naming ``command`` (so a rerun may replace it).
    Non-finite numbers are written as null: NaN and Infinity are not JSON."""
    text = json.dumps(finite({WRITTEN_BY: command, **data}), indent=indent, allow_nan=False)
    return publish_text(path, text + "\n")


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float (in dicts, lists, tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def check_input(path: str | Path, label: str) -> Path:
    """Refuse (InputNotFound) an input that is not there."""
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"{label} {path}: no such file or folder")
    return path


def read_text(path: str | Path, label: str) -> str:
    """The UTF-8 text of file ``path``; a folder, a binary file (NUL bytes, or bytes that are not
    UTF-8) or a missing one is refused, naming the file."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"{label} {path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{label} {path} is not UTF-8 text (byte {e.start} is "
                        f"0x{data[e.start]:02x}); give a text file") from None
    if "\x00" in text:
        raise UserError(f"{label} {path} holds NUL bytes: a binary file, not text")
    return text


__all__ = ["COMMAND_LINE", "FILE", "LOCK", "MARKER", "SIGNATURES", "WRITTEN_BY", "check_file",
           "check_folder", "check_input", "check_new_folder", "claim_folder", "finite",
           "make_folders", "mark", "read_marker", "read_text", "release", "write_json", "writer"]
