"""SIGINT and SIGTERM as a request to stop at the next safe point, not an exception mid-step.

A KeyboardInterrupt raised between two lines of an optimiser step would leave half-updated weights;
a checkpoint saved then would be torn. Inside ``stop_requests`` a signal only sets a flag, which
the training loop reads at the head of each step (``training.loop.fit``: all ranks agree through one
sum, then the checkpoint hook saves the step reached, then ``errors.Interrupted``). A second Ctrl-C
stops at once (KeyboardInterrupt), for a user who will not wait for the save.

Handlers can only be set in the main thread; elsewhere ``stop_requests`` changes nothing and a
signal keeps its usual effect. The foundation layer: imports nothing else of engram.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # signal numbers received since the last clear()


def requested() -> bool:
    """Whether a stop was requested (and not yet handled)."""
    return bool(_received)


def clear() -> None:
    _received.clear()


def stderr_line(line: str) -> None:
    """``line`` and its newline on stderr in one write. ``print`` writes them apart, and a Ctrl-C
    between the two glued the command's last line ("...: interrupted; ...") onto this one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _handler(say: str | None, escalate: bool, also: Callable[[int], None] | None):
    def handle(signum: int, frame) -> None:
        if escalate and _received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the save
        first = not _received
        _received.append(signum)
        if first and say:
            stderr_line(say)
        if also is not None:
            also(signum)
    handle.engram_stop = True  # type: ignore[attr-defined]
    return handle


def install(say: str | None = None, escalate: bool = False,
            also: Callable[[int], None] | None = None,
            signals: tuple[int, ...] = SIGNALS) -> Callable[[], None] | None:
    """Make ``signals`` set the flag (see ``stop_requests``) until the returned function
    restores the previous handlers; None (nothing changed) outside the main thread or where SIGINT
    sets the flag already (a study's worker keeps its own: SIGINT only, since the pool ends its
    workers with SIGTERM and a worker that ignored it would never be joined)."""
    if threading.current_thread() is not threading.main_thread() or \
            getattr(signal.getsignal(signal.SIGINT), "engram_stop", False):
        return None
    old = {s: signal.getsignal(s) for s in signals}
    handle = _handler(say, escalate, also)
    for s in signals:
        signal.signal(s, handle)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)
    return restore


@contextmanager
def stop_requests(say: str | None = None, escalate: bool = True,
                  also: Callable[[int], None] | None = None) -> Iterator[None]:
    """Within the block SIGINT and SIGTERM set the flag ``requested`` reads (printing ``say``
    on the first); with ``escalate`` a second SIGINT raises KeyboardInterrupt; ``also(signum)``
    runs on each (a study forwards the signal to its workers)."""
    restore = install(say, escalate, also)
    try:
        yield
    finally:
        if restore is not None:
            restore()


__all__ = ["SIGNALS", "clear", "install", "requested", "stderr_line", "stop_requests"]
