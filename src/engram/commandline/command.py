"""One subcommand's declaration (its positional ``Arg`` list, its
``Config`` list, the function that runs it, the places it reads (``In``) and writes
(``Out``)); engram's commands are ``engram.cli.COMMANDS``. Calling one applies the rule every
command follows (engram/outputs.py) before its work starts: inputs exist (text inputs are text),
every output is checked, then its folders are created, locked (one writer per folder, held until the
command ends) and marked; a command that fails removes the folders it created that are still empty,
so bad input leaves the file tree as it was.

The foundation layer (beside options.py, whose parsers it builds): imports nothing above
the foundation, so every layer may use it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import outputs
from ..errors import UserError
from ..interrupts import stderr_line
from . import configfile
from .options import (
    FILE_DEST,
    PRESET_DEST,
    PRINT_DEST,
    SET_PREFIX,
    ConfigParser,
    add_config,
    build,
    file_value,
    new_parser,
    option_names,
)
from .schema import fields_of, split_ref


# -- commands --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arg:
    """A positional argument; ``name`` is the run function's parameter, NAME its metavar."""
    name: str
    help: str
    nargs: str | None = None  # "+": one or more
    deprecated: str | None = None  # an old option spelling still accepted, e.g. "--run"


@dataclass(frozen=True)
class Config:
    """A config dataclass whose fields are options: the class, or ``"module:Class"`` for one whose
    module is heavy (imported only when the command runs)."""
    ref: type | str
    title: str | None = None  # the --help group; None: "<Class> options"
    skip: tuple[str, ...] = ()  # fields left out (another config, or the command, sets them)
    prefix: str = ""  # options spelled --{prefix}{field}
    # Keys a saved config holds that are records, not options (a torchrun run's config.json has
    # world_size): a --config file may carry them; they are ignored where no option owns them.
    records: tuple[str, ...] = ()


@dataclass(frozen=True)
class In:
    """An argument or option naming a file or folder the command reads."""
    name: str
    text: bool = False  # a text file: must decode as UTF-8 (a binary file is refused)
    check: bool = True  # must exist (False: the value may also be a name, e.g. a model alias)


@dataclass(frozen=True)
class Out:
    """An argument or option naming a place the command writes (engram/outputs.py's rule)."""
    name: str
    kind: str = outputs.FILE  # FILE: one file; else the kind of folder (its marker says it)
    of: str | None = None  # the input this folder is tied to (an export of one run): recorded
    whole: bool = False  # the command publishes the whole folder itself: only checked, not made
    # Where it goes when the value is None, from the other values: ``default(get)``, ``get(name)``.
    default: Callable[[Callable[[str], Any]], str | None] | None = None


