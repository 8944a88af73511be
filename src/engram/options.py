"""Dataclass configs as command-line options: one argparse option per field, nothing hand-written.

Every field of a config becomes ``--field`` (also spelled ``--field-with-dashes``) taking
``--key value`` or ``--key=value``; booleans also take bare ``--flag`` / ``--no-flag``. ``--help``
shows each field's type, default and the comment written beside it in the dataclass source, so the
config stays the one place an option is documented. An unknown option names the closest known one.

The foundation layer: imports nothing else from engram, so every layer may use it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import textwrap
from functools import lru_cache
from typing import Any, Sequence

_SET = "_engram_set_"  # namespace prefix of values the user gave: dest = f"{_SET}{index}.{field}"


# -- values ----------------------------------------------------------------------------------------

def parse_value(type_name: str, raw: str, key: str) -> Any:
    """One field's value from its text, by the field's annotation (``"tuple[int, ...]"`` etc.)."""
    if raw.lower() == "none" and "None" in type_name:
        return None
    try:
        if type_name.startswith("tuple"):
            inner = type_name[len("tuple["):].split(",")[0].strip()
            cast = {"int": int, "float": float}.get(inner, str)
            return tuple(cast(x.strip()) for x in raw.split(",") if x.strip() != "")
        if type_name.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError as e:
        raise ValueError(f"bad value for --{key}: {raw!r} (expected {type_name})") from e
    return raw


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) if value else "(empty)"
    return str(value)


# -- field comments --------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the class source: the comment on the field's line, else the comment
    lines right above it. Inherited fields take their comments from the class that declares them."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        source = textwrap.dedent("".join(lines))
        src_lines = source.splitlines()
        for node in ast.parse(source).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            line = src_lines[node.lineno - 1]
            comment = _trailing_comment(line)
            if not comment:  # a block of comment lines right above, skipping "-- section --" rules
                above, i = [], node.lineno - 2
                while i >= 0 and src_lines[i].strip().startswith("#"):
                    text = src_lines[i].strip().lstrip("#").strip()
                    if text.startswith("--"):
                        break
                    above.insert(0, text)
                    i -= 1
                comment = " ".join(above)
            if comment or node.target.id not in out:
                out[node.target.id] = comment
    return out


def _trailing_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i + 1:].strip()
    return ""


# -- the parser ------------------------------------------------------------------------------------

class ConfigParser(argparse.ArgumentParser):
    """argparse that names the closest known option when it meets an unknown one."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "unrecognized arguments:" in message:
            unknown = message.split("unrecognized arguments:", 1)[1].split()
            hints = [h for h in (self.suggest(u) for u in unknown) if h]
            if hints:
                message += "; " + "; ".join(hints)
        super().error(message)

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


def add_config(parser: argparse.ArgumentParser, cls: type, index: int, title: str | None = None,
               skip: Sequence[str] = ()) -> None:
    """One option per field of dataclass ``cls``; ``skip`` names fields another config owns."""
    group = parser.add_argument_group(title or f"{cls.__name__} options")
    comments = field_comments(cls)
    taken = {o for a in parser._actions for o in a.option_strings}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        type_name = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        names = [n for n in names if n not in taken]
        if not names:
            continue
        dest = f"{_SET}{index}.{f.name}"
        help_ = (comments.get(f.name, "") + " " if comments.get(f.name) else "")
        help_ += f"[{type_name}; default: {_show(default)}]"
        if type_name.startswith("bool"):
            group.add_argument(*names, dest=dest, nargs="?", const="true", default=argparse.SUPPRESS,
                               metavar="BOOL", type=_typed(type_name, f.name), help=help_)
            group.add_argument(f"--no-{f.name}", *([f"--no-{f.name.replace('_', '-')}"]
                               if "_" in f.name else []), dest=dest, action="store_const",
                               const=False, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            group.add_argument(*names, dest=dest, default=argparse.SUPPRESS,
                               metavar=_metavar(type_name), type=_typed(type_name, f.name),
                               help=help_)


def _typed(type_name: str, key: str):
    def parse(raw: str) -> Any:
        try:
            return parse_value(type_name, raw, key)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = type_name  # argparse names the type in its error message
    return parse


def _metavar(type_name: str) -> str:
    base = type_name.split("|")[0].strip()
    return {"int": "INT", "float": "FLOAT", "str": "STR"}.get(base, "A,B,..." if "tuple" in base
                                                           else base.upper())


def given(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    """The fields of config ``index`` that the command line set."""
    prefix = f"{_SET}{index}."
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)}


def build(cls: type, ns: argparse.Namespace, index: int, base: Any = None) -> Any:
    values = dataclasses.asdict(base) if base is not None else {}
    values.update(given(ns, index))
    return cls(**values)


class _Raise(ConfigParser):
    """Errors as ValueError: for parsing inside the library, not at a prompt."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse_overrides(cls: type, argv: Sequence[str], base: Any = None, prog: str | None = None):
    """``["--steps=100", "--engram", "false", "--engram_layers=1,3"]`` -> a ``cls`` instance, on top
    of ``base`` when given. Unknown options raise ValueError naming the closest known one."""
    parser = _Raise(prog=prog or cls.__name__, allow_abbrev=False, add_help=False)
    add_config(parser, cls, 0)
    ns, rest = parser.parse_known_args(list(argv))
    if rest:
        hint = parser.suggest(rest[0])
        raise ValueError(f"unknown option {rest[0]!r}" + (f"; {hint}" if hint else "")
                         + f" (known: --{', --'.join(f.name for f in dataclasses.fields(cls))})")
    return build(cls, ns, 0, base)
