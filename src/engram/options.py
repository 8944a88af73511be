"""Dataclass configs as command-line options: one argparse option per field, nothing hand-written.

Every field of a config becomes ``--field`` (also spelled ``--field-with-dashes``) taking
``--key value`` or ``--key=value``; booleans also take bare ``--flag`` / ``--no-flag``; tuples take
``--key a,b,c``; lists repeat the option, one value each (``--prompt A --prompt B``). ``--help``
shows each field's comment from the dataclass source, its type, valid values
(``field(metadata={"choices": ...})``) and default, or "required" for a field without one, so the
config stays the one place an option is documented. An unknown option names the closest known one;
every parse error is one line and exit status 2. A command with configs also takes ``--config FILE``
(YAML or JSON, :mod:`engram.configfile`: the same options as a mapping, ``steps: 300``; the command
line overrides it) and ``--print_config [yaml|json]`` (the effective options as such a file; no work
is done).

Configs are read from their source (:mod:`engram.schema`), so a config may be named by
``"module:Class"`` and its module is imported only when :func:`build` makes the instance.

A :class:`Command` is one subcommand's declaration (its positional :class:`Arg` list, its
:class:`Config` list, the function that runs it, the places it reads (:class:`In`) and writes
(:class:`Out`)); engram's commands are ``engram.cli.COMMANDS``. Calling one applies the rule every
command follows (engram/outputs.py) before its work starts: inputs exist (text inputs are text),
every output is checked, then its folders are created, locked (one writer per folder, held until the
command ends) and marked; a command that fails removes the folders it created that are still empty,
so bad input leaves the file tree as it was.

The foundation layer: imports nothing above the foundation, so every layer may use it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import configfile, outputs
from .errors import UserError
from .schema import Field, fields_of, resolve, split_ref

_SET = "_engram_set_"  # namespace prefix of values the user gave: dest = f"{_SET}{index}.{field}"
_FILE, _PRINT = "_engram_config_file", "_engram_print_config"  # dests of --config, --print_config


# -- values ----------------------------------------------------------------------------------------

def parse_value(type_name: str, raw: str, key: str, choices: Sequence[Any] | None = None) -> Any:
    """One field's value from its text, by the field's annotation (``"tuple[int, ...]"`` etc.);
    ``choices`` are the valid values (of each element, for a tuple)."""
    if raw.lower() == "none" and "None" in type_name:
        return None
    try:
        if type_name.startswith("tuple"):
            cast = _cast(type_name[len("tuple["):].split(",")[0].strip())
            value: Any = tuple(cast(x.strip()) for x in raw.split(",") if x.strip() != "")
        elif type_name.startswith("list"):
            value = _cast(type_name[len("list["):].rstrip("]").strip())(raw)
        else:
            value = _cast(type_name.split("|")[0].strip())(raw)
    except ValueError as e:
        raise UserError(f"bad value for --{key}: {raw!r} (expected {type_name})") from e
    if choices is not None:
        bad = [v for v in (value if isinstance(value, tuple) else (value,)) if v not in choices]
        if bad:
            raise UserError(f"bad value for --{key}: {', '.join(map(str, bad))} (choose from "
                            f"{', '.join(map(str, choices))})")
    return value


def _cast(name: str):
    if name == "bool":
        return _bool
    return {"int": int, "float": float}.get(name, str)


def _bool(raw: str) -> bool:
    if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(raw)
    return raw.lower() in ("true", "1", "yes")


def file_value(f: Field, value: Any, key: str) -> Any:
    """Field ``f``'s value from a config file (JSON / YAML types): a string is read as the command
    line reads its text (so YAML's ``lr: 1e-3``, a string to YAML 1.1, is a float here); numbers,
    booleans and lists must be what the field's type holds."""
    if value is None:
        if "None" in f.type:
            return None
        raise UserError(f"bad value for --{key}: null (expected {f.type})")
    if f.type.startswith("list"):  # one value per item, as the repeated option
        items = value if isinstance(value, list) else [value]
        return [parse_value(f.type, _text(f, v, key), key, f.choices) for v in items]
    if isinstance(value, list) and f.type.startswith("tuple"):
        text = ",".join(_text(f, v, key) for v in value)
    else:
        text = _text(f, value, key)
    return parse_value(f.type, text, key, f.choices)


def _text(f: Field, value: Any, key: str) -> str:
    if isinstance(value, (dict, list)):
        raise UserError(f"bad value for --{key}: {value!r} (expected {f.type})")
    return str(value).lower() if isinstance(value, bool) else str(value)


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) if value else "(empty)"
    return str(value)