@dataclass(frozen=True)
class Command:
    """One subcommand, declared once: its parser comes from ``args`` and ``configs``; calling it
    with argv parses, builds one instance per config, checks and claims its places (``reads``,
    ``writes``) and calls ``run(*positionals, *configs)``."""
    name: str
    help: str
    run: Callable[..., int | None]
    args: tuple[Arg, ...] = ()
    configs: tuple[Config, ...] = ()
    about: str = ""  # more text for `engram CMD --help`
    reads: tuple[In, ...] = ()  # files or folders the command reads
    writes: tuple[Out, ...] = ()  # places the command writes
    interrupted: str = "nothing was kept to resume from; a rerun starts over"  # after Ctrl-C
    passthrough: bool = False  # run(argv): the options are another program's (lm-eval's)
    # Named sets of option values (``--preset NAME``), read like a --config file's: the file and
    # the command line override them. One place a setting that a study measured is kept by name.
    presets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, hash=False)

    def parser(self) -> ConfigParser:
        p = new_parser(f"engram {self.name}", self.help + (f". {self.about}" if self.about else ""))
        for a in self.args:
            p.add_argument(a.name, metavar=a.name.upper(), nargs=a.nargs, help=a.help
                           + (f" ({a.deprecated} {a.name.upper()} still works, deprecated)"
                              if a.deprecated else ""))
        if self.configs:
            files = p.add_argument_group("config file")
            files.add_argument(*option_names("config"), dest=FILE_DEST, metavar="FILE", help=(
                "options from a YAML or JSON file (option: value; a run's config.json is one); "
                "options given here override it [path; default: none]"))
            files.add_argument(*option_names("print_config"), dest=PRINT_DEST, nargs="?", const="yaml",
                               choices=configfile.FORMATS, metavar="yaml|json", help=(
                "print the effective options (file, then command line) as a file --config reads "
                "back, and exit without doing the work [yaml|json; default: yaml when given]"))
            if self.presets:
                shown = "; ".join(f"{k}: {_show_preset(v)}" for k, v in self.presets.items())
                files.add_argument(*option_names("preset"), dest=PRESET_DEST,
                                   choices=list(self.presets), help=(
                    f"a named set of options ({shown}); --config and the options given here "
                    "override it [name; default: none]"))
        for i, c in enumerate(self.configs):
            add_config(p, c.ref, i, c.title, c.skip, c.prefix)
        return p

    def options(self) -> set[str]:
        """Names that ``reads`` / ``writes`` may use: the positionals and every config field."""
        return {a.name for a in self.args} | {f.name for c in self.configs
                                               for f in fields_of(c.ref)}

    def __call__(self, argv: Sequence[str]) -> int:
        if self.passthrough:
            return self.run(list(argv)) or 0
        argv = self._undeprecate(list(argv))
        p = self.parser()
        filled = self._config_file(p, argv)
        ns = p.parse_args(argv)
        values = [getattr(ns, a.name) for a in self.args]
        values += [build(c.ref, ns, i, filled=filled[i]) for i, c in enumerate(self.configs)]
        if getattr(ns, PRINT_DEST, None):
            print(self.effective(values[len(self.args):], getattr(ns, PRINT_DEST)))
            return 0
        outputs.COMMAND_LINE[:] = [f"engram {self.name}", *argv]  # what a writer lock names
        with contextlib.ExitStack() as hold:  # the writer locks of the output folders
            claimed = self.prepare(values, hold)
            try:
                return self.run(*values) or 0
            except BaseException:  # bad input found late, a bug, an interrupt: no empty folders
                hold.close()  # unlocked first: a lock file is content to release()
                for created, path in claimed:
                    outputs.release(created, path)
                raise

    # -- config files ------------------------------------------------------------------------------
    def _owners(self, p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
        """Option name (both spellings, no dashes) -> its action, for every config field shown."""
        return {o[2:]: a for a in p._actions
                if a.dest.startswith(SET_PREFIX) and a.help != argparse.SUPPRESS for o in a.option_strings}

    def _config_file(self, p: ConfigParser, argv: list[str]) -> list[dict[str, Any]]:
        """Per config, the fields ``--preset NAME`` and then ``--config FILE`` in ``argv`` set
        (typed); an option they give is no longer required on the command line. UserError for a
        bad file or key."""
        filled: list[dict[str, Any]] = [{} for _ in self.configs]
        if not self.configs:
            return filled
        pre = ConfigParser(prog=p.prog, add_help=False, allow_abbrev=False)
        pre.add_argument(*option_names("config"), dest=FILE_DEST)
        pre.add_argument(*option_names("preset"), dest=PRESET_DEST)
        known = pre.parse_known_args(argv)[0]
        path, preset = getattr(known, FILE_DEST), getattr(known, PRESET_DEST)
        sources = []  # (label, {key: value}), the later overriding the earlier
        if preset is not None and preset in self.presets:  # a bad name: argparse's choices say so
            sources.append((f"--preset {preset}", self.presets[preset]))
        if path is not None:
            sources.append((f"--config {path}", configfile.read(path)))
        owners = self._owners(p)
        records = {r for c in self.configs for r in c.records}
        # A run's config.json holds every TrainConfig field, those this command sets itself too
        # (a study's warmup, a tier): passed over, and said.
        unowned = {s for c in self.configs for s in c.skip} - set(owners)
        for label, values in sources:
            passed = []
            for key, value in values.items():
                action = owners.get(str(key))
                if action is None:
                    if key in records:
                        continue
                    if key in unowned:
                        passed.append(str(key))
                        continue
                    close = difflib.get_close_matches(str(key), list(owners), n=1, cutoff=0.6)
                    raise UserError(f"{label}: unknown option {key!r}" + (
                        f"; did you mean {close[0]!r}?" if close else
                        f" (`engram {self.name} --print_config` lists the options)"))
                index, name = action.dest[len(SET_PREFIX):].split(".", 1)
                f = next(f for f in fields_of(self.configs[int(index)].ref) if f.name == name)
                try:
                    filled[int(index)][name] = file_value(f, value, str(key))
                except UserError as e:
                    raise UserError(f"{label}: {e}") from None
                action.required = False
            if passed:
                stderr_line(f"engram {self.name}: {label}: passed over {', '.join(passed)} (this "
                            "command sets them itself)")
        return filled

    def effective(self, configs: list[Any], fmt: str) -> str:
        """The options of built ``configs`` as a file ``--config`` reads back (``fmt``: yaml or
        json): each option under its first spelling, in --help's order."""
        p = self.parser()
        groups: dict[int, tuple[str, dict[str, Any]]] = {}
        for a in self._owners(p).values():
            index, name = a.dest[len(SET_PREFIX):].split(".", 1)
            c = self.configs[int(index)]
            title, values = groups.setdefault(int(index), (
                c.title or f"{split_ref(c.ref)[1]} options", {}))
            values.setdefault(a.option_strings[0][2:], getattr(configs[int(index)], name))
        return configfile.dump([groups[i] for i in sorted(groups)], fmt,
                               header=f"engram {self.name} --config FILE reads this back")

    # -- the places a command reads and writes -----------------------------------------------------
    def _where(self, name: str) -> tuple[int, str]:
        """(index into the run's values, the label the user knows it by) of ``name``."""
        for i, a in enumerate(self.args):
            if a.name == name:
                return i, a.name.upper()
        for i, c in enumerate(self.configs):
            if name not in c.skip and any(f.name == name for f in fields_of(c.ref)):
                return len(self.args) + i, f"--{c.prefix}{name}"
        raise KeyError(f"{self.name}: no argument or option {name!r}")

    def _get(self, values: list[Any], name: str) -> Any:
        i, _ = self._where(name)
        return getattr(values[i], name) if i >= len(self.args) else values[i]

    def prepare(self, values: list[Any], hold: contextlib.ExitStack | None = None
                ) -> list[tuple[Path | None, Path]]:
        """Check every input and output, fill in outputs' defaults (in ``values``), then create,
        lock (into ``hold``: one writer per folder, outputs.writer) and mark the output folders;
        returns (top folder created, folder) per folder claimed."""
        for r in self.reads:
            _, label = self._where(r.name)
            given = self._get(values, r.name)
            for v in given if isinstance(given, (list, tuple)) else [given]:
                if v is None or not r.check:
                    continue
                if r.text:
                    outputs.read_text(v, label)
                else:
                    outputs.check_input(v, label)
        places, wholes = [], []
        by = f"engram {self.name}"
        # Under torchrun, rank 0 checks, creates and marks the output folders; the other ranks
        # do not look (they would race rank 0's writes: a marker being published is a stray file
        # for a moment). A refusal on rank 0 makes torchrun stop them.
        follower = int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0"
        for w in self.writes:
            i, label = self._where(w.name)
            path = self._get(values, w.name)
            if path is None and w.default is not None:
                path = w.default(lambda n: self._get(values, n))
                if path is not None and i >= len(self.args):  # the command sees where it writes
                    values[i] = dataclasses.replace(values[i], **{w.name: path})
            if path is None or follower:
                continue
            of = self._get(values, w.of) if w.of is not None else None
            of = str(Path(of).resolve()) if of is not None else None
            if w.kind == outputs.FILE:
                outputs.check_file(path, by, label)
            elif w.whole:
                outputs.check_new_folder(path, label)
                wholes.append((path, label))
            else:
                outputs.check_folder(path, w.kind, label, of)
                places.append((w, path, label, of))
        claimed = [(outputs.claim_folder(path, w.kind, by, label, of, hold), Path(path))
                   for w, path, label, of in places]
        for path, label in wholes:  # locked beside: the folder appears whole, by a rename
            parent = Path(path).parent
            claimed.append((outputs.make_folders(parent), parent))
            if hold is not None:
                hold.enter_context(outputs.writer(path, label, beside=True))
        return claimed

    def _undeprecate(self, argv: list[str]) -> list[str]:
        """``--run DIR`` -> ``DIR`` first (the deprecated spelling of the first positional)."""
        for a in self.args[:1]:
            old = a.deprecated
            if old is None:
                continue
            for i, tok in enumerate(argv):
                if tok == old and i + 1 < len(argv) or tok.startswith(f"{old}="):
                    value = argv[i + 1] if tok == old else tok.split("=", 1)[1]
                    del argv[i:i + (2 if tok == old else 1)]
                    stderr_line(f"engram {self.name}: warning: {old} is deprecated and goes away "
                                f"in the next release; give the folder first: engram "
                                f"{self.name} {a.name.upper()} ...")
                    return [value, *argv]
        return argv


def _show_preset(values: dict[str, Any]) -> str:
    """A preset's options as --help shows them: ``--steps 960 --seeds 0,1,2``."""
    return " ".join(f"--{k} {','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                    for k, v in values.items())
