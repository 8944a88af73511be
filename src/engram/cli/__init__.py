"""The `engram` command line: every command declared once, by ``@command``
(``registry``), in the file of its kind: ``training`` (demo, train, prepare, finetune, finetune-study),
``studies`` (compare, the sweeps, study-nine, study-vision, eval, ablate, analyze), ``serving``
(generate, export-hf, pool-budget, lm-eval, import-v41, export-v41).

A command is a function decorated with ``@command(name, help, args=..., configs=..., reads=...,
writes=...)``. The declaration says everything the command line needs: the one-line help, the
positional arguments (``Arg``), the config dataclasses whose fields are its options, in order
(an earlier config owns an option name a later one also has; ``Config`` adds a group title,
fields to skip, a prefix), and which arguments and options are places it reads (``reads``: a name,
or ``In`` for a text file) and writes (``writes``: ``Out``, a file or a folder of a
kind). The function receives the positional values, then one instance per config, and prints its
result. Every command with configs also takes ``--config FILE`` and ``--print_config``
(commandline/options.py). Adding a command:

    @command("eval", "loss of a trained run on any text", args=(RUN_DIR,),
             configs=("engram.studies.evaluate:EvalConfig",),
             reads=("run_dir", In("text", text=True)), writes=(Out("json"),))
    def _eval(run_dir: str, ec) -> None:
        from .studies.evaluate import run_eval

        print(json.dumps(run_eval(run_dir, ec)))

Before the function runs, every command follows one rule for its places (engram/outputs.py,
applied by ``command.Command``): inputs exist (text inputs decode as text); outputs are checked
before any work: a folder output is new, empty or marked as this kind of folder (``.engram``),
never a file or a folder of something else; a file output is new or this command's own earlier
output. While it runs, a command holds each output folder's writer lock (``FOLDER/.engram.lock``):
a second command writing the same folder is refused in one line naming the first. A command that
fails leaves no folder it created behind.

A config whose module imports torch is named ``"module:Class"``; every config is read from its
source (``engram.commandline.schema``), so ``engram --help`` and ``engram CMD --help`` import no
torch, and a command's modules are imported only when it runs (import them inside the function).
Options that exist only on the command line (the prompts, resume, where tables live) are
dataclasses next to the commands that take them.

Errors: ``engram.errors.UserError`` (bad input) and argparse errors print one line,
``engram CMD: error: MESSAGE``, and exit 2; a disk that refuses a write (ENOSPC, EDQUOT, EROFS, EIO:
``engram.errors.DiskError``, engram/files.py) prints one line naming the file and what was
kept, and exits 1; SIGINT / SIGTERM print one line saying what was kept (training saves a
checkpoint first) and exit 130; any other exception is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import Interrupted, UserError
from ..files import disk_error
from ..interrupts import stderr_line
from ..commandline.options import ConfigParser, new_parser
# Each declares its commands, in `engram --help` order: making a run, studies, serving.
from . import training  # noqa: F401, I001
from . import studies  # noqa: F401
from . import serving  # noqa: F401
from .registry import COMMANDS, command

__all__ = ["COMMANDS", "command", "main", "run", "top_parser"]

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-engram")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def top_parser() -> ConfigParser:
    p = new_parser("engram", "Engram conditional memory for language models. "
                   "`engram COMMAND --help` lists a command's options.\n\ncommands:\n"
                   + "\n".join(f"  {k:<17} {c.help}" for k, c in COMMANDS.items())
                   + "\n\nenvironment:\n  ENGRAM_GEMM       float32 CPU matrix products: auto "
                   "(default: the faster of the two, timed per shape on first use, cached), "
                   "torch, onednn\n\nexit status: 0 done, 2 bad input (one line on stderr), 1 a "
                   "bug (traceback), 130 interrupted (Ctrl-C / SIGTERM; what was kept is said)")
    p.add_argument("--version", action="version", version=f"engram {_version()}")
    p.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input (UserError, a bad option): one line on stderr, 2. A bug: the
    exception propagates with its traceback (exit status 1)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        top_parser().parse_args(argv)  # --help / --version exit here
        top_parser().print_help()
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        stderr_line(f"engram: error: unknown command {name!r}{hint} (commands: "
                    f"{', '.join(COMMANDS)})")
        return 2
    cmd = COMMANDS[name]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    try:
        with _sigterm_as_ctrl_c():
            return cmd(rest)
    except UserError as e:
        rank = f" (rank {os.environ['RANK']})" if distributed else ""
        code, line = 2, f"engram {name}{rank}: error: {e}"
    except (Interrupted, KeyboardInterrupt) as e:  # 128 + SIGINT, the shell's convention
        said = str(e) if isinstance(e, Interrupted) else cmd.interrupted
        code, line = 130, f"engram {name}: interrupted; {said}"
        if distributed and os.environ["RANK"] != "0":
            line = ""
    except OSError as e:  # a disk that refused a write (full, read-only, failing): one line, 1
        disk = disk_error(e, None)
        if disk is None:
            raise  # any other OSError is a bug: its traceback
        rank = f" (rank {os.environ['RANK']})" if distributed else ""
        kept = f"; {disk.kept}" if disk.kept else ""  # else the line says to rerun
        code, line = 1, f"engram {name}{rank}: error: {disk}{kept}"
        disk = None  # its traceback holds what the work held open (a progress bar): let it close
    # Printed once the exception is gone and every progress bar closed, so the line stands on its
    # own, last. A bar the exception's frames held closes when they are collected, which a
    # reference cycle can put off past this line (seen: "analyze: 0/8 ...engram analyze:
    # interrupted" on one line), so the bars still open are closed here.
    if line:
        _close_bars()
        stderr_line(line)
    return code


def _close_bars() -> None:
    """Close every tqdm bar still open (each ends its line), if tqdm was loaded at all."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", ())):
        bar.close()


def run() -> int:
    """The process's entry (the ``engram`` script, ``python -m engram``): ``main``, then the
    process ends without a last garbage collection walking every object still held: a study's
    parent spent ~1.2 s of a 2.5 s Ctrl-C there on 2 cores, for memory the OS takes back anyway
    (atexit handlers still run first). Not in ``main``, which a caller's process outlives.

    Not where Triton is loaded (torch's CUDA builds import it with torch._dynamo, which every
    optimiser's first param group imports): its nanobind objects, frozen, outlive its module, and
    nanobind prints ~40 lines of "leaked instances" at exit, after the command's last line."""
    import gc

    code = main()
    if "triton" not in sys.modules:
        gc.freeze()
    return code


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (a scheduler, `kill`, torchrun stopping its workers) takes Ctrl-C's path: a clean
    stop saying what was kept, not a silent death. Training loops catch both to save first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