# -- the parser ------------------------------------------------------------------------------------

class ConfigParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``PROG: error: ...``, exit 2) and name the closest known
    option for an unknown one."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "unrecognized arguments:" in message:
            unknown = message.split("unrecognized arguments:", 1)[1].split()
            hints = [h for h in (self.suggest(u) for u in unknown) if h]
            if hints:
                message += "; " + "; ".join(hints)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def suggest(self, arg: str) -> str:
        if not arg.startswith("-"):
            return ""
        key = arg.split("=", 1)[0]
        known = [o for a in self._actions for o in a.option_strings]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        return f"did you mean {close[0]}?" if close else ""


def new_parser(prog: str, description: str, **kw: Any) -> ConfigParser:
    return ConfigParser(prog=prog, description=description, allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def option_names(name: str, prefix: str = "") -> list[str]:
    """``--prefix_field`` and, where it has underscores, ``--prefix-field``."""
    key = f"{prefix}{name}"
    return [f"--{key}"] + ([f"--{key.replace('_', '-')}"] if "_" in key else [])


def add_config(parser: argparse.ArgumentParser, config: type | str, index: int,
               title: str | None = None, skip: Sequence[str] = (), prefix: str = "") -> None:
    """One option per field of dataclass ``config`` (a class or ``"module:Class"``), spelled
    ``--{prefix}{field}``; ``skip`` names fields another config owns, and a field whose option an
    earlier config already added is left to that one."""
    group = parser.add_argument_group(title or f"{split_ref(config)[1]} options")
    taken = {o for a in parser._actions for o in a.option_strings}
    for f in fields_of(config):
        names = [n for n in option_names(f.name, prefix) if n not in taken]
        if f.name in skip or not names:
            continue
        dest = f"{_SET}{index}.{f.name}"
        key = names[0][2:]
        kw: dict[str, Any] = dict(dest=dest, default=argparse.SUPPRESS, help=_help(f))
        if f.type.startswith("bool"):
            group.add_argument(*names, nargs="?", const="true", metavar="BOOL",
                               type=_typed(f, key), **kw)
            group.add_argument(*[f"--no-{n[2:]}" for n in names], dest=dest,
                               action="store_const", const=False, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
        elif f.type.startswith("list"):  # one value per occurrence; the option repeats
            group.add_argument(*names, action="append", metavar=_metavar(f.type),
                               type=_typed(f, key), required=f.required, **kw)
        else:
            group.add_argument(*names, metavar=_metavar(f.type), type=_typed(f, key),
                               required=f.required, **kw)


def _help(f: Field) -> str:
    what = f.type + (f": {'|'.join(map(str, f.choices))}" if f.choices else "")
    tail = "required" if f.required else f"default: {_show(f.default)}"
    text = (f.comment + " " if f.comment else "") + f"[{what}; {tail}]"
    return text.replace("%", "%%")  # argparse %-formats help strings


def _typed(f: Field, key: str):
    def parse(raw: str) -> Any:
        try:
            return parse_value(f.type, raw, key, f.choices)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = f.type  # argparse names the type in its error message
    return parse


def _metavar(type_name: str) -> str:
    base = type_name.split("|")[0].strip()
    if base.startswith("tuple"):
        return "A,B,..."
    if base.startswith("list"):
        base = base[len("list["):].rstrip("]")
    return {"int": "INT", "float": "FLOAT", "str": "STR"}.get(base, base.upper())


def given(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    """The fields of config ``index`` that the command line set."""
    prefix = f"{_SET}{index}."
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)}


def build(config: type | str, ns: argparse.Namespace, index: int, base: Any = None,
          filled: dict[str, Any] | None = None) -> Any:
    """The config instance: ``base`` (or the dataclass's defaults), then ``filled`` (a config
    file's values), then what the command line set. Imports the config's module when it is named
    by ``"module:Class"``."""
    values = dataclasses.asdict(base) if base is not None else {}
    values.update(filled or {})
    values.update(given(ns, index))
    return resolve(config)(**values)


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

    def parser(self) -> ConfigParser:
        p = new_parser(f"engram {self.name}", self.help + (f". {self.about}" if self.about else ""))
        for a in self.args:
            p.add_argument(a.name, metavar=a.name.upper(), nargs=a.nargs, help=a.help
                           + (f" ({a.deprecated} {a.name.upper()} still works, deprecated)"
                              if a.deprecated else ""))
        if self.configs:
            files = p.add_argument_group("config file")
            files.add_argument(*option_names("config"), dest=_FILE, metavar="FILE", help=(
                "options from a YAML or JSON file (option: value; a run's config.json is one); "
                "options given here override it [path; default: none]"))
            files.add_argument(*option_names("print_config"), dest=_PRINT, nargs="?", const="yaml",
                               choices=configfile.FORMATS, metavar="yaml|json", help=(
                "print the effective options (file, then command line) as a file --config reads "
                "back, and exit without doing the work [yaml|json; default: yaml when given]"))
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
        if getattr(ns, _PRINT, None):
            print(self.effective(values[len(self.args):], getattr(ns, _PRINT)))
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
                if a.dest.startswith(_SET) and a.help != argparse.SUPPRESS for o in a.option_strings}

    def _config_file(self, p: ConfigParser, argv: list[str]) -> list[dict[str, Any]]:
        """Per config, the fields ``--config FILE`` in ``argv`` sets (typed); an option the file
        gives is no longer required on the command line. UserError for a bad file or key."""
        filled: list[dict[str, Any]] = [{} for _ in self.configs]
        if not self.configs:
            return filled
        pre = ConfigParser(prog=p.prog, add_help=False, allow_abbrev=False)
        pre.add_argument(*option_names("config"), dest=_FILE)
        path = getattr(pre.parse_known_args(argv)[0], _FILE)
        if path is None:
            return filled
        label = f"--config {path}"
        owners = self._owners(p)
        records = {r for c in self.configs for r in c.records}
        for key, value in configfile.read(path).items():
            action = owners.get(str(key))
            if action is None:
                if key in records:
                    continue
                close = difflib.get_close_matches(str(key), list(owners), n=1, cutoff=0.6)
                raise UserError(f"{label}: unknown option {key!r}" + (
                    f"; did you mean {close[0]!r}?" if close else
                    f" (`engram {self.name} --print_config` lists the options)"))
            index, name = action.dest[len(_SET):].split(".", 1)
            f = next(f for f in fields_of(self.configs[int(index)].ref) if f.name == name)
            try:
                filled[int(index)][name] = file_value(f, value, str(key))
            except UserError as e:
                raise UserError(f"{label}: {e}") from None
            action.required = False
        return filled

    def effective(self, configs: list[Any], fmt: str) -> str:
        """The options of built ``configs`` as a file ``--config`` reads back (``fmt``: yaml or
        json): each option under its first spelling, in --help's order."""
        p = self.parser()
        groups: dict[int, tuple[str, dict[str, Any]]] = {}
        for a in self._owners(p).values():
            index, name = a.dest[len(_SET):].split(".", 1)
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
                    print(f"engram {self.name}: warning: {old} is deprecated and goes away in the "
                          f"next release; give the folder first: engram {self.name} "
                          f"{a.name.upper()} ...", file=sys.stderr)
                    return [value, *argv]
        return argv



