"""What the user can fix, told apart from what is a bug.

``UserError`` is raised where input from outside the program is wrong: a config value out of range,
an unknown tier or source name, a run folder without checkpoints, a path that names no file. The
command line prints it as one line, ``engram CMD: error: MESSAGE``, and exits 2; every other
exception is a bug and keeps its traceback. It is a ValueError, so library callers that catch
ValueError keep working; ``InputNotFound`` and ``OutputExists`` are also the OSErrors they replace.
``NonFinite`` is training that met a NaN or infinite loss or gradient (a UserError: the settings
diverge). ``DiskError`` is a write the disk refused (full, over quota, read-only, failing): not bad
input and not a bug, also one line (exit 1) naming the file and the space it needed; nothing partial
was published (engram.files). ``FolderBusy``: another process writes the folder a command would
write (one writer per folder, engram.outputs). ``Interrupted`` is not an error: SIGINT or SIGTERM
stopped the work at a safe point (the command line exits 130 with its message, which says what was
kept).

The foundation layer: imports nothing else of engram, so every layer may raise it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input the user can fix; the message says what was wrong and, where it helps, what to
    do."""


class InputNotFound(UserError, FileNotFoundError):
    """A file or folder the user named (or a package a source needs) is not there; still a
    FileNotFoundError for callers that catch that."""


class OutputExists(UserError, FileExistsError):
    """A place the user named for output holds something this command must not overwrite."""


class FolderBusy(UserError):
    """Another process is writing the folder a command would write (outputs.writer's lock)."""


class NonFinite(UserError):
    """A training step's loss or gradient norm is NaN or infinite; the step was not applied."""

    def __init__(self, message: str, step: int = 0):
        super().__init__(message)
        self.step = step  # the step that failed (1-based: the steps done before it are kept)

    def __reduce__(self):  # whole across processes (a study's worker raises it)
        return type(self), (str(self), self.step)


class DiskError(OSError):
    """A write failed for the disk's sake (ENOSPC, EDQUOT, EROFS, EIO); the message names the file
    and, for a full disk, the space it needed. ``kept``: what the folder still holds (the command
    line adds it to the line)."""

    def __init__(self, errno: int, message: str, filename: str | None = None):
        super().__init__(errno, message)
        self.filename = filename
        self.kept: str | None = None

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # whole across processes (a study's worker raises it)
        return type(self), (self.errno, self.strerror, self.filename)


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped a command at a safe point; the message says what was kept."""


__all__ = ["DiskError", "FolderBusy", "InputNotFound", "Interrupted", "NonFinite", "OutputExists",
           "UserError"]


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut at ``limit`` characters: for a UserError that
    names what a library raised (its messages may span lines)."""
    return " ".join(str(e).split())[:limit]
