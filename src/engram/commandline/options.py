"""Dataclass configs as command-line options: one argparse option per field, nothing hand-written.

Every field of a config becomes ``--field`` (also spelled ``--field-with-dashes``) taking
``--key value`` or ``--key=value``; booleans also take bare ``--flag`` / ``--no-flag``; tuples take
``--key a,b,c``; lists repeat the option, one value each (``--prompt A --prompt B``). ``--help``
shows each field's comment from the dataclass source, its type, valid values
(``field(metadata={"choices": ...})``) and default, or "required" for a field without one, so the
config stays the one place an option is documented. An unknown option names the closest known one;
every parse error is one line and exit status 2. A command with configs also takes ``--config FILE``
(YAML or JSON, ``engram.commandline.configfile``: the same options as a mapping, ``steps: 300``; the command
line overrides it) and ``--print_config [yaml|json]`` (the effective options as such a file; no work
is done).

Configs are read from their source (``engram.commandline.schema``), so a config may be named by
``"module:Class"`` and its module is imported only when ``build`` makes the instance.

Commands (one subcommand's declaration, its parser built from its configs here) are
``engram.commandline.command``.

The foundation layer: imports nothing above the foundation, so every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Sequence

from ..errors import UserError
from .schema import Field, fields_of, resolve, split_ref

SET_PREFIX = "_engram_set_"  # namespace prefix of values the user gave: dest = f"{SET_PREFIX}{index}.{field}"
FILE_DEST, PRINT_DEST = "_engram_config_file", "_engram_print_config"  # dests of --config, --print_config
PRESET_DEST = "_engram_preset"  # dest of --preset


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
        dest = f"{SET_PREFIX}{index}.{f.name}"
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
    prefix = f"{SET_PREFIX}{index}."
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


__all__ = ["ConfigParser", "add_config", "build", "field_comments", "file_value", "given",
           "new_parser", "option_names", "parse_overrides", "parse_value"]