class _Raise(ConfigParser):
    """Errors as UserError: for parsing inside the library, not at a prompt."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)


def parse_overrides(cls: type | str, argv: Sequence[str], base: Any = None,
                    prog: str | None = None):
    """``["--steps=100", "--engram", "false", "--engram_layers=1,3"]`` -> a ``cls`` instance, on top
    of ``base`` when given. Unknown options raise UserError naming the closest known one."""
    parser = _Raise(prog=prog or split_ref(cls)[1], allow_abbrev=False, add_help=False)
    add_config(parser, cls, 0)
    ns, rest = parser.parse_known_args(list(argv))
    if rest:
        hint = parser.suggest(rest[0])
        raise UserError(f"unknown option {rest[0]!r}" + (f"; {hint}" if hint else "")
                        + f" (known: --{', --'.join(f.name for f in fields_of(cls))})")
    return build(cls, ns, 0, base)


def field_comments(config: type | str) -> dict[str, str]:
    """``{field: comment}`` from the config's source (inherited fields included)."""
    return {f.name: f.comment for f in fields_of(config)}


__all__ = ["Arg", "Command", "Config", "ConfigParser", "In", "Out", "add_config", "build",
           "field_comments", "file_value", "given", "new_parser", "option_names", "parse_overrides",
           "parse_value"]
